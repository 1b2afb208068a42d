"""SCAFFOLD, FedDyn and FedDC (RFedDis's drift-correcting baselines): their reductions, their extra loss terms,
and their control-variate / drift / server updates against numpy, on the tiny CNN with ragged clients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, bit_identity, info, make_data, make_trainer, rounding_tolerance, trained_rows

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import client_lr
from jaxfl.algorithms.feddc import dc_term
from jaxfl.algorithms.feddyn import dyn_term
from jaxfl.core.cohort import client_keys
from jaxfl.core.step import aggregation_weights, init_state
from jaxfl.core.trainer import ClientOptimizer, LocalTrainer
from jaxfl.core.types import RoundInfo, RunContext
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)
STEPS = (2, 2, 1)  # ceil(n / 16): client 2 takes a single step, so its corrected step has a closed form
DATA = make_data(list(COUNTS))
W = np.array(COUNTS, np.float32) / sum(COUNTS)  # the engine's sample weights
ALPHA = 0.5


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def trainer():
    return make_trainer(batch_size=16)  # SGD lr 0.05, momentum 0.5, one epoch


LR = client_lr(trainer())


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def per_client(v, like):
    return np.asarray(v, np.float32).reshape((-1,) + (1,) * like.ndim)


@functools.lru_cache(maxsize=None)
def setup(name, **opts):
    """(alg, server, clients, round_fn): round_fn(server, clients, r) -> (server, clients, trained rows,
    metrics), a full-participation round as the engine runs it (each client's ``local_update`` with its
    engine key and RoundInfo, then ``aggregate`` with sample weights). One client's jitted update serves the
    three: it compiles in about half the time of a whole cohort round (the engine path itself is covered by
    test_baselines' generic map/vmap test)."""
    alg = build_algorithm(name, model(), trainer(), RunContext(num_clients=len(COUNTS)), **opts)
    server, clients = init_state(alg, jax.random.key(0), DATA.x[0], len(COUNTS))
    ids = jnp.arange(len(COUNTS))

    @jax.jit
    def local(server, clients, r, i):  # client i's update, as the engine calls it
        row = lambda t: jax.tree_util.tree_map(lambda a: a[i], t)
        return alg.local_update(server, row(clients), row(DATA), client_keys(ROOT, r, ids)[i], RoundInfo(r, i))

    def round_fn(server, clients, r):
        r = jnp.int32(r)
        out = [local(server, clients, r, jnp.int32(i)) for i in range(len(COUNTS))]
        trained, metrics = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *out)
        new, kept = alg.aggregate(server, trained, aggregation_weights(DATA.count, "samples"), info(r, ids))
        return new, kept, trained, metrics

    return alg, server, clients, round_fn


def fedavg_rows(server, r):
    """FedAvg's trained rows from the model (params, batch_stats) of ``server``, with round r's keys."""
    _, _, c0, fedavg_round = setup("fedavg")
    return fedavg_round({"params": server["params"], "batch_stats": server["batch_stats"]}, c0, r)[2]


def random_like(tree, rng, lead=()):
    return jax.tree_util.tree_map(lambda l: jnp.asarray(rng.normal(0, 0.1, lead + l.shape), jnp.float32), tree)


def test_client_lr_is_the_trainers_client_optimizer_lr():
    assert LR == 0.05
    for opt in (ClientOptimizer("sgd", 0.02, momentum=0.9, weight_decay=1e-3), ClientOptimizer("adam", 0.001)):
        trainer_ = LocalTrainer(opt, 8, 1)
        assert trainer_.optimizer is opt and client_lr(trainer_) == opt.lr
    assert client_lr(trainer(), 0.3) == 0.3  # an explicit --scaffold.lr wins
    # another optax transformation carries no learning rate: the option must be given, and no optimizer is probed
    with pytest.raises(ConfigError, match="--scaffold.lr"):
        client_lr(LocalTrainer(optax.sgd(0.1), 8, 1))
    assert client_lr(LocalTrainer(optax.sgd(0.1), 8, 1), 0.1) == 0.1
    with pytest.raises(ConfigError, match="--scaffold.lr"):
        build_algorithm("scaffold", model(), LocalTrainer(optax.sgd(0.1), 8, 1), RunContext(num_clients=3))


