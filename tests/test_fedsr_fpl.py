"""FedSR and FPL (DapperFL's table): their pure pieces against hand computations, their reductions, their state."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, bit_identity, make_data, make_trainer, padded_batch, round_function,
                      rounding_tolerance, rounds_tolerance)
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.fedsr import fedsr_loss, gaussian_representation, sampled_forward
from jaxfl.algorithms.fpl import fpl_loss
from jaxfl.core.step import init_state
from jaxfl.models import small_cnn
from jaxfl.ops.clustering import cluster_prototypes, finch_partition
from jaxfl.ops.losses import gaussian_cmi_bound, prototype_contrastive_loss


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))  # a BatchNorm in the head too


@functools.lru_cache(maxsize=None)
def algorithm(name, **opts):
    return build_algorithm(name, model(), make_trainer(), **opts)


def run(name, rounds, **opts):
    data = make_data(list(COUNTS))
    alg = algorithm(name, **opts)
    step = round_function(alg)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], data.num_clients)
    out = [(server, clients)]
    for r in range(rounds):
        server, clients, _ = step(server, clients, data, r, ROOT)
        out.append((server, clients))
    return out


def assert_padding_free(loss_fn, params, stats):
    """The loss, its gradient and the new BN statistics do not depend on what the padded rows (w = 0) hold."""
    x, y, w = padded_batch()
    key = jax.random.key(11)
    f = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, stats, x, y, w, key)[:2], has_aux=True))
    (loss, (new_stats, _)), grads = f(params, x, y)
    other_x = jnp.where(w[:, None, None, None] > 0, x, -3.0 * x + 1.0)
    other_y = jnp.where(w > 0, y, (y + 1) % 4)
    (loss2, (new_stats2, _)), grads2 = f(params, other_x, other_y)
    # the same program on other inputs: equal up to float32 rounding of it (what padded rows that counted exceed)
    (loss_tol, (stats_tol, _)), grads_tol = rounding_tolerance(f, params, x, y)
    np.testing.assert_allclose(loss2, loss, atol=loss_tol, rtol=0)
    assert_trees_close((grads2, new_stats2), (grads, new_stats), atol=(grads_tol, stats_tol), rtol=0)


# ------------------------------------------------------------------------------------------------- FedSR

def test_gaussian_cmi_bound_is_the_gaussian_kl_under_jit_vmap_and_grad():
    rng = np.random.default_rng(0)
    mu, r_mu = rng.normal(size=(2, 5, 3))
    sigma, r_sigma = rng.uniform(0.3, 2.0, size=(2, 5, 3))
    c = 1.7
    s2, r2 = (c * sigma) ** 2, r_sigma ** 2
    expected = 0.5 * np.sum(np.log(r2 / s2) + (s2 + (c * mu - r_mu) ** 2) / r2 - 1.0, -1)
    args = [jnp.asarray(a, jnp.float32) for a in (mu, sigma, r_mu, r_sigma)]
    np.testing.assert_allclose(jax.jit(gaussian_cmi_bound)(*args, c), expected, rtol=1e-5)
    per_row = jax.vmap(lambda *a: gaussian_cmi_bound(*(t[None] for t in a), c)[0])(*args)
    np.testing.assert_allclose(per_row, expected, rtol=1e-5)
    # d/dmu = c (c mu - r_mu) / r_sigma^2; zero when the scaled posterior equals the reference
    grad = jax.grad(lambda m: jnp.sum(gaussian_cmi_bound(m, *args[1:], c)))(args[0])
    np.testing.assert_allclose(grad, c * (c * mu - r_mu) / r2, rtol=1e-4, atol=1e-6)
    same = gaussian_cmi_bound(args[2] / c, args[3] / c, args[2], args[3], c)
    np.testing.assert_allclose(same, 0.0, atol=1e-5)


def fedsr_variables(alg, seed=0):
    x = padded_batch()[0]
    server, prior = alg.init(jax.random.key(seed), x)
    prior = {"r_mu": jnp.asarray(np.random.default_rng(seed).normal(size=prior["r_mu"].shape), jnp.float32),
             "r_sigma": prior["r_sigma"] * 0.5, "scale": jnp.asarray(1.3)}
    return server, prior


def test_fedsr_loss_matches_numpy_and_ignores_padding():
    alg = algorithm("fedsr")
    server, prior = fedsr_variables(alg)
    l2r, cmi = 0.3, 0.2
    loss_fn = fedsr_loss(model(), l2r, cmi)
    params = {"model": server["params"], "proj": server["proj"], "prior": prior}
    x, y, w = padded_batch(real=8)
    key = jax.random.key(5)
    loss, _ = loss_fn(params, server["batch_stats"], x, y, w, key)
    # by hand: the same eps (the loss draws it from the first half of split(key)), the model's logits on z
    k = server["proj"]["bias"].shape[0] // 2
    eps = jax.random.normal(jax.random.split(key)[0], (1, 8, k))
    (logits, z, mu, sigma), _ = model().apply({"params": server["params"], "batch_stats": server["batch_stats"]},
                                              x, True, w, server["proj"], eps, method=sampled_forward,
                                              mutable=["batch_stats"])
    logits, z, mu, sigma, yy = (np.asarray(a, np.float64) for a in (logits[0], z[0], mu, sigma, y))
    yy = yy.astype(int)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    ce = -np.mean(logp[np.arange(8), yy])
    rm, rs = np.asarray(prior["r_mu"])[yy], np.log1p(np.exp(np.asarray(prior["r_sigma"])))[yy]
    s, m = 1.3 * sigma, 1.3 * mu
    kl = np.mean(np.sum(np.log(rs) - np.log(s) + (s ** 2 + (m - rm) ** 2) / (2 * rs ** 2) - 0.5, 1))
    expected = ce + l2r * np.mean(np.linalg.norm(z, axis=1)) + cmi * kl
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert_padding_free(loss_fn, params, server["batch_stats"])


def test_fedsr_priors_stay_on_the_client_and_move_only_with_the_cmi_term():
    for cmi, moves in ((0.0, False), (0.01, True)):
        (s0, c0), (s1, c1) = run("fedsr", 1, cmi=cmi)
        assert set(s1) == {"params", "batch_stats", "proj"}  # the server never holds a prior
        assert set(c1) == {"r_mu", "r_sigma", "scale"} and c1["r_mu"].shape[0] == len(COUNTS)
        changed = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(c0),
                                                            jax.tree_util.tree_leaves(c1))]
        assert all(changed) if moves else not any(changed)
        # the clients' priors differ from each other once they have trained on their own data
        if moves:
            assert not np.allclose(c1["r_mu"][0], c1["r_mu"][1])
        assert not np.array_equal(s0["proj"]["kernel"], s1["proj"]["kernel"])


def test_fedsr_prediction_averages_probabilities_over_samples_or_uses_the_mean():
    x = padded_batch()[0]
    by_mean, by_samples = algorithm("fedsr", eval_samples=0), algorithm("fedsr", eval_samples=7)
    server, prior = fedsr_variables(by_mean)
    variables = {"params": server["params"], "batch_stats": server["batch_stats"]}
    h = model().apply(variables, x, method="features")
    mu, sigma = gaussian_representation(h, server["proj"])
    head = lambda z: model().apply(variables, z, method=lambda m, z: m.head(z, False, None))
    np.testing.assert_allclose(by_mean.predict(server, prior, x), jax.nn.log_softmax(head(mu)), rtol=1e-5,
                               atol=1e-6)
    eps = jax.random.normal(jax.random.PRNGKey(0), (7,) + mu.shape)
    probs = np.mean([np.asarray(jax.nn.softmax(head(mu + sigma * e))) for e in eps], 0)
    np.testing.assert_allclose(np.exp(by_samples.predict(server, prior, x)), probs, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------- FPL

def finch_reference(data):
    """FINCH's last partition, cosine distance, with SciPy connected components (as the official utils/finch.py)."""
    def first_neighbour_graph(mat):
        unit = mat / np.linalg.norm(mat, axis=1, keepdims=True)
        dist = 1.0 - unit @ unit.T
        np.fill_diagonal(dist, 1e12)
        n = len(mat)
        a = np.zeros((n, n))
        a[np.arange(n), np.argmin(dist, 1)] = 1
        a = (a + np.eye(n)) @ (a + np.eye(n)).T
        np.fill_diagonal(a, 0)
        return connected_components(csr_matrix(a), directed=True, connection="weak")

    n, labels = first_neighbour_graph(data)
    partitions, counts = [labels], [n]
    while True:
        ids = np.unique(partitions[-1])
        means = np.stack([data[partitions[-1] == k].mean(0) for k in ids])
        n, merged = first_neighbour_graph(means)
        if n == 1 or counts[-1] - n < 1:
            return partitions[-1], counts[-1]
        partitions.append(merged[np.searchsorted(ids, partitions[-1])])
        counts.append(n)


