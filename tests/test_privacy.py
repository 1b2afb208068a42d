"""DP-FedAvg (``jaxfl.core.privacy``): the clip and the noise against their formulas (jit, vmap, grad), the
accountant against an independent one, the wrapper's bound on the server's step for the averaging algorithms,
and the run options through the CLI's path (epsilon logged, exact resume, bad input in one line)."""
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_data, make_trainer, rounds_tolerance, run_step, trained_rows

from jaxfl.algorithms import REGISTRY, build_algorithm
from jaxfl.core import privacy
from jaxfl.core.privacy import accounting
from jaxfl.core.step import cohort_train, init_state, make_step
from jaxfl.core.types import RoundInfo, RunContext
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn
from jaxfl.run.cli import main

TINY = ["--dataset", "default", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40",
        "--test-per-client", "30", "--batch-size", "16", "--eval-batch-size", "32", "--lr", "0.05"]

# Google's dp_accounting 0.4 (pip install dp-accounting): RdpAccountant(orders=list(range(2, 257)),
# neighboring_relation=NeighboringRelation.REPLACE_ONE), composing SampledWithoutReplacementDpEvent(N, k,
# GaussianDpEvent(sigma)) T times; get_epsilon_and_optimal_order(delta) -> (epsilon, order). Both use Wang et
# al.'s Thm. 27 (Thm. 9 refined by forward differences).
WOR_REFERENCE = [((1000, 100, 0.5, 200, 1000 ** -1.1), (153.83280843349408, 2)),
                 ((1000, 100, 1.0, 200, 1000 ** -1.1), (16.800095191319986, 2)),
                 ((60000, 256, 1.1, 2000, 1e-5), (1.7982743625654303, 11)),
                 ((1000, 100, 2.0, 200, 1000 ** -1.1), (6.370512605357162, 3))]
# the same accountant's per-round RDP (its _compute_rdp_sample_wor_gaussian_int(q, sigma, a) / (a - 1)) at
# orders 2, 8 and 32, where the refinement is tighter than Thm. 9 (by 4 % and 21 %)
WOR_TIGHTER = ((1000, 10, 2.0), (0.00011360371352886809, 0.0004684162610720203, 0.0020793016331292226))
# RdpAccountant(orders=list(range(2, 257))) with PoissonSampledDpEvent(q, GaussianDpEvent(z)), add/remove
POISSON_REFERENCE = [((1.0, 1.0, 1, 1e-5), (4.752728336819822, 5)), ((0.1, 1.0, 100, 1e-5), (7.972921510380539, 3)),
                     ((0.01, 1.1, 10000, 1e-5), (5.6543080001495145, 5)),
                     ((0.2, 2.0, 500, 1e-6), (14.843616597479354, 3))]


@pytest.mark.parametrize("args,want", WOR_REFERENCE)
def test_the_accountant_matches_an_independent_one(args, want):
    n, k, sigma, rounds, delta = args
    eps, order = privacy.epsilon_from_rdp(rounds * privacy.rdp_wor_gaussian(k / n, sigma), delta)
    assert order == want[1]
    np.testing.assert_allclose(eps, want[0], rtol=1e-9)
    # a run's accountant: noise z = 2 sigma (replace-one doubles the sensitivity)
    assert privacy.Accountant(k / n, 2 * sigma, delta).epsilon(rounds) == pytest.approx(want[0], rel=1e-9)


def _theorem_9(q, sigma, a):
    """Wang et al.'s Thm. 9 for the Gaussian at integer order a (the bound before the refinement), by hand."""
    e = lambda j: j / (2 * sigma ** 2)
    total = 1 + q ** 2 * math.comb(a, 2) * min(4 * math.expm1(e(2)), 2 * math.exp(e(2)))
    total += sum(2 * q ** j * math.comb(a, j) * math.exp((j - 1) * e(j)) for j in range(3, a + 1))
    return min(math.log(total) / (a - 1), e(a))


