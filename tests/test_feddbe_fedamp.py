"""FedDBE (personal representation bias + mean regulariser) and FedAMP (attentive message passing): pure
functions against their formulas, the rounds against hand computations, and both through the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_cli_runs, assert_trees_close, info, make_data, make_trainer, rounding_tolerance,
                      run_rounds, trained_rows)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import ce_loss
from jaxfl.algorithms.fedamp import attention_weights, combine, table_distances
from jaxfl.algorithms.feddbe import biased_forward, feddbe_loss, mean_regulariser, running_mean_step
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn

COUNTS = (12, 20, 7)
ROOT = jax.random.key(3)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def linear_head_model():
    """FedDBE's models have a linear head: a BatchNorm after the head's first layer would cancel the bias."""
    return small_cnn(num_classes=4, width=4)


def setup(name, counts=COUNTS, mdl=None, **options):
    data = make_data(list(counts))
    alg = build_algorithm(name, mdl or model(), make_trainer(), RunContext(num_clients=len(counts)), **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(counts))
    return alg, data, server, clients


def leaves_differ(a, b, tol=1e-6):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                            jax.tree_util.tree_leaves(b))) > tol


def test_dbe_running_mean_and_regulariser_match_their_formulas():
    rng = np.random.default_rng(0)
    r, z, gbar = (rng.normal(size=s).astype(np.float32) for s in ((5,), (6, 5), (5,)))
    w = np.array([1, 1, 1, 1, 0, 0], np.float32)
    new = jax.jit(running_mean_step, static_argnums=3)(r, z, w, 0.3)
    np.testing.assert_allclose(new, 0.7 * r + 0.3 * z[:4].mean(0), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(mean_regulariser)(new, gbar), 0.5 * np.mean((np.asarray(new) - gbar) ** 2),
                               rtol=1e-5)
    # the gradient reaches z only through this batch's mean (r is held fixed): d/dz_b = m w_b (r' - gbar) / (d sum w)
    gz = jax.grad(lambda zz: mean_regulariser(running_mean_step(jnp.asarray(r), zz, w, 0.3), gbar))(jnp.asarray(z))
    want = 0.3 * w[:, None] * (np.asarray(new) - gbar)[None] / (5 * 4)
    np.testing.assert_allclose(gz, want, rtol=1e-4, atol=1e-7)
    gr = jax.grad(lambda rr: mean_regulariser(running_mean_step(rr, jnp.asarray(z), w, 0.3), gbar))(jnp.asarray(r))
    np.testing.assert_array_equal(gr, 0.0)


def test_dbe_round_zero_measures_the_mean_and_later_rounds_are_fedavg_with_a_bias():
    alg, data, server, clients = setup("feddbe", mdl=linear_head_model(), kappa=5.0)
    s1, c1, _, rows = run_rounds(alg, data, server, clients, ROOT, rounds=1, keep_rows=True)
    assert_trees_close(s1["params"], server["params"], atol=0, rtol=0)  # the initialisation period is discarded
    assert bool(s1["measured"])
    p = jnp.asarray(COUNTS, jnp.float32) / sum(COUNTS)
    # (another program than the round's aggregation, here and below: equal up to float32 rounding of the mean)
    mean = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: jnp.tensordot(p, a, 1), t))
    np.testing.assert_allclose(s1["global_mean"], mean(rows["r"]), rtol=0, atol=rounding_tolerance(mean, rows["r"]))
    np.testing.assert_array_equal(c1["prbm"], 0.0)  # no bias is trained in round 0
    # round 1: the server averages the trained models; each client keeps its own bias
    s2, c2, _, rows1 = run_rounds(alg, data, s1, c1, ROOT, rounds=1, keep_rows=True)
    assert_trees_close(s2["params"], mean(rows1["params"]), atol=rounding_tolerance(mean, rows1["params"]), rtol=0)
    assert not np.allclose(c2["prbm"][0], c2["prbm"][1]) and np.abs(np.asarray(c2["prbm"])).max() > 0
    # the loss by formula: CE(h(z + prbm)) + kappa mean((batch mean of z - gbar)^2) / 2 at m = 1
    m, x, y = linear_head_model(), data.x[0, :8] / 255.0 * 2 - 1, data.y[0, :8]
    w = jnp.ones(8)
    c0 = jax.tree_util.tree_map(lambda a: a[0], c2)
    params = {"model": s2["params"], "prbm": c0["prbm"] + 0.3}
    state = {"bn": c0["batch_stats"], "r": jnp.zeros_like(c0["prbm"])}
    loss, _ = feddbe_loss(m, 5.0, 1.0)(params, state, x, y, w, None, s2["global_mean"], jnp.array(True))
    (logits, z), _ = m.apply({"params": s2["params"], "batch_stats": c0["batch_stats"]}, x, c0["prbm"] + 0.3, True, w,
                             method=biased_forward, mutable=["batch_stats"])
    ce = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])
    mr = 0.5 * jnp.mean((z.mean(0) - s2["global_mean"]) ** 2)
    np.testing.assert_allclose(float(loss), float(ce + 5.0 * mr), rtol=1e-5)
    # prediction: the global encoder and head with the client's bias
    out = alg.predict(s2, c0, x)
    want = m.apply({"params": s2["params"], "batch_stats": c0["batch_stats"]}, x, c0["prbm"], False,
                   method=biased_forward)[0]
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert leaves_differ(out, m.apply({"params": s2["params"], "batch_stats": c0["batch_stats"]}, x))


def test_amp_distances_and_attention_match_their_formulas():
    rng = np.random.default_rng(1)
    table = {"a": rng.normal(size=(4, 3, 2)).astype(np.float32), "b": rng.normal(size=(4, 5)).astype(np.float32)}
    row = {"a": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    flat_t = np.concatenate([table["a"].reshape(4, -1), table["b"]], 1)
    flat_r = np.concatenate([row["a"].reshape(-1), row["b"]])
    d2, dot, sq_t, sq_r = jax.jit(table_distances)(table, row)
    np.testing.assert_allclose(sq_r, (flat_r ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(d2, ((flat_t - flat_r) ** 2).sum(1), rtol=1e-5)
    others = np.array([True, False, True, True])
    alpha, sigma = 0.5, 20.0
    xi, xi_self = attention_weights(d2, dot, sq_t, (flat_r ** 2).sum(), others, alpha, sigma, False, 0.0)
    want = np.where(others, alpha / sigma * np.exp(-np.asarray(d2) / sigma), 0.0)
    np.testing.assert_allclose(xi, want, rtol=1e-5)
    np.testing.assert_allclose(float(xi_self), 1 - want.sum(), rtol=1e-5)
    u = combine(table, xi, row, xi_self)
    np.testing.assert_allclose(u["b"], float(xi_self) * row["b"] + (want[:, None] * table["b"]).sum(0), rtol=1e-5)
    # HeurFedAMP: xi_ii = self_weight, the rest a softmax of sigma cos over the others
    hxi, hself = attention_weights(d2, dot, sq_t, (flat_r ** 2).sum(), others, alpha, 2.0, True, 0.3)
    cos = flat_t @ flat_r / (np.linalg.norm(flat_t, axis=1) * np.linalg.norm(flat_r))
    e = np.where(others, np.exp(2.0 * cos), 0.0)
    np.testing.assert_allclose(hxi, 0.7 * e / e.sum(), rtol=1e-5)
    assert float(hself) == pytest.approx(0.3)
    none = attention_weights(d2, dot, sq_t, (flat_r ** 2).sum(), np.zeros(4, bool), alpha, 2.0, True, 0.3)
    np.testing.assert_array_equal(none[0], 0.0)
    assert float(none[1]) == 1.0


def test_amp_rounds_against_hand_computations():
    alg, data, server, clients = setup("fedamp", lam=2.0, alpha=0.5, sigma=5.0)
    # round 0: no uploads yet, u_i = w_i: FedProx's local update with mu = lam / alpha from the same start
    s1, c1, _, rows = run_rounds(alg, data, server, clients, ROOT, rounds=1, keep_rows=True)
    prox_alg, prox_data, prox_server, prox_clients = setup("fedprox", mu=4.0)
    prox_rows = jax.jit(lambda s, c: trained_rows(prox_alg, prox_data, s, c, ROOT)["params"])
    # another program: equal up to float32 rounding of FedProx's local updates
    assert_trees_close(rows["params"], prox_rows(prox_server, prox_clients),
                       atol=rounding_tolerance(prox_rows, prox_server, prox_clients), rtol=0)
    assert_trees_close(s1["models"], rows["params"], atol=0, rtol=0)
    assert bool(s1["uploaded"].all())
    # round 1, client 1: u by the formula over the table, then CE + lam/(2 alpha) ||w - u||^2 from its own model
    i = 1
    row = data.take(i)
    c = jax.tree_util.tree_map(lambda a: a[i], c1)
    trained, _ = jax.jit(alg.local_update)(s1, c, row, jax.random.key(7), info(1, i))
    flat = np.concatenate([np.asarray(leaf).reshape(3, -1) for leaf in jax.tree_util.tree_leaves(s1["models"])], 1)
    d2 = ((flat - flat[i]) ** 2).sum(1)
    xi = np.where(np.arange(3) != i, 0.5 / 5.0 * np.exp(-d2 / 5.0), 0.0)
    assert xi.max() > 1e-3  # the others do pull
    xi[i] = 1 - xi.sum()
    u = jax.tree_util.tree_map(lambda t: jnp.tensordot(jnp.asarray(xi, jnp.float32), t, 1), s1["models"])
    own = jax.tree_util.tree_map(lambda t: t[i], s1["models"])
    trainer, loss = make_trainer(), ce_loss(model(), prox_mu=4.0)

    @jax.jit
    def by_hand(own, stats, u):
        return trainer.run(lambda p, s, x, y, w, k: loss(p, s, x, y, w, k, u), own, stats, trainer.tx.init(own), row,
                           jax.random.key(7))[0]
    # another program (and u summed in another order): equal up to float32 rounding of the hand-made update
    assert_trees_close(trained["params"], by_hand(own, c["batch_stats"], u),
                       atol=rounding_tolerance(by_hand, own, c["batch_stats"], u), rtol=0)
    # a padded cohort row (weight 0) writes nothing, even under a real client's id
    twice = jax.tree_util.tree_map(lambda a: jnp.stack([a, a + 1.0]), trained)
    s2, _ = alg.aggregate(s1, twice, jnp.array([1.0, 0.0]), info(1, [i, i]))
    assert_trees_close(jax.tree_util.tree_map(lambda t: t[i], s2["models"]), trained["params"], atol=0, rtol=0)
    # a client predicts with its own row of the table
    x = data.x[i, :4] / 255.0 * 2 - 1
    apply = jax.jit(lambda p, s, x: model().apply({"params": p, "batch_stats": s}, x))
    np.testing.assert_allclose(alg.predict(s2, c, x, i), apply(trained["params"], c["batch_stats"], x), rtol=0,
                               atol=rounding_tolerance(apply, trained["params"], c["batch_stats"], x))


@pytest.mark.parametrize("name,extra", [("feddbe", []), ("fedamp", ["--fedamp.heuristic"])])
def test_the_cli_runs(name, extra, tmp_path):
    assert_cli_runs(name, tmp_path, *extra)
