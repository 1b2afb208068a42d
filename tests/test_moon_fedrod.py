"""MOON and FedRoD: their reductions to FedAvg, their extra loss terms against numpy, what stays on a client."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import (assert_trees_close, info, make_data, make_trainer, padded_batch, round_function,
                      rounding_tolerance, rounds_tolerance)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import init_variables, logits_and_representation
from jaxfl.algorithms.fedrod import fedrod_loss, real_mean
from jaxfl.algorithms.moon import moon_loss
from jaxfl.core.step import cohort_train, init_state
from jaxfl.data.clients import ClientData
from jaxfl.models import small_cnn
from jaxfl.ops.losses import balanced_softmax_ce, class_log_prior


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)
BALANCED = (24, 16, 8)  # every client holds each of the 4 classes equally often


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))  # a BatchNorm in the head too


@functools.lru_cache(maxsize=None)
def algorithm(name, **opts):
    return build_algorithm(name, model(), make_trainer(), **opts)


@functools.lru_cache(maxsize=None)
def round_fn(name, **opts):
    return round_function(algorithm(name, **opts))


def balanced_data():
    data = make_data(list(BALANCED))
    y = np.asarray(data.y).copy()
    for i, c in enumerate(BALANCED):
        y[i, :c] = np.arange(c) % 4
    return ClientData(data.x, jnp.asarray(y), data.count)


def run(name, data, rounds, **opts):
    """(server, clients) after each of ``rounds`` rounds."""
    server, clients = init_state(algorithm(name, **opts), jax.random.key(0), data.x[0], data.num_clients)
    out = []
    for r in range(rounds):
        server, clients, _ = round_fn(name, **opts)(server, clients, data, r, ROOT)
        out.append((server, clients))
    return out


def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def cos(a, b):
    return np.sum(a * b, -1) / (np.maximum(np.linalg.norm(a, axis=-1), 1e-8) *
                                np.maximum(np.linalg.norm(b, axis=-1), 1e-8))


# ---------------------------------------------------------------------------------------------------- MOON

def round_parts(name, data, rounds, **opts):
    """[(server, clients, trained rows)] per round from a round's parts: the cohort's local updates (jitted),
    then the algorithm's aggregate, with every client in the cohort and sample weights."""
    alg = algorithm(name, **opts)
    update = jax.jit(cohort_train(alg))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    ids, w, out = jnp.arange(len(COUNTS)), jnp.asarray(COUNTS, jnp.float32), []
    for r in range(rounds):
        trained, _ = update(server, clients, data, ids, r, ROOT)
        server, clients = alg.aggregate(server, trained, w, info(r, list(range(len(COUNTS)))))
        out.append((server, clients, trained))
    return out


def test_moon_with_mu_zero_equals_fedavg_and_each_client_keeps_the_model_it_trained():
    data = make_data(list(COUNTS))
    avg = round_parts("fedavg", data, 2)
    for r, (server, clients, trained) in enumerate(round_parts("moon", data, 2, mu=0.0)):
        # the previous model a client keeps is exactly the model it trained (params and BN statistics)
        assert leaves_equal(clients["prev"], trained)
        kernel = np.asarray(trained["params"]["head"]["fc2"]["linear"]["kernel"])
        assert not np.allclose(kernel[0], kernel[1]) and not np.allclose(kernel[1], kernel[2])
        # mu = 0: exactly FedAvg (every parameter and BN statistic averaged with sample weights)
        assert_trees_close(server, avg[r][0], atol=0, rtol=0)


def test_moon_first_round_has_no_contrastive_term():
    data = make_data(list(COUNTS))
    avg, mo = run("fedavg", data, 2), run("moon", data, 2, mu=5.0)
    # round 0: the official pool of previous models is empty, so l_con = 0 and the round is FedAvg's (up to
    # float32 rounding of the round: the two programs compile differently)
    alg = algorithm("fedavg")
    tol = rounds_tolerance(alg, data, *init_state(alg, jax.random.key(0), data.x[0], len(COUNTS)), ROOT)[0]
    assert_trees_close(mo[0][0], avg[0][0], atol=tol, rtol=0)
    # round 1: the contrastive term is on and changes the update
    assert not np.allclose(avg[1][0]["params"]["head"]["fc2"]["linear"]["kernel"],
                           mo[1][0]["params"]["head"]["fc2"]["linear"]["kernel"], atol=1e-6)