def test_the_refined_bound_is_dp_accountings_and_below_theorem_9():
    (n, k, sigma), want = WOR_TIGHTER
    mine = privacy.rdp_wor_gaussian(k / n, sigma, (2, 8, 32))
    np.testing.assert_allclose(mine, want, rtol=1e-9)
    thm9 = np.array([_theorem_9(k / n, sigma, a) for a in (2, 8, 32)])
    assert mine[0] == pytest.approx(thm9[0], rel=1e-12)  # order 2 has no term to refine
    np.testing.assert_allclose(thm9[1:] / mine[1:], [1.0426, 1.2106], rtol=1e-4)


def test_the_forward_differences_are_the_moments_of_the_privacy_loss():
    # Δ^m φ(0) = E[(L - 1)^m], L = e^{(2x - 1) / (2σ²)}, x ~ N(0, σ²): by hand for m = 2, 4
    sigma = 1.3
    d = accounting._log_even_differences(sigma, 4)
    e = lambda v: math.exp(v / sigma ** 2)
    assert d[2] == pytest.approx(math.log(e(1) - 1), rel=1e-12)
    assert d[4] == pytest.approx(math.log(e(6) - 4 * e(3) + 6 * e(1) - 3), rel=1e-12)
    # at m = 256 and σ = 20 the alternating sum cancels some 120 digits (floats give nothing): a quadrature
    sigma, m = 20.0, 256
    x = np.linspace(-1200.0, 1460.0, 400_001)
    u = (2 * x - 1) / (2 * sigma ** 2)
    g = m * np.log(np.abs(np.expm1(u)) + 1e-300) - x ** 2 / (2 * sigma ** 2) - math.log(sigma * math.sqrt(2 * math.pi))
    quad = g.max() + math.log(np.exp(g - g.max()).sum() * (x[1] - x[0]))
    assert accounting._log_even_differences(sigma, m)[m] == pytest.approx(quad, rel=1e-9)


def test_a_huge_epsilon_calibrates_a_tiny_noise_without_overflow():
    # (at σ ~ 1e-3, e^{ε(2)} overflows a float: the bound works in logs)
    z = privacy.noise_for_epsilon(0.1, 1, 1e-5, 1e6)
    assert 0 < z < 0.01 and privacy.Accountant(0.1, z, 1e-5).epsilon(1) <= 1e6


@pytest.mark.parametrize("z", [1e-8, 1e-50, 1e-200])
def test_a_tiny_noise_spends_a_huge_or_infinite_epsilon_without_overflow(z):
    # (such z once divided by zero or overflowed the decimal sums, and gave NaN at sample level)
    for eps in (privacy.Accountant(0.5, z, 1e-5).epsilon(3), privacy.Accountant(0.5, z, 1e-5, "poisson").epsilon(3),
                privacy.SampleAccountant([100, 400], 32, 1, z, 1e-5, 0.5).epsilon(3),
                privacy.SampleAccountant([100, 400], 32, 1, z, 1e-5).epsilon(3)):
        assert eps > 1e15 and not math.isnan(eps)
    # below 1e-3 the curves are the Gaussian's own alpha / (2 z^2) (inf once that overflows)
    with np.errstate(over="ignore"):
        want = np.array([1.0, 4.5]) / np.float64(z) / np.float64(z)
    np.testing.assert_allclose(privacy.rdp_poisson_gaussian(0.1, z, (2, 9)), want)
    np.testing.assert_allclose(privacy.rdp_wor_gaussian(0.1, z, (2, 9)), want)


def test_an_epsilon_below_what_any_noise_certifies_is_refused_naming_the_floor():
    floor = privacy.epsilon_floor(1e-5)  # min over the orders 2..256 of log((a-1)/a) - (log delta + log a)/(a-1)
    a = np.arange(2, 257)
    assert floor == pytest.approx(np.min(np.log((a - 1) / a) - (math.log(1e-5) + np.log(a)) / (a - 1)))
    # (the Poisson curve: the replace-one bound's decimal sums take ~30 s at z = 1e6)
    assert privacy.Accountant(0.1, 1e6, 1e-5, "poisson").epsilon(10) == pytest.approx(floor, rel=1e-6)
    with pytest.raises(ConfigError, match=r"epsilon 0.01 is at or below 0.01949.*delta 1e-05"):
        privacy.noise_for_epsilon(0.1, 10, 1e-5, 0.01)
    assert privacy.noise_for_epsilon(0.1, 10, 1e-5, 0.03, "poisson") > 10