def same_partition(a, b):
    return np.array_equal(a[:, None] == a[None, :], b[:, None] == b[None, :])


def test_finch_partition_matches_scipy_finch_and_ignores_invalid_points():
    rng = np.random.default_rng(0)
    finch = jax.jit(finch_partition)
    for trial in range(40):
        m, d = int(rng.integers(2, 17)), int(rng.integers(2, 6))
        centers = rng.normal(size=(int(rng.integers(1, 5)), d))
        points = centers[rng.integers(0, len(centers), m)] + 0.3 * rng.normal(size=(m, d))
        expected, n_expected = finch_reference(points)
        # the same points among garbage rows marked invalid, in one shape for every trial (19 rows, 5 features:
        # zero features change no distance; one compilation)
        rows = rng.permutation(19)[:m]
        padded = rng.normal(size=(19, 5)) * 10
        padded[rows] = np.pad(points, ((0, 0), (0, 5 - d)))
        valid = np.zeros(19, bool)
        valid[rows] = True
        labels, n = finch(jnp.asarray(padded, jnp.float32), jnp.asarray(valid))
        assert int(n) == n_expected, trial
        assert same_partition(np.asarray(labels)[rows], expected), trial


def test_cluster_prototypes_by_hand():
    # class 0: clients 0, 1 point one way, clients 2, 3 the other -> 2 clusters; class 1: only client 3 has it
    protos = np.zeros((4, 2, 2), np.float32)
    protos[:, 0] = [[1.0, 0.1], [1.0, 0.0], [0.0, 1.0], [0.1, 1.0]]
    protos[3, 1] = [2.0, 3.0]
    present = np.array([[1, 0], [1, 0], [1, 0], [1, 1]], bool)
    protos[0, 1] = 99.0  # absent: ignored
    cluster, valid, unbiased, class_valid = jax.jit(cluster_prototypes, static_argnums=2)(
        jnp.asarray(protos), jnp.asarray(present), 3)
    np.testing.assert_array_equal(valid, [[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(class_valid, [1, 1])
    got = sorted(map(tuple, np.round(np.asarray(cluster[0, :2]), 5)))
    assert got == [(0.05, 1.0), (1.0, 0.05)]
    np.testing.assert_allclose(unbiased[0], [0.525, 0.525], rtol=1e-6)
    np.testing.assert_allclose(cluster[1, 0], [2.0, 3.0])
    np.testing.assert_allclose(unbiased[1], [2.0, 3.0])


def test_prototype_contrastive_loss_matches_the_official_per_sample_loop():
    rng = np.random.default_rng(1)
    c, s, d, b, tau = 3, 2, 4, 6, 0.5
    z = rng.normal(size=(b, d))
    y = np.array([0, 1, 2, 0, 1, 2])
    cluster = rng.normal(size=(c, s, d))
    valid = np.array([[1, 1], [1, 0], [0, 0]], bool)  # class 2 has no prototype
    unbiased = np.stack([cluster[k][valid[k]].mean(0) if valid[k].any() else np.zeros(d) for k in range(c)])
    args = [jnp.asarray(a, jnp.float32) for a in (z, y, cluster, valid, unbiased, valid.any(1))]
    args[1] = args[1].astype(jnp.int32)
    got = jax.jit(prototype_contrastive_loss, static_argnums=6)(*args, tau)
    for i in range(b):
        if not valid[y[i]].any():
            assert float(got[i]) == 0.0
            continue
        cos = lambda p: p @ z[i] / (np.linalg.norm(p) * np.linalg.norm(z[i]))
        pos = [np.exp(cos(p) / tau) for p in cluster[y[i]][valid[y[i]]]]
        neg = [np.exp(cos(p) / tau) for k in range(c) if k != y[i] for p in cluster[k][valid[k]]]
        infonce = -np.log(sum(pos) / (sum(pos) + sum(neg)))
        mse = np.mean((z[i] - unbiased[y[i]]) ** 2)
        np.testing.assert_allclose(float(got[i]), infonce + mse, rtol=1e-5)
    # no prototypes at all (round 0): zero loss and a finite, zero gradient
    none = [args[0], args[1], args[2], jnp.zeros_like(args[3]), args[4], jnp.zeros_like(args[5])]
    grad = jax.grad(lambda zz: jnp.sum(prototype_contrastive_loss(zz, *none[1:], tau)))(args[0])
    np.testing.assert_array_equal(grad, 0.0)
    # per sample: vmap over the batch equals the batched call
    one = jax.vmap(lambda zi, yi: prototype_contrastive_loss(zi[None], yi[None], *args[2:], tau)[0])
    np.testing.assert_allclose(one(args[0], args[1]), got, rtol=1e-6)


@bit_identity("round 0 has no prototypes: the contrastive term's weight is 0 and adds exact zeros")
def test_fpl_round_zero_is_fedavg_and_the_server_clusters_the_cohorts_class_means():
    fedavg, fpl = run("fedavg", 2), run("fpl", 2, max_clusters=4)
    # no prototypes in round 0: FedAvg's round (two programs, equal up to float32 rounding of FedAvg's round)
    tol = rounds_tolerance(algorithm("fedavg"), make_data(list(COUNTS)), *fedavg[0], ROOT, rounds=1)[0]
    assert_trees_close({k: fpl[1][0][k] for k in ("params", "batch_stats")}, fedavg[1][0], atol=tol, rtol=0)
    server = fpl[1][0]
    assert bool(jnp.all(server["class_valid"]))  # every client holds every class of the synthetic data
    assert int(jnp.sum(server["cluster_valid"])) >= 4  # at least one cluster per class
    # round 1 uses the prototypes: it departs from FedAvg
    diff = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                                            fpl[2][0]["params"], fedavg[2][0]["params"]))
    assert max(diff) > 1e-4
    assert fpl[2][1] == {}  # a client keeps nothing


def test_fpl_loss_ignores_padding():
    alg = algorithm("fpl", max_clusters=2)
    x = padded_batch()[0]
    server, _ = alg.init(jax.random.key(0), x)
    rng = np.random.default_rng(2)
    protos = {"cluster": jnp.asarray(rng.normal(size=server["cluster"].shape), jnp.float32),
              "cluster_valid": jnp.ones(server["cluster_valid"].shape, bool),
              "unbiased": jnp.asarray(rng.normal(size=server["unbiased"].shape), jnp.float32),
              "class_valid": jnp.ones(server["class_valid"].shape, bool)}
    loss_fn = fpl_loss(model(), 0.02)
    assert_padding_free(lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, protos), server["params"],
                        server["batch_stats"])


@pytest.mark.parametrize("name,option,value", [("fedsr", "cmi", -1.0), ("fpl", "tau", 0.0)])
def test_bad_options_are_refused(name, option, value):
    from jaxfl.errors import ConfigError
    with pytest.raises(ConfigError, match=f"{name}.{option}"):
        build_algorithm(name, model(), make_trainer(), **{option: value})
