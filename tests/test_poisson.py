"""Poisson sampling of the cohort (``--cohort-sampling poisson``): the draw against its formula, a padded
round against the step on the drawn members alone (both backends, a Stacked cohort that outgrows its rows),
an empty cohort, DP-FedAvg's fixed-denominator estimate and centred count against a hand computation, the
add/remove accountant, and the CLI's path (epsilon, exact resume, bad input in one line)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BACKENDS, assert_trees_close, make_backend, make_data, make_trainer, rounding_tolerance

from jaxfl.algorithms import build_algorithm
from jaxfl.core import privacy
from jaxfl.core.backends import ClientStore
from jaxfl.core.cohort import client_keys, poisson_cohort, poisson_members, poisson_rows
from jaxfl.core.step import cohort_train, init_state, make_step
from jaxfl.core.types import RoundInfo, RunContext
from jaxfl.models import logreg, small_cnn
from jaxfl.run.cli import main
from test_privacy import POISSON_REFERENCE, TINY, _records, assert_refused_in_one_line

ROOT = jax.random.key(3)


def test_each_client_joins_on_its_own_stream_with_probability_q():
    for r in (0, 7):
        want = [float(jax.random.uniform(k)) < 0.3
                for k in client_keys(jax.random.fold_in(ROOT, 5), r, jnp.arange(40))]
        assert np.asarray(poisson_members(ROOT, r, 40, 0.3)).tolist() == want
        # client i's draw does not depend on the population after it
        assert np.array_equal(poisson_members(ROOT, r, 25, 0.3), poisson_members(ROOT, r, 40, 0.3)[:25])
    total = sum(int(np.sum(poisson_members(ROOT, r, 500, 0.1))) for r in range(200))
    assert abs(total - 10_000) < 5 * math.sqrt(100_000 * 0.1 * 0.9)  # Binomial(100,000, 0.1)
    members = np.flatnonzero(poisson_members(ROOT, 2, 40, 0.3))
    rows = np.asarray(jax.jit(poisson_cohort, static_argnums=(2, 3, 4))(ROOT, 2, 40, 0.3, 24))
    assert rows.tolist() == members.tolist() + [40] * (24 - len(members))  # members sorted, then padding
    assert [poisson_rows(k, 8) for k in (0, 1, 8, 9, 17)] == [8, 8, 8, 16, 24]


COUNTS = [12, 20, 7, 16, 9, 14, 5, 11, 18, 8]


def _fedbn():
    ctx = RunContext(num_clients=len(COUNTS), num_rounds=4)
    return build_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(), ctx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_poisson_round_is_the_step_on_its_members_alone(backend):
    alg, data = _fedbn(), make_data(COUNTS)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    engine = make_backend(alg, data, backend, clients="vmap", cohort_size=6, sampling="poisson", num_rounds=4,
                          weighting="uniform")  # (padding rows would count as much as members)
    if backend == "stacked":
        engine.rows = 8
        engine._build()  # fewer rows than this round's cohort: the host check recompiles with more
    round_idx = next(r for r in range(100) if len(engine.draw(r, ROOT)) == 9)  # 9 members, 16 rows: padding
    ids = engine.draw(round_idx, ROOT)
    store = ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device")
    new, metrics = engine.round(server, store, round_idx, ROOT)
    assert metrics["client_id"].tolist() == ids.tolist() and len(metrics["loss"]) == len(ids)
    # the reference: the unpadded step on the members' data, under their ids (their streams)
    sub = jax.tree_util.tree_map(lambda a: a[ids], data)
    step = make_step(alg, clients="vmap", num_rounds=4, weighting="uniform")
    reference = jax.jit(lambda *a: step(*a))
    args = (server, jax.tree_util.tree_map(lambda a: a[ids], clients), sub, jnp.asarray(ids), round_idx, ROOT)
    want, kept, want_metrics = reference(*args)
    # another program (padding rows, another lane layout): equal up to float32 rounding of this computation
    tol, kept_tol, metric_tol = rounding_tolerance(reference, *args)
    assert_trees_close(new, want, atol=tol, rtol=0)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], atol=metric_tol["loss"], rtol=0)
    others = np.setdiff1d(np.arange(len(COUNTS)), ids)
    assert_trees_close(jax.tree_util.tree_map(lambda a: a[ids], store.state), kept, atol=kept_tol, rtol=0)
    for a, b in zip(jax.tree_util.tree_leaves(store.state), jax.tree_util.tree_leaves(clients)):
        assert np.array_equal(np.asarray(a)[others], np.asarray(b)[others])  # the others' states are untouched
    steps = -(-np.asarray(COUNTS)[ids] // 8)
    one_vmap = 16 * steps.max() * 8 / np.sum(np.asarray(COUNTS)[ids])
    if backend == "stacked":  # 16 rows (7 of them padding, 0 steps) in the lane plan's sorted chunks
        assert engine.rows == 16 and engine.lanes.rows == 16
        done = engine.lanes.work(np.concatenate([steps, np.zeros(16 - len(steps), steps.dtype)]))
        assert metrics["padded_work"] == pytest.approx(done * 8 / np.sum(np.asarray(COUNTS)[ids]))
    assert metrics["padded_work"] < one_vmap  # (ragged: buckets of members only)


def _logreg_fedavg(n):
    return build_algorithm("fedavg", logreg(4), make_trainer(), RunContext(num_clients=n, num_rounds=4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_poisson_cohort_keeps_the_model_and_under_dp_adds_the_noise(backend):
    # (with adaptive clipping: its round metric and clip update on a round without clients)
    n, z, clip, key = 10, 2.0, 0.5, jax.random.key(4)
    data = make_data([5, 8, 3, 6, 7, 4, 9, 5, 6, 2])
    plain = _logreg_fedavg(n)
    dp = privacy.with_privacy(plain, clip, z, key, quantile=0.5, clip_lr=0.2, count_std=1.5,
                              expected_clients=2.0)  # qN = 2: not the k = 0 of the round
    server, clients = init_state(plain, jax.random.key(0), data.x[0], n)
    kw = dict(clients="map", cohort_size=2, sampling="poisson", weighting="uniform")
    engine = make_backend(plain, data, backend, **kw)
    empty = next(r for r in range(100) if len(engine.draw(r, ROOT)) == 0)
    new, metrics = engine.round(server, ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device"), empty,
                                ROOT)
    assert metrics["client_id"].size == 0 and metrics["loss"].size == 0
    assert_trees_close(new, server, atol=0, rtol=0)  # no mean over no client: the model as it was
    dp_server = {**server, privacy.CLIP_KEY: jnp.float32(clip)}
    new, metrics = make_backend(dp, data, backend, **kw).round(dp_server, ClientStore(clients, "device"), empty, ROOT)
    shared = privacy.all_shared(server["params"])
    sigma = privacy.value_noise_multiplier(z, 1.5)
    noised = jax.jit(lambda p, std: privacy.add_noise(jax.random.fold_in(key, empty), p, shared, std))
    args = (server["params"], jnp.float32(sigma * clip / 2.0))
    # another program: equal up to float32 rounding of the model plus its noise
    assert_trees_close(new["params"], noised(*args), atol=rounding_tolerance(noised, *args), rtol=0)
    # adaptive clipping: the round's clip is logged without a client, and moves by the noised centred count alone
    assert float(metrics["dp_clip"]) == clip
    count = 1.5 * float(jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, privacy.COUNT_STREAM), empty), ()))
    assert float(new[privacy.CLIP_KEY]) == pytest.approx(clip * math.exp(-0.2 * (count / 2.0 + 0.5 - 0.5)), rel=1e-6)
    assert not np.allclose(jax.tree_util.tree_leaves(new["params"])[0], jax.tree_util.tree_leaves(server["params"])[0])


def test_dp_over_poisson_divides_the_clipped_sum_by_the_expected_cohort_and_centres_the_count():
    data = make_data([12, 20, 7, 16])
    base = _logreg_fedavg(4)
    clip, z, expected, key, lr, target = 0.05, 1.5, 2.5, jax.random.key(4), 0.3, 0.5
    server, clients = init_state(base, jax.random.key(0), data.x[0], 4)
    rows, _ = cohort_train(base, clients="vmap", num_rounds=4)(server, clients, data, jnp.arange(4), 2, ROOT)
    weights = jnp.asarray([1.0, 0.0, 1.0, 1.0])  # row 1: padding
    info = RoundInfo(jnp.int32(2), jnp.arange(4, dtype=jnp.int32), 4)
    dp = privacy.with_privacy(base, clip, z, key, quantile=target, clip_lr=lr, count_std=1.0,
                              expected_clients=expected)
    dp_server = {**server, privacy.CLIP_KEY: jnp.float32(clip)}
    new = jax.jit(lambda s, t: dp.aggregate(s, t, weights, info)[0])(dp_server, rows)
    # by hand: x + sum over the members of min(1, C / |d_i|) d_i / (qN), plus noise of std z' C / (qN)
    x = server["params"]
    norms = [float(privacy.update_norm(x, jax.tree_util.tree_map(lambda a: a[i], rows["params"])))
             for i in range(4)]
    members = [0, 2, 3]
    sigma = privacy.value_noise_multiplier(z, 1.0)  # raised: the count shares the budget

    @jax.jit
    def by_hand(x, trained):
        total = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p), x)
        for i in members:
            c = jnp.minimum(1.0, clip / privacy.update_norm(x, jax.tree_util.tree_map(lambda a: a[i], trained)))
            total = jax.tree_util.tree_map(lambda t, p, r: t + c * (r[i] - p), total, x, trained)
        mean = jax.tree_util.tree_map(lambda p, t: p + t / expected, x, total)
        return privacy.add_noise(jax.random.fold_in(key, 2), mean, privacy.all_shared(x), sigma * clip / expected)
    # another program: equal up to float32 rounding of the hand-made aggregation
    assert_trees_close(new["params"], by_hand(x, rows["params"]), atol=rounding_tolerance(by_hand, x, rows["params"]),
                       rtol=0)
    fits = sum(norms[i] <= clip for i in members)
    count_noise = float(jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, privacy.COUNT_STREAM), 2), ()))
    centred = (fits - len(members) / 2 + count_noise) / expected + 0.5
    assert float(new[privacy.CLIP_KEY]) == pytest.approx(clip * math.exp(-lr * (centred - target)), rel=1e-6)
    assert centred != pytest.approx(fits / len(members))  # not the fixed cohort's fraction


@pytest.mark.parametrize("args,want", POISSON_REFERENCE)
def test_the_poisson_accountant_is_the_add_remove_one(args, want):
    q, z, rounds, delta = args
    assert privacy.Accountant(q, z, delta, "poisson").epsilon(rounds) == pytest.approx(want[0], rel=1e-6)


def test_noise_calibrated_for_poisson_sampling_is_smaller_and_minimal():
    z = privacy.noise_for_epsilon(0.1, 200, 1e-5, 8.0, "poisson")
    assert privacy.Accountant(0.1, z, 1e-5, "poisson").epsilon(200) <= 8.0
    assert privacy.Accountant(0.1, z * 0.995, 1e-5, "poisson").epsilon(200) > 8.0
    assert z < privacy.noise_for_epsilon(0.1, 200, 1e-5, 8.0)  # the replace-one bound on a fixed cohort needs more
    report = privacy.Accountant(0.1, z, 1e-5, "poisson").report(200)
    assert report["accountant"].startswith("RDP, Poisson sampling") and "epsilon_poisson_convention" not in report


def test_dp_over_poisson_through_the_cli_logs_its_epsilon_and_resumes_exactly(tmp_path, capsys):
    # three rounds in one call equal one call per round, stopped after round 2 and resumed; each of the 3
    # clients joins with probability q = --participation 0.5 (not 2 / 3, the fixed cohort's ceil(0.5 x 3) of 3)
    args = ["run", "--algorithm", "fedavg", *TINY, "--model", "logreg", "--dp-clip", "0.5", "--dp-noise", "1",
            "--weighting", "uniform", "--participation", "0.5", "--cohort-sampling", "poisson", "--backend",
            "stacked"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*args, "--rounds", "3", "--out", str(full), "--rounds-per-call", "3"]) == 0  # one call
    acc = privacy.Accountant(0.5, 1.0, 3 ** -1.1, "poisson")
    assert f"({acc.epsilon(3):.3g}, " in capsys.readouterr().err
    recs = _records(full)
    assert [r["dp_epsilon"] for r in recs] == pytest.approx([acc.epsilon(t) for t in (1, 2, 3)], rel=1e-12)
    summary = json.loads((full / "summary.json").read_text())
    spent, names = summary["privacy"], summary["clients"]
    assert spent["accountant"].startswith("RDP, Poisson") and spent["sampling_rate"] == 0.5
    assert [r["clients_trained"] for r in recs] == [  # the draw at the run's seed 0
        [names[i] for i in np.flatnonzero(poisson_members(jax.random.key(0), r, 3, 0.5))] for r in range(3)]
    assert main([*args, "--rounds", "2", "--out", str(part), "--checkpoint-every", "1", "--quiet"]) == 0
    assert main([*args, "--rounds", "3", "--out", str(part), "--resume", "--quiet"]) == 0
    assert [r["test_accuracy"] for r in _records(part)] == [r["test_accuracy"] for r in recs]
    assert [r["clients_trained"] for r in _records(part)] == [r["clients_trained"] for r in recs]


def test_bad_sampling_options_get_one_line(tmp_path, capsys, monkeypatch):
    from jaxfl.algorithms import options_class
    monkeypatch.setattr(options_class("fedpac"), "poisson_sampling", False)  # (every algorithm takes it today)
    cases = {("--cohort-sampling", "uniform"): "unknown cohort_sampling 'uniform'; valid: fixed, poisson",
             ("--algorithm", "fedpac", "--cohort-sampling", "poisson"):
             "--cohort-sampling poisson pads each round's cohort with rows of weight 0, which fedpac's aggregate "
             "does not treat as absent (algorithms without Poisson sampling: fedpac); use --cohort-sampling fixed"}
    assert_refused_in_one_line(cases, tmp_path, capsys)


def test_round_metrics_must_be_scalars_named_apart_from_the_clients_metrics():
    from jaxfl.core.step import with_round_metrics
    base = _logreg_fedavg(4)
    arrays = base._replace(round_metrics=lambda before, after: {"spread": jnp.zeros(3), "ok": jnp.float32(1)})
    with pytest.raises(ValueError, match="fedavg's round_metrics must be scalars: spread are not"):
        make_step(arrays).round_metrics({}, {})
    assert make_step(base).round_metrics({}, {}) == {}
    assert with_round_metrics({"loss": 1}, {"dp_clip": 2}) == {"loss": 1, "dp_clip": 2}
    with pytest.raises(ValueError, match="round metrics loss have the names of per-client metrics"):
        with_round_metrics({"loss": 1}, {"loss": 2})