def test_the_noise_calibrated_to_an_epsilon_is_the_smallest_that_spends_at_most_it():
    q, rounds, delta = 0.1, 200, 1000 ** -1.1
    z = privacy.noise_for_epsilon(q, rounds, delta, 10.0)
    assert privacy.Accountant(q, z, delta).epsilon(rounds) <= 10.0 < privacy.Accountant(
        q, z * 0.998, delta).epsilon(rounds)
    assert 3.0 < z < 3.02  # z = 3 spends 10.05 (experiments/RESULTS.md, DP section)


def test_the_whole_population_each_round_is_the_plain_gaussian():
    # q = 1: Thm. 9 alone is 1.2-2.5 times looser; the cap makes it the Gaussian's alpha / (2 sigma^2), which
    # dp_accounting also gives (N = k = 100, sigma 1, 100 rounds, delta 1e-4: 107.82404601085629)
    np.testing.assert_allclose(privacy.rdp_wor_gaussian(1.0, 1.0, (2, 7, 40)), [1.0, 3.5, 20.0])
    eps = privacy.epsilon_from_rdp(100 * privacy.rdp_wor_gaussian(1.0, 1.0), 1e-4)[0]
    assert eps == pytest.approx(107.82404601085629, rel=1e-9)


@pytest.mark.parametrize("args,want", POISSON_REFERENCE)
def test_the_poisson_convention_matches_an_independent_one(args, want):
    q, z, rounds, delta = args
    eps, order = privacy.epsilon_from_rdp(rounds * privacy.rdp_poisson_gaussian(q, z), delta)
    assert order == want[1]
    np.testing.assert_allclose(eps, want[0], rtol=1e-9)


def test_rdp_special_cases_and_monotonicity():
    orders = (2, 3, 10, 64)
    np.testing.assert_allclose(privacy.rdp_poisson_gaussian(1.0, 1.7, orders), [a / (2 * 1.7 ** 2) for a in orders])
    # order 2 in closed form: Poisson log(1 + q^2 (e^{1/z^2} - 1));
    # Thm. 9: log(1 + q^2 min(4 (e^{1/s^2} - 1), 2 e^{1/s^2}))
    np.testing.assert_allclose(privacy.rdp_poisson_gaussian(0.3, 0.8, (2,))[0], math.log1p(0.09 * math.expm1(1 / 0.64)))
    np.testing.assert_allclose(privacy.rdp_wor_gaussian(0.3, 0.8, (2,))[0],
                               math.log1p(0.09 * min(4 * math.expm1(1 / 0.64), 2 * math.exp(1 / 0.64))))
    for rdp in (privacy.rdp_poisson_gaussian, privacy.rdp_wor_gaussian):
        assert np.all(rdp(0.0, 1.0, orders) == 0)
        assert np.all(rdp(0.01, 1.0, orders) < rdp(0.1, 1.0, orders))
        assert np.all(np.isinf(rdp(0.1, 0.0, orders)))
    acc = privacy.Accountant(0.1, 1.0, 1e-5)
    assert acc.epsilon(10) < acc.epsilon(100) < acc.epsilon(1000)
    assert math.isinf(privacy.Accountant(0.1, 0.0, 1e-5).epsilon(10))
    spent = acc.report(100)  # the valid epsilon, and the smaller Poisson convention beside it, labelled
    assert spent["epsilon"] == acc.epsilon(100) > spent["epsilon_poisson_convention"]
    assert spent["epsilon_poisson_convention"] == pytest.approx(
        privacy.epsilon_from_rdp(100 * privacy.rdp_poisson_gaussian(0.1, 1.0), 1e-5)[0])
    assert privacy.default_delta(1000) == pytest.approx(1000 ** -1.1)


