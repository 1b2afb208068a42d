"""Sample-level DP (DP-SGD in local training, ``jaxfl.core.dpsgd``): the Poisson draw, the clipped sum and the
noise against their formulas (jit, vmap), the private gradient reduced to the plain one, padding and chunking
that change nothing, the accountant's composition, and the run option through the CLI's path."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import EPS32
from test_privacy import assert_refused_in_one_line

from jaxfl.core import privacy
from jaxfl.core.dpsgd import (SampleDP, clipped_sum, poisson_members, poisson_rate,
                              private_gradient)
from jaxfl.core.trainer import LocalTrainer
from jaxfl.data.clients import ClientData
from jaxfl.run.cli import main

TINY = ["--dataset", "default", "--image-size", "12", "--samples-per-client", "40", "--test-per-client", "30",
        "--batch-size", "16", "--eval-batch-size", "32", "--lr", "0.05"]


def linear_loss(p, s, x, y, w, k):
    """A weighted-mean softmax regression loss in the LocalTrainer contract."""
    logits = x @ p["w"] + p["b"]
    per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(per * w) / jnp.maximum(jnp.sum(w), 1.0), (s, logits)


def problem(m=40, d=5, classes=3):
    x = jax.random.normal(jax.random.key(0), (m, d))
    y = jnp.argmax(x @ jax.random.normal(jax.random.key(1), (d, classes)), axis=1)  # linearly separable
    p = {"w": 0.3 * jax.random.normal(jax.random.key(2), (d, classes)), "b": jnp.zeros(classes)}
    return x, y, p


def test_poisson_members_ignore_padding_and_join_at_the_rate():
    key = jax.random.key(0)
    draw = jax.jit(poisson_members, static_argnums=2)
    short, long = draw(key, 30, 40, 0.25), draw(key, 30, 64, 0.25)
    np.testing.assert_array_equal(short, long[:40])
    assert not long[30:].any()
    freq = jax.vmap(lambda k: poisson_members(k, 30, 40, 0.25))(jax.random.split(key, 2000)).mean(0)
    assert abs(float(freq[:30].mean()) - 0.25) < 0.01  # 60,000 draws: one std is 0.0018
    np.testing.assert_allclose(poisson_rate(jnp.array([1, 8, 9, 33]), 8), [1, 1, 1 / 2, 1 / 5])


def test_clipped_sum_follows_its_formula_under_jit_and_vmap():
    rng = np.random.default_rng(0)
    g = {"a": rng.normal(size=(5, 3)) * np.array([0.1, 1, 3, 0, 2])[:, None], "b": rng.normal(size=5)}
    g["b"][3] = 0.0  # lane 3's gradient is zero: its scale must be 1, not NaN
    w, clip = np.array([1.0, 1, 0, 1, 1]), 1.5
    norms = np.sqrt((g["a"] ** 2).sum(1) + g["b"] ** 2)
    scale = w * np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0))
    want = {"a": scale @ g["a"], "b": scale @ g["b"]}
    got, got_norms = jax.jit(clipped_sum, static_argnums=2)(jax.tree_util.tree_map(jnp.asarray, g), w, clip)
    np.testing.assert_allclose(got_norms, norms, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    twice = jax.vmap(lambda t: clipped_sum(t, w, clip)[0])(jax.tree_util.tree_map(lambda v: jnp.stack([v, 2 * v]), g))
    np.testing.assert_allclose(twice["a"][0], want["a"], rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(twice["b"][1]) != pytest.approx(np.linalg.norm(2 * want["b"]))  # clipping is not linear
    assert np.isfinite(jax.grad(lambda t: clipped_sum(t, w, clip)[0]["b"].sum())(g)["a"]).all()


def _gradient(p, x, y, members, n, dp, lanes, key=jax.random.key(3)):
    rate = poisson_rate(jnp.int32(n), 4)
    return jax.jit(lambda p: private_gradient(linear_loss, p, {}, lambda i: (x[i], y[i]), lambda v: v, members,
                                              jnp.int32(n), key, dp, lanes, rate))(p)


def test_the_private_gradient_is_the_clipped_member_sum_over_qn_in_any_chunking():
    x, y, p = problem()
    n = 23
    members = poisson_members(jax.random.key(5), n, 40, poisson_rate(n, 4))  # rate 1/6
    idx = np.nonzero(np.asarray(members))[0]
    assert len(idx) > 2  # (so lanes=2 runs several chunks)
    qn = n / 6
    # each member's own gradient g_j
    one = jax.vmap(jax.grad(lambda p, xj, yj: linear_loss(p, {}, xj[None], yj[None], jnp.ones(1), None)[0]),
                   (None, 0, 0))(p, x[idx], y[idx])

    def summed(scale):
        """sum_j scale_j g_j / qn, and the float32 rounding bound of another order of that sum (and of the terms'
        own rounding and scaling): 8 eps32 sum_j |scale_j g_j| / qn (1.6 eps32 seen on an AMD EPYC)."""
        terms = {k: np.asarray(scale, np.float64).reshape((-1,) + (1,) * (v.ndim - 1)) * np.asarray(v, np.float64)
                 / qn for k, v in one.items()}
        return ({k: t.sum(0) for k, t in terms.items()},
                {k: 8 * EPS32 * float(np.abs(t).sum(0).max()) for k, t in terms.items()})
    # no clipping, no noise: the gradient of the members' summed losses over the expected batch qn (in chunks of
    # lanes: another order of the sum than the batch's gradient)
    plain, sums = _gradient(p, x, y, members, n, SampleDP(1e9, 0.0), lanes=4)
    ref = jax.grad(lambda p: linear_loss(p, {}, x, y, members.astype(jnp.float32), None)[0] * len(idx) / qn)(p)
    _, tol = summed(np.ones(len(idx)))
    for k in ref:
        np.testing.assert_allclose(plain[k], ref[k], rtol=0, atol=tol[k])
    assert sums[2] == len(idx) and sums[3] == 1
    # clipped at C: each member's own gradient scaled by min(1, C / ||g_j||), whatever the lanes per chunk
    norms = np.sqrt(sum(np.sum(np.asarray(v).reshape(len(idx), -1) ** 2, 1) for v in one.values()))
    clip = 0.5 * float(np.median(norms))
    want, tol = summed(np.minimum(1.0, clip / norms))
    for lanes in (2, 16):
        got, _ = _gradient(p, x, y, members, n, SampleDP(clip, 0.0), lanes=lanes)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol[k])


def test_the_noise_has_std_z_clip_over_qn():
    x, y, _ = problem(d=400)
    p = {"w": jnp.zeros((400, 5)), "b": jnp.zeros(5)}
    zero_loss = lambda p, s, x, y, w, k: (0.0 * linear_loss(p, s, x, y, w, k)[0], (s, x @ p["w"]))
    n, z, clip = 23, 2.0, 0.3
    members = poisson_members(jax.random.key(5), n, 40, 1 / 6)
    g, _ = jax.jit(lambda p: private_gradient(zero_loss, p, {}, lambda i: (x[i], y[i]), lambda v: v, members,
                                              jnp.int32(n), jax.random.key(3), SampleDP(clip, z), 4, 1 / 6))(p)
    assert float(np.std(np.asarray(g["w"]))) == pytest.approx(z * clip / (n / 6), rel=0.05)  # 2,000 draws


def test_dp_local_training_ignores_padding_and_runs_the_clients_steps():
    x, y, p = problem(m=64)
    trainer = LocalTrainer(optax.sgd(0.1), 4, 2, lambda v: v, dp=SampleDP(1.0, 0.5))
    run = jax.jit(lambda data: trainer.run(linear_loss, p, {}, trainer.tx.init(p), data, jax.random.key(7)))
    short = run(ClientData(x[:40], y[:40], jnp.int32(23)))
    long = run(ClientData(x.at[23:].set(9.0), y, jnp.int32(23)))  # other padding, more of it
    for a, b in zip(jax.tree_util.tree_leaves(short[0]), jax.tree_util.tree_leaves(long[0])):
        np.testing.assert_array_equal(a, b)
    assert short[3]["steps"] == 2 * 6 and short[3]["seen"] == long[3]["seen"]
    # and it learns: the separable task's loss on the 23 real samples falls
    real = lambda q: float(linear_loss(q, {}, x[:23], y[:23], jnp.ones(23), None)[0])
    assert real(short[0]) < 0.8 * real(p)


def test_the_sample_accountant_composes_every_clients_steps():
    counts, b, e, z, delta = [5, 40, 100, 0], 10, 2, 1.1, 1e-5
    acc = privacy.SampleAccountant(counts, b, e, z, delta)
    assert acc.steps == [1, 4, 10]  # (an empty client spends nothing)
    per_client = [privacy.epsilon_from_rdp(7 * e * s * privacy.rdp_poisson_gaussian(1 / s, z), delta)[0]
                  for s in (1, 4, 10)]
    assert acc.epsilon(7) == pytest.approx(max(per_client), rel=1e-12)
    # a client of at most B samples takes its whole data each step: 7 x 2 plain Gaussians, RDP 14 α / (2 z²)
    orders = np.arange(2, 257)
    closed = np.min(14 * orders / (2 * z * z) + np.log((orders - 1) / orders) - (np.log(delta) + np.log(orders))
                    / (orders - 1))
    assert acc.worst_steps(7) == 1 and acc.epsilon(7) == pytest.approx(closed, rel=1e-9)
    assert acc.epsilon(3) < acc.epsilon(7) and privacy.SampleAccountant(counts, b, e, 0.0, delta).epsilon(1) == np.inf
    found = privacy.calibrate_noise(lambda z: privacy.SampleAccountant(counts, b, e, z, delta).epsilon(7), 5.0, "")
    assert privacy.SampleAccountant(counts, b, e, found, delta).epsilon(7) <= 5.0
    assert privacy.SampleAccountant(counts, b, e, found * 0.99, delta).epsilon(7) > 5.0


def test_thm9_subsampling_of_any_curve_follows_its_formula():
    rng = np.random.default_rng(0)
    curve = np.cumsum(rng.uniform(0.001, 0.05, len(privacy.ORDERS)))  # increasing, as an RDP curve is
    q = 0.07
    got = privacy.rdp_wor_subsampled(q, curve)
    eps = lambda j: curve[j - 2]
    for a in (2, 3, 9, 40):
        total = 1 + q * q * math.comb(a, 2) * min(4 * math.expm1(eps(2)), 2 * math.exp(eps(2)))
        total += sum(q ** j * math.comb(a, j) * 2 * math.exp((j - 1) * eps(j)) for j in range(3, a + 1))
        assert got[a - 2] == pytest.approx(min(math.log(total) / (a - 1), eps(a)), rel=1e-9)
    assert np.all(got <= curve) and np.array_equal(privacy.rdp_wor_subsampled(1.0, curve), curve)
    # on the Gaussian's curve it is the bound the forward differences refine: never below it
    gauss = np.array([a / (2 * 1.3 ** 2) for a in privacy.ORDERS])
    assert np.all(privacy.rdp_wor_subsampled(0.1, gauss) >= privacy.rdp_wor_gaussian(0.1, 1.3) * (1 - 1e-12))


def test_the_cohort_draw_amplifies_only_stateless_clients():
    counts, z, delta = [190, 600, 1200], 1.0, 5.5e-6
    wide = privacy.SampleAccountant(counts, 32, 1, z, delta)
    drawn = privacy.SampleAccountant(counts, 32, 1, z, delta, cohort_fraction=0.1)
    per_client = [privacy.epsilon_from_rdp(50 * privacy.rdp_wor_subsampled(
        0.1, s * privacy.rdp_poisson_gaussian(1 / s, z)), delta)[0] for s in (6, 19, 38)]
    assert drawn.epsilon(50) == pytest.approx(max(per_client), rel=1e-12)
    assert drawn.epsilon(50) < 0.3 * wide.epsilon(50)
    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.core.types import RunContext
    from jaxfl.models import build_model
    trainer = LocalTrainer(optax.sgd(0.1), 4, 1)
    keeps = {name: privacy.clients_keep_state(build_algorithm(name, build_model("logreg", 3), trainer,
                                                              RunContext(num_clients=4, num_rounds=2)),
                                              jax.random.key(0), jnp.zeros((1, 8, 8, 1), jnp.uint8))
             for name in ("fedavg", "fedprox", "fedper", "local")}
    assert keeps == {"fedavg": False, "fedprox": False, "fedper": True, "local": True}


def test_a_sample_dp_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedprox", "--model", "logreg", *TINY, "--dp-level", "sample", "--dp-clip", "1",
            "--dp-epsilon", "8", "--rounds", "2", "--clients-per-round", "2", "--out", str(out)]
    assert main(args) == 0
    err = capsys.readouterr().err
    spent = json.loads((out / "summary.json").read_text())["privacy"]
    z = json.loads((out / "config.json").read_text())["dp_noise"]
    # every client has 40 samples (3 steps); fedprox's clients keep nothing: 2 of 3 a round amplify
    acc = privacy.SampleAccountant([40], 16, 1, z, spent["delta"], cohort_fraction=2 / 3)
    assert spent["cohort_fraction"] == pytest.approx(2 / 3)
    assert spent["epsilon"] == pytest.approx(acc.epsilon(2), rel=1e-12) and 7.9 < spent["epsilon"] <= 8
    assert (spent["level"], spent["per_sample_clip"], spent["worst_client_steps_per_epoch"]) == ("sample", 1.0, 3)
    assert f"DP-SGD: each sample's gradient clipped to norm 1, noise {z:g}: ({acc.epsilon(2):.3g}, " in err
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp_epsilon"] for r in recs] == pytest.approx([acc.epsilon(1), acc.epsilon(2)], rel=1e-12)
    assert all(s == 3 for r in recs for s in r["train_steps"]) and all(len(r["train_steps"]) == 2 for r in recs)


def test_the_algorithm_is_built_once_on_the_dp_trainer(tmp_path, monkeypatch):
    # the noise, given (--dp-noise) or calibrated to --dp-epsilon from the method's declared client state, is set
    # before the build: the algorithm is built once, on the DP-SGD trainer
    from jaxfl.run import runner
    from jaxfl.run.config import RunConfig
    builds = []
    real = runner.build_algorithm
    monkeypatch.setattr(runner, "build_algorithm",
                        lambda options, model, trainer, ctx: builds.append(trainer.dp) or real(options, model, trainer,
                                                                                                 ctx))
    base = dict(model="logreg", dataset="default", image_size=12, samples_per_client=40, test_per_client=30,
                batch_size=16, rounds=1, dp_level="sample", dp_clip=1.0, clients_per_round=2)
    exp = runner.Experiment(RunConfig(**base, algorithm="fedavg", dp_noise=1.5, out=str(tmp_path / "a")))
    assert [b.noise_multiplier for b in builds] == [1.5] and exp.trainer.dp.noise_multiplier == 1.5
    noises = {}
    for name in ("fedavg", "fedper"):  # clients without and with state: the draw amplifies only the first
        builds.clear()
        exp = runner.Experiment(RunConfig(**base, algorithm=name, dp_epsilon=8.0, out=str(tmp_path / name)))
        assert builds == [exp.trainer.dp] and exp.privacy.cohort_fraction == (1.0 if name == "fedper" else 2 / 3)
        noises[name] = exp.trainer.dp.noise_multiplier
    assert noises["fedavg"] < noises["fedper"]


def test_every_method_declares_whether_its_clients_keep_state():
    """``Options.keeps_client_state`` (which sets DP-SGD's noise before the build) equals what ``init`` says, on a
    model without BatchNorm, for every algorithm at its defaults and with each choice of each of its bool and
    choice options, and with every pair of them where a method's declaration reads its options."""
    import dataclasses
    import itertools

    from jaxfl.algorithms import build_algorithm
    from jaxfl.algorithms._registry import REGISTRY
    from jaxfl.core.options import Options
    from jaxfl.core.trainer import ClientOptimizer
    from jaxfl.core.types import RunContext
    from jaxfl.models import build_model
    trainer = LocalTrainer(ClientOptimizer(lr=0.1), 4, 1)
    ctx = RunContext(num_clients=4, num_rounds=2)
    checked = 0
    for name, reg in sorted(REGISTRY.items()):
        model = reg.options.models[0] if reg.options.models else "fedavg_cnn"
        shape = (1, 32, 32, 3) if model.startswith(("vit", "resnet", "digits")) else (1, 28, 28, 1)
        sample_x = jnp.zeros(shape, jnp.uint8)
        switches = [[(f.name, c) for c in (f.metadata["choices"] or ())] if f.metadata.get("choices") else
                    [(f.name, not f.default)] for f in dataclasses.fields(reg.options)
                    if f.metadata.get("choices") or isinstance(f.default, bool)]
        settings = [{}] + [dict([s]) for group in switches for s in group]
        if reg.options.keeps_client_state is not Options.keeps_client_state:  # read from the options
            settings += [dict([a, b]) for g, h in itertools.combinations(switches, 2) for a in g for b in h]
        for values in settings:
            opts = reg.options(**values)
            alg = build_algorithm(opts, build_model(model, 10), trainer, ctx)
            keeps = privacy.clients_keep_state(alg, jax.random.key(0), sample_x)
            assert opts.keeps_client_state() == keeps, (name, values, keeps)
            checked += 1
    assert checked > len(REGISTRY)


def test_a_wrong_client_state_declaration_stops_a_sample_dp_run(tmp_path, monkeypatch):
    # the accounting would be wrong (amplified where clients keep state): the built algorithm is checked against it
    from jaxfl.algorithms.fedavg import FedAvgOptions
    from jaxfl.run import runner
    from jaxfl.run.config import RunConfig
    monkeypatch.setattr(FedAvgOptions, "client_state", True)
    cfg = RunConfig(algorithm="fedavg", model="logreg", dataset="default", image_size=12, samples_per_client=40,
                    test_per_client=30, batch_size=16, rounds=1, dp_level="sample", dp_clip=1.0, dp_noise=1.0,
                    out=str(tmp_path / "run"))
    with pytest.raises(AssertionError, match="fedavg's options say its clients keep state"):
        runner.Experiment(cfg)


def test_bad_sample_dp_options_get_one_line(tmp_path, capsys):
    sample = ("--dp-level", "sample", "--dp-clip", "1")
    cases = {("--dp-level", "sample"): "--dp-noise, --dp-delta, --dp-level and the adaptive clipping options need "
                                       "--dp-clip C",
             ("--dp-level", "item", "--dp-clip", "1"): "unknown dp_level 'item'; valid: user, sample",
             ("--algorithm", "scaffold", *sample): "--dp-level sample: scaffold's local work is not one minibatch "
                                                   "loop of the client optimizer on its loss alone; DP-SGD composes "
                                                   "with: fedavg, ",
             (*sample, "--dp-quantile", "0.5"): "--dp-quantile, --dp-clip-lr and --dp-count-noise adapt DP-FedAvg's",
             ("--algorithm", "fedavg", "--model", "small_cnn", *TINY, *sample):
             "--dp-level sample: small_cnn has BatchNorm"}
    assert_refused_in_one_line(cases, tmp_path, capsys)