def test_the_runs_lr_reaches_the_control_variate_update():
    # c_i+ = c_i - c + (x - y_i) / (K lr) with c_i = c = 0 and the same y_i: the lr of the variate (the option,
    # else the trainer's ClientOptimizer lr, 0.05) halved doubles c_i+; the training itself is the same in both
    rows = []
    for lr in (None, 0.1):
        alg = build_algorithm("scaffold", model(), trainer(), RunContext(num_clients=len(COUNTS)), lr=lr)
        server, clients = init_state(alg, jax.random.key(0), DATA.x[0], len(COUNTS))
        rows.append(trained_rows(alg, DATA, server, clients, ROOT))
    assert_trees_close(rows[0]["c"], jax.tree_util.tree_map(lambda a: 2 * a, rows[1]["c"]), rtol=1e-5, atol=1e-7)
    assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(rows[1]["c"])) > 1e-3


def test_extra_loss_terms_match_numpy():
    rng = np.random.default_rng(1)
    shapes = {"a": jnp.zeros((3, 2)), "b": {"c": jnp.zeros((4,))}}
    w, theta, h, corr = (random_like(shapes, rng) for _ in range(4))
    flat = lambda t: np.concatenate([x.ravel() for x in leaves(t)]).astype(np.float64)
    fw, ft, fh, fc = map(flat, (w, theta, h, corr))
    # FedDyn: alpha <h_i, w> + alpha/2 ||w - theta||^2 = -<grad_i, w> + alpha/2 ||w - theta||^2, grad_i = -alpha h_i
    np.testing.assert_allclose(dyn_term(w, theta, h, 0.3), 0.3 * fh @ fw + 0.15 * np.sum((fw - ft) ** 2), rtol=1e-5)
    # FedDC: alpha/2 ||w + h_i - theta||^2 + <G - G_i, w>
    np.testing.assert_allclose(dc_term(w, theta, h, corr, 0.3), 0.15 * np.sum((fw + fh - ft) ** 2) + fc @ fw,
                               rtol=1e-5)
    # their gradients: alpha (w - theta) + alpha h_i, and alpha (w + h_i - theta) + (G - G_i)
    np.testing.assert_allclose(flat(jax.grad(dyn_term)(w, theta, h, 0.3)), 0.3 * (fw - ft) + 0.3 * fh, rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(flat(jax.grad(dc_term)(w, theta, h, corr, 0.3)), 0.3 * (fw + fh - ft) + fc,
                               rtol=1e-5, atol=1e-7)


@bit_identity("round 0's control variates are zeros: the corrected gradient adds exact zeros to FedAvg's")
def test_scaffold_first_round_is_fedavg_and_sets_option_ii_variates():
    _, s0, c0, fedavg_round = setup("fedavg")
    _, s0s, c0s, scaffold_round = setup("scaffold")
    assert_trees_close(s0, {k: s0s[k] for k in s0}, atol=0, rtol=0)
    sa, _, ta, _ = fedavg_round(s0, c0, 0)
    ss, cs, ts, metrics = scaffold_round(s0s, c0s, 0)
    np.testing.assert_array_equal(metrics["steps"], STEPS)
    # zero control variates and lr_g = 1: exactly FedAvg's local models and average
    assert_trees_close((ts["params"], ts["batch_stats"]), (ta["params"], ta["batch_stats"]), atol=0, rtol=0)
    assert_trees_close((ss["params"], ss["batch_stats"]), (sa["params"], sa["batch_stats"]), atol=0, rtol=0)
    # option II with each client's own K: c_i = (x - y_i) / (K_i lr); c = 1/N sum_i c_i
    for x, y, ci, c in zip(leaves(s0["params"]), leaves(ta["params"]), leaves(cs["c"]), leaves(ss["c"])):
        expect = (x[None] - y) / (per_client(STEPS, x) * np.float32(LR))
        np.testing.assert_allclose(ci, expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(c, expect.mean(0), rtol=1e-5, atol=1e-5)
    assert max(np.abs(c).max() for c in leaves(ss["c"])) > 1e-3
    assert set(cs) == {"c"}  # a client keeps its control variate and nothing else


def test_scaffold_corrected_step_and_variate_updates_match_numpy():
    _, s0, _, scaffold_round = setup("scaffold")
    rng = np.random.default_rng(0)
    server = dict(s0, c=random_like(s0["params"], rng))
    clients = {"c": random_like(s0["params"], rng, (3,))}
    s1, c1, trained, _ = scaffold_round(server, clients, 0)
    plain = fedavg_rows(server, 0)
    for x, y, y0, c, ci, ci1, cn, xn in zip(*map(leaves, (server["params"], trained["params"], plain["params"],
                                                          server["c"], clients["c"], c1["c"], s1["c"], s1["params"]))):
        # client 2 takes one step: y = x - lr (g(x) + c - c_2), i.e. FedAvg's step minus lr (c - c_2)
        np.testing.assert_allclose(y[2], y0[2] - LR * (c - ci[2]), rtol=1e-5, atol=1e-6)
        # c_i+ = c_i - c + (x - y_i) / (K_i lr); c+ = c + 1/N sum_i (c_i+ - c_i); x+ = sum_i p_i y_i
        expect = ci - c[None] + (x[None] - y) / (per_client(STEPS, x) * np.float32(LR))
        np.testing.assert_allclose(ci1, expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cn, c + (expect - ci).mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(xn, np.tensordot(W, y, 1), rtol=1e-5, atol=1e-6)
    assert not np.allclose(leaves(trained["params"])[0][0], leaves(plain["params"])[0][0])  # K = 2 clients too


def test_scaffold_server_counts_all_clients_and_applies_the_global_lr():
    """Two of N = 5 clients report: c += (dc_1 + dc_4) / 5 (= |S|/N mean dc); x <- x + lr_g sum_i p_i dy_i."""
    alg = build_algorithm("scaffold", model(), trainer(), RunContext(num_clients=5), global_lr=0.5)
    server, _ = alg.init(jax.random.key(0), DATA.x[0])
    rng = np.random.default_rng(2)
    server = dict(server, c=random_like(server["params"], rng))
    trained = {"params": random_like(server["params"], rng, (2,)), "c": random_like(server["params"], rng, (2,)),
               "dc": random_like(server["params"], rng, (2,)),
               "batch_stats": random_like(server["batch_stats"], rng, (2,))}
    new, kept = alg.aggregate(server, trained, jnp.array([3.0, 1.0]), info(0, [1, 4]))
    p = np.array([0.75, 0.25], np.float32)
    for x, y, c, dc, xn, cn in zip(*map(leaves, (server["params"], trained["params"], server["c"], trained["dc"],
                                                 new["params"], new["c"]))):
        np.testing.assert_allclose(xn, x + 0.5 * np.tensordot(p, y - x[None], 1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cn, c + dc.sum(0) / 5, rtol=1e-5, atol=1e-6)
    assert_trees_close(kept["c"], trained["c"], atol=0, rtol=0)


def test_feddyn_alpha_zero_trains_like_fedavg_but_adds_the_mean_drift():
    """The honest reduction: alpha -> 0 leaves plain CE locally, but theta^{t+1} = mean(theta_i) - h/alpha keeps
    -h/alpha = the mean accumulated drift, so the first server model is 2 mean(theta_i) - theta^0, not FedAvg's."""
    _, s0, c0, fedavg_round = setup("fedavg")
    _, s0d, c0d, dyn_round = setup("feddyn", alpha=0.0)
    sa, _, ta, _ = fedavg_round(s0, c0, 0)
    sd, cd, td, _ = dyn_round(s0d, c0d, 0)
    assert_trees_close(td["params"], ta["params"], atol=0, rtol=0)
    for x, y, h, hbar, xn, xa in zip(*map(leaves, (s0["params"], ta["params"], cd["drift"], sd["drift_mean"],
                                                   sd["params"], sa["params"]))):
        np.testing.assert_allclose(h, y - x[None], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(hbar, (y - x[None]).mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(xn, xa + hbar, rtol=1e-5, atol=1e-6)
    assert_trees_close(sd["batch_stats"], sa["batch_stats"], atol=0, rtol=0)
    assert not np.allclose(leaves(sd["params"])[0], leaves(sa["params"])[0])
    assert set(cd) == {"drift"}


def test_feddyn_and_feddc_first_rounds_are_fedprox_and_their_second_rounds_match_numpy():
    _, s0, c0, dyn_round = setup("feddyn", alpha=ALPHA)
    _, s0c, c0c, dc_round = setup("feddc", alpha=ALPHA)
    d1, dk1, dt1, _ = dyn_round(s0, c0, 0)
    f1, fk1, ft1, _ = dc_round(s0c, c0c, 0)
    # round 1 (h_i = 0, G = G_i = 0): both train CE + alpha/2 ||w - theta||^2, FedProx's objective with mu = alpha
    # (two programs: equal up to float32 rounding of FedDyn's local updates)
    tol = rounding_tolerance(lambda s, c: dyn_round(s, c, 0)[2]["params"], s0, c0)
    assert_trees_close(dt1["params"], ft1["params"], atol=tol, rtol=0)
    x0, y1, avg1 = leaves(s0["params"]), leaves(dt1["params"]), leaves(fedavg_rows(s0, 0)["params"])
    for y, y0 in zip(y1, avg1):  # the proximal gradient is 0 at theta: client 2's single step is FedAvg's
        np.testing.assert_allclose(y[2], y0[2], rtol=1e-6, atol=1e-7)
    assert not np.allclose(y1[0][0], avg1[0][0])  # a second step feels the proximal term

    # FedDyn round 2: client 2's single step y = theta - lr (g(theta) + alpha h_2); then the drift updates
    d2, dk2, dt2, _ = dyn_round(d1, dk1, 1)
    plain = fedavg_rows(d1, 1)
    for th, y, y0, h, h2, hbar, hbar2, th2 in zip(*map(leaves, (d1["params"], dt2["params"], plain["params"],
                                                                dk1["drift"], dk2["drift"], d1["drift_mean"],
                                                                d2["drift_mean"], d2["params"]))):
        np.testing.assert_allclose(y[2], y0[2] - LR * ALPHA * h[2], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h2, h + y - th[None], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(hbar2, hbar + (y - th[None]).mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(th2, np.tensordot(W, y, 1) + hbar2, rtol=1e-5, atol=1e-6)

    # FedDC: after round 1 G_i = (theta - w_i)/(K_i lr), G = mean G_i, h_i = w_i - theta, cloud = avg + mean h_i
    for x, y, gi, g, h, th in zip(x0, leaves(ft1["params"]), *map(leaves, (fk1["g"], f1["g"], fk1["drift"],
                                                                            f1["params"]))):
        expect = (x[None] - y) / (per_client(STEPS, x) * np.float32(LR))
        np.testing.assert_allclose(gi, expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, expect.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h, y - x[None], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(th, np.tensordot(W, y, 1) + (y - x[None]).mean(0), rtol=1e-5, atol=1e-6)
    # FedDC round 2: client 2's single step y = theta - lr (g(theta) + alpha h_2 + G - G_2); the updates
    f2, fk2, ft2, _ = dc_round(f1, fk1, 1)
    plain = fedavg_rows(f1, 1)
    for th, y, y0, h, h2, gi, gi2, g, g2, hbar2, th2 in zip(*map(leaves, (
            f1["params"], ft2["params"], plain["params"], fk1["drift"], fk2["drift"], fk1["g"], fk2["g"], f1["g"],
            f2["g"], f2["drift_mean"], f2["params"]))):
        np.testing.assert_allclose(y[2], y0[2] - LR * (ALPHA * h[2] + g - gi[2]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h2, h + y - th[None], rtol=1e-5, atol=1e-6)
        expect = gi - g[None] + (th[None] - y) / (per_client(STEPS, th) * np.float32(LR))
        np.testing.assert_allclose(gi2, expect, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(g2, g + (expect - gi).mean(0), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(th2, np.tensordot(W, y, 1) + hbar2, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(hbar2, h2.mean(0), rtol=1e-5, atol=1e-6)  # full participation: mean of all h_i
    assert set(fk2) == {"drift", "g"}