def _trees(seed, k=5):
    rng = np.random.default_rng(seed)
    x = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}
    scales = jnp.asarray([0.01, 0.1, 1.0, 3.0, 0.0][:k], jnp.float32)
    xi = jax.tree_util.tree_map(lambda p: p[None] + scales.reshape((-1,) + (1,) * p.ndim)
                                * jnp.asarray(rng.normal(size=(k,) + p.shape), jnp.float32), x)
    return x, xi


def test_update_norm_and_clip_follow_their_formulas_under_jit_vmap_and_grad():
    x, xi = _trees(0)
    flat = lambda t: np.concatenate([np.ravel(t["a"]), np.ravel(t["b"])])
    norms = jax.jit(jax.vmap(privacy.update_norm, in_axes=(None, 0)))(x, xi)
    want = [np.linalg.norm(flat(jax.tree_util.tree_map(lambda p, q: q[i] - p, x, xi))) for i in range(5)]
    np.testing.assert_allclose(norms, want, rtol=1e-6)
    # a leaf marked False does not count; a traced mask counts where True
    only_a = privacy.update_norm(x, jax.tree_util.tree_map(lambda q: q[3], xi), {"a": True, "b": False})
    np.testing.assert_allclose(only_a, np.linalg.norm(np.ravel(xi["a"][3] - x["a"])), rtol=1e-6)
    traced = jax.jit(lambda s: privacy.update_norm(x, jax.tree_util.tree_map(lambda q: q[3], xi),
                                                   {"a": True, "b": s}))
    np.testing.assert_allclose(traced(jnp.array(False)), only_a, rtol=1e-6)
    # d||x_i - x|| / dx_i = (x_i - x) / ||x_i - x||
    one = jax.tree_util.tree_map(lambda q: q[2], xi)
    g = jax.grad(lambda t: privacy.update_norm(x, t))(one)
    np.testing.assert_allclose(flat(g), (flat(one) - flat(x)) / want[2], rtol=1e-5)
    clip = 0.5
    scale = privacy.clip_factor(norms, clip)
    np.testing.assert_allclose(scale, np.minimum(1.0, clip / np.maximum(np.asarray(want), 1e-30)), rtol=1e-6)
    assert float(scale[4]) == 1.0  # an update of norm 0 is not divided by 0
    clipped = jax.jit(privacy.clip_updates)(x, xi, scale)
    after = jax.vmap(privacy.update_norm, in_axes=(None, 0))(x, clipped)
    np.testing.assert_allclose(after, np.minimum(want, clip), rtol=1e-5, atol=1e-7)
    for i in np.flatnonzero(np.asarray(scale) == 1):  # an unclipped client's model is its own, bit for bit
        assert all(np.array_equal(c[i], t[i]) for c, t in zip(jax.tree_util.tree_leaves(clipped),
                                                              jax.tree_util.tree_leaves(xi)))


def test_noise_has_the_asked_std_only_on_shared_leaves():
    params = {"w": jnp.zeros((400, 250)), "head": jnp.zeros((10,))}
    noisy = jax.jit(lambda k: privacy.add_noise(k, params, {"w": True, "head": False}, 0.3))(jax.random.key(1))
    assert float(jnp.std(noisy["w"])) == pytest.approx(0.3, rel=0.02)
    assert abs(float(jnp.mean(noisy["w"]))) < 0.003
    assert np.array_equal(noisy["head"], params["head"])
    off = privacy.add_noise(jax.random.key(1), params, {"w": jnp.array(False), "head": True}, 0.3)
    assert np.array_equal(off["w"], params["w"]) and float(jnp.std(off["head"])) > 0


ALGORITHM_CTX = RunContext(num_clients=4, num_rounds=4, cohort_size=4)


def _alg(name):
    return build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(), ALGORITHM_CTX)


