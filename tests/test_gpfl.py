"""GPFL (global category embeddings + conditional valve): the valve, the angle-level term and the conditional
inputs by definition, the loss by hand, the server's averages and what a client keeps, and the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_cli_runs, assert_trees_close, make_data, make_trainer, run_rounds

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import head_on
from jaxfl.algorithms.gpfl import conditional_inputs, conditional_valve, gpfl_loss, valve_init
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.ops.losses import cosine_ce

COUNTS = (12, 20, 7)
ROOT = jax.random.key(3)


def model():
    return small_cnn(num_classes=4, width=4)


def ln(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def test_valve_angle_term_and_conditional_inputs_follow_their_definitions():
    rng = np.random.default_rng(0)
    cov = valve_init(jax.random.key(1), 5)
    z, c = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=5).astype(np.float32)
    g = ln(np.maximum(c @ np.asarray(cov["gamma"]["dense"]["kernel"]) + np.asarray(cov["gamma"]["dense"]["bias"]), 0))
    b = ln(np.maximum(c @ np.asarray(cov["beta"]["dense"]["kernel"]) + np.asarray(cov["beta"]["dense"]["bias"]), 0))
    np.testing.assert_allclose(jax.jit(conditional_valve)(cov, z, c), np.maximum(z * (g + 1) + b, 0), rtol=1e-5,
                               atol=1e-6)
    e, y = rng.normal(size=(4, 5)).astype(np.float32), np.array([0, 3, 1])
    cos = (z / np.linalg.norm(z, axis=1, keepdims=True)) @ (e / np.linalg.norm(e, axis=1, keepdims=True)).T
    want = -(cos[np.arange(3), y] - np.log(np.exp(cos).sum(-1)))
    np.testing.assert_allclose(jax.jit(cosine_ce)(z, e, y), want, rtol=1e-5)
    c_p, c_g = conditional_inputs(e, jnp.array([2.0, 0.0, 1.0, 1.0]))
    np.testing.assert_allclose(c_p, (np.array([0.5, 0, 0.25, 0.25])[:, None] * e).sum(0), rtol=1e-6)
    np.testing.assert_allclose(c_g, e.mean(0), rtol=1e-6)


def test_loss_by_hand_and_a_round():
    data = make_data(list(COUNTS))
    alg = build_algorithm("gpfl", model(), make_trainer(), RunContext(num_clients=3), lam=0.5, mu=0.2)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    m, c = model(), jax.tree_util.tree_map(lambda a: a[0], clients)
    x, y = data.x[0, :8] / 255.0 * 2 - 1, data.y[0, :8]
    w = (jnp.arange(8) < 6).astype(jnp.float32)
    rng = np.random.default_rng(1)
    c_p, c_g = (jnp.asarray(rng.normal(size=c["c_p"].shape), jnp.float32) for _ in range(2))
    gce = server["gce"] * 1.2  # the table being trained differs from the frozen one
    params = {"encoder": server["encoder"], "head": c["head"], "gce": gce, "cov": server["cov"]}
    loss, _ = gpfl_loss(m, 0.5, 0.2)(params, c["batch_stats"], x, y, w, None, c_p, c_g, server["gce"])
    z = m.apply({"params": {"encoder": server["encoder"]}, "batch_stats": c["batch_stats"]}, x, True, w,
                method="features", mutable=["batch_stats"])[0]
    f_p, f_g = conditional_valve(server["cov"], z, c_p), conditional_valve(server["cov"], z, c_g)
    logits = m.apply({"params": {"head": c["head"]}, "batch_stats": c["batch_stats"]}, f_p, True, w, method=head_on,
                     mutable=["batch_stats"])[0]
    real = np.asarray(w) > 0
    lg = np.asarray(logits, np.float64)[real]
    ce = -np.mean(lg[np.arange(6), np.asarray(y)[real]] - np.log(np.exp(lg).sum(-1)))
    angle = float(np.mean(np.asarray(cosine_ce(f_g, gce, y))[real]))
    magnitude = np.linalg.norm((np.asarray(f_g) - np.asarray(server["gce"])[np.asarray(y)])[real])
    decay = sum(float(jnp.sum(a * a)) for a in jax.tree_util.tree_leaves((gce, server["cov"])))
    np.testing.assert_allclose(float(loss), ce + angle + 0.5 * magnitude + 0.1 * decay, rtol=1e-4)
    # a round: encoder, table and valve averaged; each client keeps its head and sets c_p, c_g from its trained table
    s1, c1, _, rows = run_rounds(alg, data, server, clients, ROOT, rounds=1, keep_rows=True)
    p = np.array(COUNTS, np.float32) / sum(COUNTS)
    for k in ("encoder", "gce", "cov"):
        assert_trees_close(s1[k], jax.tree_util.tree_map(lambda a: np.tensordot(p, np.asarray(a), 1), rows[k]),
                           atol=1e-6)
    assert_trees_close(c1["head"], rows["head"], atol=0, rtol=0)
    counts = np.stack([np.bincount(np.asarray(data.y[i, :n]), minlength=4) for i, n in enumerate(COUNTS)])
    want = jax.vmap(conditional_inputs)(rows["gce"], jnp.asarray(counts, jnp.float32))
    np.testing.assert_allclose(c1["c_p"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c1["c_g"], want[1], rtol=1e-5, atol=1e-6)


def test_the_cli_runs_gpfl(tmp_path):
    assert_cli_runs("gpfl", tmp_path)