def test_moon_contrastive_term_matches_numpy_and_ignores_padding():
    m = model()
    sample = jnp.zeros((1, 8, 8, 3), jnp.uint8)
    local, glob, prev = (init_variables(m, make_trainer(), jax.random.key(k), sample) for k in (1, 2, 3))
    x, y, w = padded_batch()
    real = np.asarray(w) > 0
    mu, tau = 2.0, 0.5
    penultimate, features = logits_and_representation("penultimate"), logits_and_representation("features")
    # the representations by hand: the head's last hidden ReLU (the input of its output layer)
    relu1 = lambda mod, x, t, mk: mod.head(mod.encoder(x, t, mk), t, mk, taps=True)[1]["relu1"]

    @jax.jit
    def compute(local, glob, prev, x, x2):
        loss = lambda mu_, x_, active: moon_loss(m, mu_, tau)(local["params"], local["batch_stats"], x_, y, w, None,
                                                              glob, prev, active)[0]
        z = m.apply(local, x, True, w, method=relu1, mutable=["batch_stats"])[0]
        zg, zp = m.apply(glob, x, False, None, method=relu1), m.apply(prev, x, False, None, method=relu1)
        cos_ = lambda a, b: jnp.sum(a * b, -1) / (jnp.maximum(jnp.linalg.norm(a, axis=-1), 1e-8) *  # noqa: E731
                                                  jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-8))
        sg, sp = cos_(z, zg) / tau, cos_(z, zp) / tau
        con = -jnp.log(jnp.exp(sg) / (jnp.exp(sg) + jnp.exp(sp)))
        return dict(
            on=loss(mu, x, 1.0), off=loss(0.0, x, 1.0), padded=loss(mu, x2, 1.0), round0=loss(mu, x, 0.0),
            z=z, zg=zg, zp=zp,
            z_forward=m.apply(local, x, True, w, method=penultimate, mutable=["batch_stats"])[0][1],
            features=m.apply(local, x, False, None, method=features)[1], encoder=m.apply(local, x, method="features"),
            expected=mu * jnp.sum(jnp.where(w > 0, con, 0.0)) / jnp.sum(w))  # the term below, in float32

    args = (local, glob, prev, x, x.at[~real].set(100.0))
    out = jax.tree_util.tree_map(np.asarray, compute(*args))
    # each pair: two computations of the same math (other methods, other inputs, a zero term), compiled into other
    # code: equal up to float32 rounding of this program's outputs
    tol = rounding_tolerance(compute, *args)
    np.testing.assert_allclose(out["z_forward"], out["z"], atol=tol["z"], rtol=0)
    np.testing.assert_allclose(out["features"], out["encoder"], atol=tol["encoder"], rtol=0)  # "features": z
    sg, sp = cos(out["z"], out["zg"]) / tau, cos(out["z"], out["zp"]) / tau
    con = -np.log(np.exp(sg) / (np.exp(sg) + np.exp(sp)))
    expected = mu * con[real].mean()
    assert expected > 1e-3
    np.testing.assert_allclose(out["on"] - out["off"], expected, atol=tol["on"] + tol["off"] + tol["expected"], rtol=0)
    # padded rows (w = 0) change nothing, whatever they hold
    np.testing.assert_allclose(out["padded"], out["on"], atol=tol["on"], rtol=0)
    # without a previous model (round 0) the term is off
    np.testing.assert_allclose(out["round0"], out["off"], atol=tol["off"], rtol=0)


# -------------------------------------------------------------------------------------------------- FedRoD

def test_fedrod_generic_part_equals_fedavg_when_class_counts_are_equal():
    # equal counts: log prior is a constant shift, BSM = CE; the personal head sends no gradient into the body
    data = balanced_data()
    avg, rod = run("fedavg", data, 2), run("fedrod", data, 2)
    assert set(rod[1][0]) == {"params", "batch_stats"}  # the personal head never reaches the server
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds
    alg = algorithm("fedavg")
    tol = rounds_tolerance(alg, data, *init_state(alg, jax.random.key(0), data.x[0], 3), ROOT, rounds=2)[0]
    assert_trees_close(rod[1][0], avg[1][0], atol=tol, rtol=0)
    # the personal heads moved, each its own way
    kernel = np.asarray(rod[1][1]["phead"]["kernel"])
    start = init_state(algorithm("fedrod"), jax.random.key(0), data.x[0], 3)[1]["phead"]["kernel"]
    assert not np.allclose(kernel[0], start[0]) and not np.allclose(kernel[0], kernel[1])