def test_every_algorithm_marked_for_dp_takes_the_wrapper():
    # shapes only (no compilation): the wrapper finds "params" in each one's trained rows and server state
    data = make_data([12, 20, 7, 16])
    names = [n for n, r in REGISTRY.items() if r.options.user_dp]
    assert {"fedavg", "fedprox", "fedbn", "fedper", "fedrep", "apfl", "fedala"} <= set(names)
    assert "fednova" not in names and "feddbe" not in names  # their aggregates are not plain means of updates
    for name in names:
        alg = privacy.with_privacy(_alg(name), 0.1, 1.0, jax.random.key(4))
        server, clients = init_state(alg, jax.random.key(0), data.x[0], 4)
        step = make_step(alg, clients="vmap", num_rounds=4, weighting="uniform")
        new, kept, metrics = jax.eval_shape(lambda *a: step(*a), server, clients, data, jnp.arange(4), 0,
                                            jax.random.key(3))
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(server), name
        assert metrics["update_norm"].shape == (4,), name


def test_adaptive_clipping_splits_the_noise_and_moves_the_clip_geometrically():
    z, count_std = 1.0, 2.5
    value = privacy.value_noise_multiplier(z, count_std)
    assert value == pytest.approx((1 - 1 / 25) ** -0.5) and value > z
    assert (value ** -2 + (2 * count_std) ** -2) ** -0.5 == pytest.approx(z)  # together: fixed clipping's z
    assert privacy.value_noise_multiplier(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="count noise std above 0.5"):
        privacy.value_noise_multiplier(1.0, 0.4)
    assert float(privacy.update_clip(2.0, 0.8, 0.5, 0.2)) == pytest.approx(2.0 * math.exp(-0.06))
    # on a cohort: the clip of round t + 1 from the fraction of round t's updates that fit under its clip
    data = make_data([12, 20, 7, 16])
    alg = privacy.with_privacy(_alg("fedper"), 0.2, 0.0, jax.random.key(4), quantile=0.25, clip_lr=0.5)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 4)
    step = jax.jit(lambda *a: make_step(alg, clients="vmap", num_rounds=4, weighting="uniform")(*a))
    clip = 0.2
    for r in range(3):
        new, clients, metrics = step(server, clients, data, jnp.arange(4), r, jax.random.key(3))
        assert float(alg.round_metrics(server, new)["dp_clip"]) == pytest.approx(clip)  # the clip this round used
        fits = float(np.mean(np.asarray(metrics["update_norm"]) <= clip))
        clip = clip * math.exp(-0.5 * (fits - 0.25))
        server = new
        assert float(server[privacy.CLIP_KEY]) == pytest.approx(clip, rel=1e-6)
    assert clip != pytest.approx(0.2)


def test_adaptive_noise_uses_the_current_clip_the_raised_multiplier_and_a_noised_count():
    data = make_data([12, 20, 7, 16])
    base = _alg("fedavg")
    z, count_std, key = 1.0, 0.6, jax.random.key(4)
    noisy = privacy.with_privacy(base, 0.05, z, key, quantile=0.5, clip_lr=0.3, count_std=count_std)
    quiet = privacy.with_privacy(base, 0.05, 0.0, key, quantile=0.5, clip_lr=0.3)
    server, clients = init_state(noisy, jax.random.key(0), data.x[0], 4)
    server = {**server, privacy.CLIP_KEY: jnp.float32(0.07)}  # a later round's clip, not the initial 0.05
    rows, metrics = cohort_train(noisy, clients="vmap", num_rounds=4)(server, clients, data, jnp.arange(4), 2,
                                                                       jax.random.key(3))
    weights, info = jnp.ones(4), RoundInfo(jnp.int32(2), jnp.arange(4, dtype=jnp.int32), 4)
    new = jax.jit(lambda s, t: noisy.aggregate(s, t, weights, info)[0])(server, rows)
    calm = jax.jit(lambda s, t: quiet.aggregate(s, t, weights, info)[0])(server, rows)
    diff = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(new["params"]),
                                                            jax.tree_util.tree_leaves(calm["params"]))])
    sigma = privacy.value_noise_multiplier(z, count_std)  # 1.81, not z
    assert float(np.std(diff)) == pytest.approx(sigma * 0.07 / 4, rel=0.1)
    # the count of updates within the clip, plus its own noise, moves the clip
    fits = float(np.sum(np.asarray(metrics["update_norm"]) <= 0.07))
    count_noise = count_std * float(jax.random.normal(
        jax.random.fold_in(jax.random.fold_in(key, privacy.COUNT_STREAM), 2), ()))
    want = 0.07 * math.exp(-0.3 * ((fits + count_noise) / 4 - 0.5))
    assert float(new[privacy.CLIP_KEY]) == pytest.approx(want, rel=1e-6)
    assert float(calm[privacy.CLIP_KEY]) == pytest.approx(0.07 * math.exp(-0.3 * (fits / 4 - 0.5)), rel=1e-6)


