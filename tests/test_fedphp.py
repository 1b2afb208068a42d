"""FedPHP (inherited private models): the distillation and MMD terms against their formulas (the MMD against a
transcription of the official estimator), the inheritance schedule, the HPM update by hand, lambda = 0 as
FedAvg, and the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import (assert_cli_runs, assert_trees_close, info, make_data, make_trainer, rounding_tolerance,
                      rounds_tolerance, run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.fedphp import inheritance_weight
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.ops.losses import multi_kernel_mmd, soft_target_ce

COUNTS = (12, 20, 7)
ROOT = jax.random.key(3)
T = 10


def setup(name, cohort=None, **options):
    data = make_data(list(COUNTS))
    ctx = RunContext(num_clients=3, num_rounds=T, cohort_size=cohort)
    alg = build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(), ctx, **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    return alg, data, server, clients


def official_mmd(a, b):
    """FedRepo's tools.mmd_rbf_noaccelerate (kernel_mul 2, kernel_num 5), transcribed in numpy."""
    n = a.shape[0]
    u = np.concatenate([a, b], 0).astype(np.float64)
    d = ((u[None] - u[:, None]) ** 2).sum(-1)
    bandwidth = d.sum() / ((2 * n) ** 2 - 2 * n) / 2 ** (5 // 2)
    k = sum(np.exp(-d / (bandwidth * 2 ** i)) for i in range(5))
    return np.mean(k[:n, :n] + k[n:, n:] - k[:n, n:] - k[n:, :n])


def test_distillation_and_mmd_match_their_formulas():
    rng = np.random.default_rng(0)
    z, p = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)
    t = np.exp(p / 4) / np.exp(p / 4).sum(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(jax.jit(soft_target_ce, static_argnums=2)(z, p, 4.0), -(t * logq).sum(-1), rtol=1e-5)
    a, b = rng.normal(size=(5, 3)).astype(np.float32), (rng.normal(size=(5, 3)) + 0.5).astype(np.float32)
    full = float(jax.jit(multi_kernel_mmd)(a, b, jnp.ones(5)))
    np.testing.assert_allclose(full, official_mmd(a, b), rtol=1e-4)
    assert full > 1e-3 and abs(float(multi_kernel_mmd(a, a, jnp.ones(5)))) < 1e-6
    # padding rows change nothing: the estimator on 5 real rows of 8
    pad = lambda m: np.concatenate([m, rng.normal(size=(3, 3)).astype(np.float32) * 9], 0)  # noqa: E731
    w = jnp.asarray(np.arange(8) < 5, jnp.float32)
    np.testing.assert_allclose(float(multi_kernel_mmd(pad(a), pad(b), w)), full, rtol=1e-5)
    # its gradient reaches the student's features and not the bandwidth's
    g = jax.grad(lambda x: multi_kernel_mmd(x, jnp.asarray(b), jnp.ones(5)))(jnp.asarray(a))
    assert float(jnp.abs(g).max()) > 0


def test_inheritance_weight_grows_with_participations():
    mu = inheritance_weight(jnp.arange(6), 4, 0.9)
    np.testing.assert_allclose(mu, [0, 0.225, 0.45, 0.675, 0.9, 0.9], rtol=1e-6)


def test_hpm_update_and_fedavg_reduction():
    alg, data, server, clients = setup("fedphp", cohort=3)
    s1, c1, _, rows = run_rounds(alg, data, server, clients, ROOT, rounds=1, keep_rows=True, num_rounds=T)
    # first participation: mu = 0, the HPM becomes the trained model
    assert_trees_close(rows["hpm"], {"params": rows["params"], "batch_stats": rows["batch_stats"]}, atol=0, rtol=0)
    np.testing.assert_array_equal(c1["participations"], 1)
    # second: mu = 0.9 * 1 / (q T) = 0.09 with every client in the cohort (q = 1)
    rows2 = run_rounds(alg, data, s1, c1, ROOT, rounds=1, keep_rows=True, num_rounds=T)[3]
    blend = jax.jit(lambda hpm, trained: jax.tree_util.tree_map(lambda v, w: 0.09 * v + 0.91 * w, hpm, trained))
    args = (c1["hpm"], {"params": rows2["params"], "batch_stats": rows2["batch_stats"]})
    # another program: equal up to float32 rounding of the blend
    assert_trees_close(rows2["hpm"], blend(*args), atol=rounding_tolerance(blend, *args), rtol=0)
    # lambda = 0: the global model is FedAvg's; predictions come from the HPM
    zero = run_rounds(*setup("fedphp", lam=0.0), ROOT, rounds=2, num_rounds=T)[0]
    fedavg = run_rounds(*setup("fedavg"), ROOT, rounds=2, num_rounds=T)[0]
    # two programs (FedPHP's loss with a zero distillation term, FedAvg's): equal up to float32 rounding of the
    # two rounds, which a dropped client or a wrong weight exceeds by far
    tol = rounds_tolerance(*setup("fedavg"), ROOT, rounds=2, num_rounds=T)[0]
    assert_trees_close(zero, fedavg, atol=tol, rtol=0)
    kd = run_rounds(*setup("fedphp"), ROOT, rounds=2, num_rounds=T)[0]
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(kd),
                                                           jax.tree_util.tree_leaves(fedavg))) > 1e-5
    c0 = jax.tree_util.tree_map(lambda a: a[0], c1)
    x = data.x[0, :4] / 255.0 * 2 - 1
    hpm_predict = jax.jit(small_cnn(num_classes=4, width=4, hidden=(8,)).apply)
    # another program: equal up to float32 rounding of the HPM's prediction
    np.testing.assert_allclose(alg.predict(s1, c0, x), hpm_predict(c0["hpm"], x),
                               atol=rounding_tolerance(hpm_predict, c0["hpm"], x), rtol=0)
    # a cohort of one client in three: M = max(floor(T / 3), 1) = 3
    alg3 = setup("fedphp", cohort=1)[0]
    c = jax.tree_util.tree_map(lambda a: a[0], c1)
    _, metrics = jax.jit(alg3.local_update)(s1, c, data.take(0), ROOT, info(1, 0, T))
    np.testing.assert_allclose(float(metrics["mu"]), 0.3, rtol=1e-6)


def test_the_cli_runs_fedphp_with_mmd(tmp_path):
    assert_cli_runs("fedphp", tmp_path, "--fedphp.reg", "mmd")