def test_fedrod_balanced_softmax_shifts_the_shared_update_on_imbalanced_clients():
    data = make_data(list(COUNTS))  # imbalanced clients: the balanced softmax shifts every client differently
    rod, avg = run("fedrod", data, 1), run("fedavg", data, 1)
    assert set(rod[0][0]) == {"params", "batch_stats"}
    assert not np.allclose(avg[0][0]["params"]["head"]["fc2"]["linear"]["bias"],
                           rod[0][0]["params"]["head"]["fc2"]["linear"]["bias"], atol=1e-4)


def test_fedrod_balanced_softmax_and_personal_loss_match_numpy():
    # class prior from the real labels only (padding rows are labelled 0 and must not count)
    y = jnp.asarray([1, 1, 2, 1, 3, 0, 0, 0], jnp.int32)
    log_prior = class_log_prior(y, jnp.asarray(5), 4)  # class 0 absent: log 0 = -inf
    np.testing.assert_array_equal(np.exp(log_prior), [0.0, 3.0, 1.0, 1.0])
    m = model()
    sample = jnp.zeros((1, 8, 8, 3), jnp.uint8)
    v = init_variables(m, make_trainer(), jax.random.key(1), sample)
    rng = np.random.default_rng(0)
    phead = {"kernel": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
             "bias": jnp.asarray(rng.normal(size=4), jnp.float32)}
    x, _, w = padded_batch()
    params = {"model": v["params"], "phead": phead}
    loss_fn = fedrod_loss(m)

    @jax.jit
    def compute():
        (loss, (_, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, v["batch_stats"], x, y, w, None, log_prior)
        (g, r), _ = m.apply(v, x, True, w, method=logits_and_representation(), mutable=["batch_stats"])
        bsm_only = lambda p: real_mean(balanced_softmax_ce(
            m.apply({"params": p, "batch_stats": v["batch_stats"]}, x, True, w, mutable=["batch_stats"])[0], y,
            log_prior), w)
        return loss, logits, grads, g, r, jax.grad(bsm_only)(v["params"])

    loss, logits, grads, g, r, bsm_grads = compute()
    # the personal head sends no gradient into the body or the generic head: their gradient is BSM's alone (two
    # gradient graphs: equal up to float32 rounding of BSM's gradient)
    bsm_grad = jax.jit(lambda p, stats, x: jax.grad(lambda p: real_mean(balanced_softmax_ce(
        m.apply({"params": p, "batch_stats": stats}, x, True, w, mutable=["batch_stats"])[0], y, log_prior), w))(p))
    tol = rounding_tolerance(bsm_grad, v["params"], v["batch_stats"], x)
    assert_trees_close(grads["model"], bsm_grads, atol=tol, rtol=0)
    g, r, yy, real = np.asarray(g, np.float64), np.asarray(r, np.float64), np.asarray(y), np.asarray(w) > 0

    def ce(z):
        z = z - z.max(-1, keepdims=True)
        return -(z[np.arange(len(yy)), yy] - np.log(np.exp(z).sum(-1)))
    prior = np.array([0.0, 3.0, 1.0, 1.0]) / 5
    with np.errstate(divide="ignore"):
        bsm = ce(g + np.log(prior))[real].mean()
    personal = ce(g + r @ np.asarray(phead["kernel"]) + np.asarray(phead["bias"]))[real].mean()
    np.testing.assert_allclose(float(loss), bsm + personal, rtol=1e-5)
    np.testing.assert_allclose(logits, g + r @ np.asarray(phead["kernel"]) + np.asarray(phead["bias"]), rtol=1e-5,
                               atol=1e-6)
    # padded rows carry the absent class 0: still finite, and they add no gradient
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(grads))
    # the personal head's gradient is that of its CE alone: d/db = mean_real(softmax(g + p) - onehot(y))
    z = g + r @ np.asarray(phead["kernel"]) + np.asarray(phead["bias"])
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(grads["phead"]["bias"], (p - np.eye(4)[yy])[real].mean(0), rtol=1e-4, atol=1e-6)


def test_fedrod_predicts_generic_plus_personal_logits():
    alg = algorithm("fedrod")
    data = make_data(list(COUNTS))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    client = jax.tree_util.tree_map(lambda a: a[0] + 0.1, clients)
    x, _, _ = padded_batch()
    m = model()

    @jax.jit
    def compute(server, client):
        g, r = m.apply(server, x, False, None, method=logits_and_representation())
        return alg.predict(server, client, x), g, r, m.apply(server, x, train=False)

    pred, g, r, plain = compute(server, client)
    np.testing.assert_allclose(pred, g + r @ client["phead"]["kernel"] + client["phead"]["bias"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, plain, rtol=1e-6)  # the generic logits are the network's own output