def test_batchnorm_statistics_are_refused_exactly_where_the_server_averages_them():
    data = make_data([12, 20, 7, 16])
    shared = {n for n, r in REGISTRY.items() if r.options.user_dp
              and privacy.bn_stats_shared(_alg(n), jax.random.key(0), data.x[0][:1])}
    # masked averaging keeps BN statistics on the server only where it shares them; APFL, FedPHP, Per-FedAvg
    # and FedLC average the whole model's variables; FedALA's server holds parameters only
    assert shared == {"fedavg", "fedprox", "fedper", "fedrep", "apfl", "fedphp", "perfedavg", "fedlc"}
    local = build_algorithm("fedper", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(), ALGORITHM_CTX,
                            local_bn=True)
    assert not privacy.bn_stats_shared(local, jax.random.key(0), data.x[0][:1])


@pytest.mark.parametrize("name", ["fedper", "apfl", "fedala"])  # masked averaging; model_variables; ALA
def test_the_server_moves_at_most_the_clip_and_clients_keep_their_own_training(name):
    data = make_data([12, 20, 7, 16])
    alg = _alg(name)
    start = init_state(alg, jax.random.key(0), data.x[0], 4)
    plain = run_step(alg, data, *start, jax.random.key(3), num_rounds=4)
    clip = 0.05
    dp = privacy.with_privacy(alg, clip, 0.0, jax.random.key(4))
    clipped = run_step(dp, data, *start, jax.random.key(3), num_rounds=4)
    mask = alg.share_mask(start[0], None) if alg.share_mask is not None else privacy.all_shared(start[0]["params"])
    moved = privacy.update_norm(start[0]["params"], clipped[0]["params"], mask)
    unclipped = privacy.update_norm(start[0]["params"], plain[0]["params"], mask)
    assert float(unclipped) > 2 * clip  # the bound below binds
    assert float(moved) <= clip * (1 + 1e-5)  # a mean of updates of norm <= C
    assert np.all(np.asarray(clipped[2]["update_norm"]) > clip)
    # personal state: the clients' own training (equal up to float32 rounding of the round: they are different
    # programs)
    tol, client_tol, _ = rounds_tolerance(alg, data, *start, jax.random.key(3), num_rounds=4)
    assert_trees_close(clipped[1], plain[1], atol=client_tol, rtol=0)
    # a trained row is the algorithm's own: evaluating it before aggregation (--eval-point local) works
    rows = trained_rows(dp, data, *start, jax.random.key(3), num_rounds=4)
    row = jax.tree_util.tree_map(lambda v: v[0], rows)
    assert dp.predict_trained(start[0], row, data.x[0][:3].astype(jnp.float32)).shape == (3, 4)
    # a clip no update reaches changes nothing (the wrapper's where keeps each model as trained)
    loose = run_step(privacy.with_privacy(alg, 1e6, 0.0, jax.random.key(4)), data, *start, jax.random.key(3),
                     num_rounds=4)
    assert_trees_close(loose[0], plain[0], atol=tol, rtol=0)


def test_noise_on_the_mean_has_std_z_clip_over_k():
    data = make_data([12, 20, 7, 16])
    alg = _alg("fedavg")
    start = init_state(alg, jax.random.key(0), data.x[0], 4)
    calm = privacy.with_privacy(alg, 0.05, 0.0, jax.random.key(4))
    quiet = run_step(calm, data, *start, jax.random.key(3))
    noisy = run_step(privacy.with_privacy(alg, 0.05, 2.0, jax.random.key(4)), data, *start, jax.random.key(3))
    diff = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(noisy[0]["params"]),
                                                            jax.tree_util.tree_leaves(quiet[0]["params"]))])
    assert diff.size > 500  # the std estimate is then within ~3 % (one sigma)
    assert float(np.std(diff)) == pytest.approx(2.0 * 0.05 / 4, rel=0.1)
    # BatchNorm statistics are not parameters: no noise there (a run refuses DP where they are averaged); another
    # program (the noise's): equal up to float32 rounding of the round
    tol = rounds_tolerance(calm, data, *start, jax.random.key(3))[0]["batch_stats"]
    assert_trees_close(noisy[0]["batch_stats"], quiet[0]["batch_stats"], atol=tol, rtol=0)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_dp_run_through_the_cli_logs_epsilon_and_resumes_exactly(tmp_path, capsys):
    # the noise calibrated to epsilon 20 over the 3 rounds (z = 0.76; resumed, it is found again)
    args = ["run", "--algorithm", "fedbn", *TINY, "--dp-clip", "0.5", "--dp-epsilon", "20", "--weighting", "uniform",
            "--clients-per-round", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    # with a server optimizer taking its step from the noised mean, three rounds in one call ...
    # and adaptive clipping, whose norm is server state (starting at 0.5, below every update's norm here) ...
    args += ["--server-opt", "adam", "--backend", "stacked", "--dp-quantile", "0.5", "--dp-count-noise", "1"]
    assert main([*args, "--rounds", "3", "--out", str(full), "--rounds-per-call", "3"]) == 0
    err = capsys.readouterr().err
    z = privacy.noise_for_epsilon(2 / 3, 3, 3 ** -1.1, 20.0)
    acc = privacy.Accountant(2 / 3, z, 3 ** -1.1)
    assert 19 < acc.epsilon(3) <= 20 and json.loads((full / "config.json").read_text())["dp_noise"] == z
    assert (f"DP-FedAvg: updates clipped to norm 0.5 (at first; then the 0.5 quantile of the update norms, lr 0.2), "
            f"noise {z:g}, 0.667 of the clients a round: ({acc.epsilon(3):.3g}, " in err)
    assert "(the noise calibrated to epsilon 20)" in err
    recs = _records(full)
    assert [r["dp_epsilon"] for r in recs] == pytest.approx([acc.epsilon(t) for t in (1, 2, 3)], rel=1e-12)
    assert all(len(r["train_update_norm"]) == 2 for r in recs)
    # the clip follows C' = C exp(-0.2 (unclipped fraction + count noise / 2 - 0.5)): it moves every round
    clips = [r["dp_clip"] for r in recs]
    assert clips[0] == pytest.approx(0.5) and len(set(clips)) == 3
    assert json.loads((full / "config.json").read_text())["dp_clip"] == 0.5
    spent = json.loads((full / "summary.json").read_text())["privacy"]
    assert spent["epsilon"] == pytest.approx(acc.epsilon(3), rel=1e-12)
    assert (spent["delta"], spent["noise_multiplier"], spent["rounds"]) == (3 ** -1.1, z, 3)
    assert (spent["clip_initial"], spent["count_noise_std"], spent["quantile"]) == (0.5, 1.0, 0.5)
    assert spent["update_noise_multiplier"] == pytest.approx(privacy.value_noise_multiplier(z, 1.0))
    assert spent["clip_final"] not in clips and spent["clip_final"] > 0
    # ... equal one call per round, stopped after round 2 (its round-3 checkpoint removed) and continued by the
    # line jaxfl prints on a stop: the saved target calibrates the same z again
    assert main([*args, "--rounds", "3", "--out", str(part), "--checkpoint-every", "1", "--quiet"]) == 0
    shutil.rmtree(part / "checkpoints" / "3")
    capsys.readouterr()
    # 4 rounds would calibrate another noise than rounds 1-2 had: refused, naming the z to continue with
    assert main(["run", "--out", str(part), "--resume", "--rounds", "4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxfl: error: --resume: --dp-epsilon 20 over 4 rounds calibrates "
                                               f"noise {privacy.noise_for_epsilon(2 / 3, 4, 3 ** -1.1, 20.0):g}, "
                                               f"but the run so far used {z!r}; continue with --dp-noise {z!r}")
    assert main(["run", "--out", str(part), "--resume", "--quiet"]) == 0
    assert [r["test_accuracy"] for r in _records(part)] == [r["test_accuracy"] for r in recs]
    assert json.loads((part / "config.json").read_text())["dp_noise"] == z


def test_bad_dp_options_get_one_line(tmp_path, capsys):
    cases = {("--dp-noise", "1"): "--dp-noise, --dp-delta, --dp-level and the adaptive clipping options need "
                                  "--dp-clip C",
             ("--dp-clip", "0", "--weighting", "uniform"): "dp_clip=0.0 is outside (0.0, inf]",
             ("--dp-clip", "1", "--dp-noise", "-1", "--weighting", "uniform"): "dp_noise=-1.0 is outside [0.0, inf]",
             ("--dp-clip", "1", "--dp-delta", "1", "--weighting", "uniform"): "dp_delta=1.0 is outside (0, 1)",
             ("--dp-clip", "1", "--dp-noise", "inf", "--weighting", "uniform"): "dp_noise=inf must be a finite number",
             ("--algorithm", "fednova", "--dp-clip", "1", "--weighting", "uniform"):
             "--dp-clip: fednova's aggregate is not an equal-weight mean of shared parameters alone; DP-FedAvg "
             "composes with: ",
             ("--algorithm", "fedavg", "--dp-clip", "1"): "--dp-clip: DP-FedAvg averages the cohort with equal weights",
             ("--dp-quantile", "0.5"): "--dp-noise, --dp-delta, --dp-level and the adaptive clipping options need "
                                       "--dp-clip C",
             ("--dp-epsilon", "5"): "--dp-epsilon needs --dp-clip C",
             ("--dp-clip", "1", "--dp-epsilon", "5", "--dp-noise", "1", "--weighting", "uniform"):
             "--dp-epsilon 5 sets the noise multiplier: give it or --dp-noise 1, not both",
             ("--dp-clip", "1", "--dp-epsilon", "0", "--weighting", "uniform"): "dp_epsilon=0.0 is outside (0.0, inf]",
             ("--algorithm", "fedbn", "--dp-clip", "1", "--dp-epsilon", "1", "--dp-delta", "1e-300", "--weighting",
              "uniform", *TINY): "epsilon 1 is at or below 2.683, the smallest epsilon the accountant certifies at "
                                 "delta 1e-300",
             ("--dp-clip", "1", "--dp-clip-lr", "0.1", "--weighting", "uniform"):
             "--dp-clip-lr and --dp-count-noise adapt the clipping norm: they need --dp-quantile Q",
             ("--dp-clip", "1", "--dp-quantile", "1", "--weighting", "uniform"): "dp_quantile=1.0 is outside (0, 1)",
             ("--algorithm", "fedbn", "--dp-clip", "1", "--dp-noise", "1", "--dp-quantile", "0.5", "--weighting",
              "uniform", *TINY): "--dp-noise 1 with adaptive clipping needs --dp-count-noise above 0.5 (it is 0.15; "
                                 "default 0.05 x the 3 clients a round)",
             ("--algorithm", "fedavg", "--dp-clip", "1", "--weighting", "uniform", *TINY):
             "--dp-clip: fedavg averages the BatchNorm statistics of small_cnn without noise"}
    assert_refused_in_one_line(cases, tmp_path, capsys)


def assert_refused_in_one_line(cases, tmp_path, capsys):
    """Each ``jaxfl run`` of cases' arguments exits 2 with one line starting with its message, writing nothing."""
    for args, message in cases.items():
        out = tmp_path / "run"
        assert main(["run", "--quiet", "--rounds", "1", "--out", str(out), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jaxfl: error: " + message), err
        assert not out.exists()
