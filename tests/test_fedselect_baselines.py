"""FedSelect's comparison baselines: FedAvg+FT, FedBABU, FedPAC (reductions, value checks, what each keeps)."""
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import (assert_trees_close, bit_identity, codegen_cache, make_data, make_trainer, round_function,
                      rounding_tolerance, rounds_tolerance, run_rounds, setup_algorithm)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import ce_loss, class_feature_sums, in_part, only
from jaxfl.algorithms.fedpac import alignment_loss, client_statistics, global_prototypes
from jaxfl.core.cohort import client_keys
from jaxfl.core.step import init_state
from jaxfl.models import small_cnn
from jaxfl.ops.qp import head_weights, simplex_projection, simplex_qp


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))  # a BatchNorm in the head too


@codegen_cache
def history(name, **opts):
    """[(server, clients) after round 1, after round 2] of ``name`` from the common start (cached: jit once)."""
    alg, data, server, clients = setup_algorithm(name, model(), COUNTS, options=opts)
    fn, out = round_function(alg), []
    for r in range(2):
        server, clients, _ = fn(server, clients, data, r, ROOT)
        out.append((server, clients))
    return out


def rounds(name, n=2, **opts):
    """(server, clients) after ``n`` (1 or 2) rounds."""
    return history(name, **opts)[n - 1]


def setup(name, **opts):
    return setup_algorithm(name, model(), COUNTS, options=opts)


@functools.lru_cache(maxsize=None)
def _fine_tune_fn():
    trainer = make_trainer()

    def one(server, epochs, x, y, count, key):
        from jaxfl.data.clients import ClientData
        t = dataclasses.replace(trainer, epochs=epochs)  # a traced epoch count: one compile for all
        p, s, _, _ = t.run(ce_loss(model()), server["params"], server["batch_stats"], trainer.tx.init(server["params"]),
                           ClientData(x, y, count), key)
        return {"params": p, "batch_stats": s}
    return jax.jit(jax.vmap(one, in_axes=(None, None, 0, 0, 0, 0)))


def fine_tune(server, data, round_idx, epochs):
    """Every client's independent fine-tune of ``server``'s model (all parameters) for ``epochs`` epochs with CE
    and the test trainer, on the client's key of round ``round_idx`` (what FedAvg+FT / FedBABU must keep)."""
    keys = client_keys(ROOT, round_idx, jnp.arange(len(COUNTS)))
    variables = {"params": server["params"], "batch_stats": server["batch_stats"]}
    return _fine_tune_fn()(variables, jnp.int32(epochs), data.x, data.y, data.count, keys)


X_EVAL = make_data(list(COUNTS), seed=5).x[:, :8] / 255.0


def predictions(alg, server, clients):
    return jax.vmap(lambda c, xx: alg.predict(server, c, xx))(clients, X_EVAL)


def apply_rows(rows):
    return jax.vmap(lambda v, xx: model().apply(v, xx, train=False))(rows, X_EVAL)


def assert_fine_tuned_from(s1, alg, data, server, clients, epochs):
    """The clients' tuned models after round 2 are round 1's global model ``s1`` fine-tuned ``epochs`` epochs, and
    the clients predict with them: against an independent fine-tune, another program than the round's local
    update, so equal up to the float32 rounding of that fine-tune and its logits."""
    expected = fine_tune(s1, data, 1, epochs)

    @jax.jit
    def tuned_and_logits(s):
        rows = fine_tune(s, data, 1, epochs)
        return rows, apply_rows(rows)
    tuned_tol, logits_tol = rounding_tolerance(tuned_and_logits, s1)
    assert_trees_close(clients["tuned"], expected, atol=tuned_tol, rtol=0)
    np.testing.assert_allclose(predictions(alg, server, clients), apply_rows(expected), atol=logits_tol, rtol=0)


# -- FedAvg+FT ---------------------------------------------------------------------------------------------
def test_fedavg_ft_with_zero_epochs_is_fedavg():
    a, b = rounds("fedavg"), rounds("fedavg_ft", ft_epochs=0)
    assert_trees_close(a, b, atol=0, rtol=0)  # the server and the (empty) client states
    alg_a, *_ = setup("fedavg")
    alg_b, *_ = setup("fedavg_ft", ft_epochs=0)
    np.testing.assert_array_equal(predictions(alg_a, *a), predictions(alg_b, *b))  # the evaluated model


@bit_identity("fine-tuning runs at evaluation only: the training rounds are FedAvg's operations")
def test_fedavg_ft_trains_fedavg():
    server, clients = rounds("fedavg_ft")  # ft_epochs = E = 1
    assert_trees_close(server, rounds("fedavg")[0], atol=0, rtol=0)  # fine-tuning never reaches the server
    assert set(clients) == {"base", "tuned"} and not jax.tree_util.tree_leaves(clients["base"])


def test_fedavg_ft_evaluates_the_received_model_fine_tuned():
    s1, _ = rounds("fedavg_ft", n=1)
    server, clients = rounds("fedavg_ft")  # ft_epochs = E = 1
    alg, data, *_ = setup("fedavg_ft")
    # what a client predicts with after round 2: the global model it received (round 1's end), fine-tuned E
    # epochs; with ft_epochs = E that is FedAvg's own local model of round 2
    assert_fine_tuned_from(s1, alg, data, server, clients, epochs=1)


# -- FedBABU -----------------------------------------------------------------------------------------------
def test_fedbabu_head_never_changes_and_the_body_is_fedavg_with_a_frozen_head():
    _, data, start, _ = setup("fedbabu")
    server, clients = rounds("fedbabu", ft_epochs=2)
    # the server's head is its random initialisation, bit for bit
    for a, b in zip(jax.tree_util.tree_leaves(server["params"]["head"]),
                    jax.tree_util.tree_leaves(start["params"]["head"])):
        np.testing.assert_array_equal(a, b)
    # an independent computation: FedAvg whose optimizer gives the head zero updates
    trainer = make_trainer()
    frozen = build_algorithm("fedavg", model(), dataclasses.replace(trainer, tx=only(trainer.tx, in_part("encoder"))))
    s, c = init_state(frozen, jax.random.key(0), data.x[0], len(COUNTS))
    ref, _, _ = run_rounds(frozen, data, s, c, ROOT, 2)
    # (other programs for the same math, here and below: equal up to float32 rounding of the reference)
    tol = rounds_tolerance(frozen, data, s, c, ROOT, rounds=2)[0]
    assert_trees_close(server["params"], ref["params"], atol=tol["params"], rtol=0)
    assert_trees_close(server["batch_stats"], ref["batch_stats"], atol=tol["batch_stats"], rtol=0)
    # the evaluated model: the global model of round 1's end, fine-tuned (all parameters) for ft_epochs
    s1, _ = rounds("fedbabu", n=1, ft_epochs=2)
    alg, *_ = setup("fedbabu", ft_epochs=2)
    assert_fine_tuned_from(s1, alg, data, server, clients, epochs=2)


@bit_identity("fine-tuning runs at evaluation only: the training rounds do not read it")
def test_fedbabu_head_only_fine_tuning_and_no_fine_tuning():
    s1, _ = rounds("fedbabu", n=1, ft_part="head", ft_epochs=1)
    server, clients = rounds("fedbabu", ft_part="head", ft_epochs=1)
    assert_trees_close(server, rounds("fedbabu", ft_epochs=2)[0], atol=0, rtol=0)  # training ignores ft
    tuned = clients["tuned"]
    for a, b in zip(jax.tree_util.tree_leaves(tuned["params"]["encoder"]),
                    jax.tree_util.tree_leaves(s1["params"]["encoder"])):
        np.testing.assert_array_equal(a, np.broadcast_to(b, a.shape))  # the body is not fine-tuned
    kernel = lambda p: p["head"]["fc2"]["linear"]["kernel"]
    assert not np.allclose(kernel(tuned["params"])[0], kernel(s1["params"]))  # the head is
    # ft_epochs = 0: every client is evaluated with the global model
    alg0, *_ = setup("fedbabu", ft_epochs=0)
    logits = model().apply({"params": server["params"], "batch_stats": server["batch_stats"]}, X_EVAL[0],
                           train=False)
    np.testing.assert_array_equal(alg0.predict(server, {}, X_EVAL[0]), logits)


# -- FedPAC: the simplex QP --------------------------------------------------------------------------------
def brute_force_qp(P):
    """min a^T P a on the simplex by enumerating supports: on support S the KKT point is P_SS^-1 1 / 1^T P_SS^-1 1."""
    k, best, arg = P.shape[0], np.inf, None
    for r in range(1, k + 1):
        for S in itertools.combinations(range(k), r):
            S = list(S)
            try:
                z = np.linalg.solve(P[np.ix_(S, S)], np.ones(r))
            except np.linalg.LinAlgError:
                continue
            if np.sum(z) <= 0:
                continue
            a = np.zeros(k)
            a[S] = z / np.sum(z)
            if np.all(a >= -1e-12) and a @ P @ a < best:
                best, arg = a @ P @ a, a
    return arg, best


def test_simplex_projection_and_qp_against_brute_force():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(50, 5)) * 2
    proj = np.asarray(jax.vmap(simplex_projection)(jnp.asarray(v, jnp.float32)))
    np.testing.assert_allclose(proj.sum(1), 1.0, atol=1e-6)
    assert np.all(proj >= 0)
    import optax  # the same projection as optax's (which rounds theta differently)
    np.testing.assert_allclose(proj, jax.vmap(optax.projections.projection_simplex)(jnp.asarray(v, jnp.float32)),
                               atol=1e-6)
    for x, p in zip(v[:5], proj):  # the projection is the nearest point: no random simplex point is closer
        pts = rng.dirichlet(np.ones(5), 2000)
        assert np.sum((x - p) ** 2) <= np.min(np.sum((pts - x) ** 2, 1)) + 1e-6
    Ps = []
    for _ in range(12):
        B = rng.normal(size=(5, 6)) * rng.uniform(0.1, 3.0)
        Ps.append(B @ B.T + np.diag(rng.uniform(0.01, 1.0, 5)))
    Ps.append(np.diag([1.0, 4.0, 0.01, 2.0, 3.0]))  # nearly a vertex
    Ps.append(np.eye(5) + 5.0)  # flat: the centre
    Ps.append(np.diag([1.0, 1.0, 1e-3, 1e-3, 1.0]) + np.outer([0, 0, 1, -1, 0], [0, 0, 1, -1, 0]))  # an edge
    found = np.asarray(jax.jit(jax.vmap(simplex_qp))(jnp.asarray(np.stack(Ps), jnp.float32)), float)
    for a, P in zip(found, Ps):
        ref, best = brute_force_qp(P)
        np.testing.assert_allclose(a.sum(), 1.0, atol=1e-5)
        assert np.all(a >= 0)
        np.testing.assert_allclose(a @ P @ a, best, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(a, ref, atol=2e-3)


def official_head_weights(v, H):
    """tools.get_head_agg_weight + agg_classifier_weighted_p's normalisation in numpy (loops as written)."""
    k, C, d = H.shape
    out = []
    for i in range(k):
        dist = np.zeros((k, k))
        for j1 in range(k):
            for j2 in range(j1, k):
                h = sum(np.outer(H[i, c] - H[j1, c], H[i, c] - H[j2, c]) for c in range(C))
                dist[j1, j2] = dist[j2, j1] = np.trace(h)
        a, _ = brute_force_qp(np.diag(v) + dist)
        a = a * (a > 1e-3)
        out.append(a / a.sum())
    return np.array(out)


def test_head_weights_match_the_official_qp():
    rng = np.random.default_rng(1)
    H = rng.normal(size=(3, 4, 3, 5)) * rng.uniform(0.2, 1.0, (3, 4, 1, 1))  # 3 cases of 4 clients
    v = rng.uniform(0.05, 1.0, (3, 4))
    A = np.asarray(jax.jit(jax.vmap(head_weights))(jnp.asarray(v, jnp.float32), jnp.asarray(H, jnp.float32)))
    for case in range(3):
        np.testing.assert_allclose(A[case], official_head_weights(v[case], H[case]), atol=2e-3)
        np.testing.assert_allclose(A[case].sum(1), 1.0, atol=1e-5)


def test_head_weights_of_the_members_ignore_the_other_rows():
    # a cohort padded with rows that are no clients (Poisson sampling): the members' weights are those of the
    # members alone, nothing goes to the other rows, whatever they hold (jitted, vmapped over cases)
    rng = np.random.default_rng(2)
    H = jnp.asarray(rng.normal(size=(3, 4, 3, 5)) * rng.uniform(0.2, 1.0, (3, 4, 1, 1)), jnp.float32)
    v = jnp.asarray(rng.uniform(0.05, 1.0, (3, 4)), jnp.float32)
    junk = jnp.asarray(rng.normal(size=(3, 3, 3, 5)) * 5.0, jnp.float32)
    padded_H, padded_v = jnp.concatenate([H, junk], 1), jnp.concatenate([v, jnp.full((3, 3), 0.3)], 1)
    members = jnp.arange(7) < 4
    alone = jax.jit(jax.vmap(head_weights))
    padded = jax.jit(jax.vmap(lambda v, H: head_weights(v, H, 1000, members)))(padded_v, padded_H)
    # another program (a QP over 7 rows): equal up to float32 rounding of the members' own QP
    np.testing.assert_allclose(padded[:, :4, :4], alone(v, H), atol=rounding_tolerance(alone, v, H), rtol=0)
    assert np.all(np.asarray(padded[:, :4, 4:]) == 0)


@bit_identity("a mask of all ones multiplies by exact ones")
def test_head_weights_with_every_row_a_member_are_the_unrestricted_ones_bit_for_bit():
    # the mask as FedPAC passes it (weights > 0, a value at run time, not a constant XLA could fold away)
    rng = np.random.default_rng(2)
    H = jnp.asarray(rng.normal(size=(3, 4, 3, 5)) * rng.uniform(0.2, 1.0, (3, 4, 1, 1)), jnp.float32)
    v = jnp.asarray(rng.uniform(0.05, 1.0, (3, 4)), jnp.float32)
    masked = jax.jit(jax.vmap(lambda v, H, m: head_weights(v, H, 1000, m), in_axes=(0, 0, None)))
    assert np.array_equal(masked(v, H, jnp.ones(4, bool)), jax.jit(jax.vmap(head_weights))(v, H))


# -- FedPAC: statistics, prototypes, alignment -------------------------------------------------------------
def features(variables, x, train=False, w=None):
    return model().apply(variables, x, train=train, mask=w, method="features",
                         mutable=["batch_stats"] if train else False)


def test_fedpac_statistics_and_prototypes_match_numpy():
    alg, data, server, _ = setup("fedpac")
    variables = {"params": server["params"], "batch_stats": server["batch_stats"]}
    trainer = make_trainer(batch_size=5)  # 24, 17, 9 real samples: partial last batches and padding
    v, H, mu = jax.jit(jax.vmap(lambda x, y, n: client_statistics(*class_feature_sums(
        model(), variables, type(data)(x, y, n), 4, 5, trainer.preprocess))))(data.x, data.y, data.count)
    protos, counts = [], []
    for i, n in enumerate(COUNTS):
        z = np.asarray(features(variables, trainer.preprocess(data.x[i, :n])), float)
        y = np.asarray(data.y[i, :n])
        py = np.array([np.mean(y == k) for k in range(4)])
        # statistics_extraction, as written
        vv, h_ref = 0.0, np.zeros((4, z.shape[1]))
        for k in range(4):
            if np.any(y == k):
                fk = z[y == k]
                m = fk.mean(0)
                h_ref[k] = py[k] * m
                vv += py[k] * np.trace(fk.T @ fk / len(fk)) - py[k] ** 2 * np.sum(m * m)
        np.testing.assert_allclose(v[i], vv / n, rtol=1e-4)
        np.testing.assert_allclose(H[i], h_ref, rtol=1e-4, atol=1e-6)
        protos.append({k: z[y == k].mean(0) for k in range(4) if np.any(y == k)})
        counts.append(np.array([np.sum(y == k) for k in range(4)], float))
        for k, p in protos[-1].items():
            np.testing.assert_allclose(mu[i, k], p, rtol=1e-4, atol=1e-6)
    # protos_aggregation: per class, the count-weighted mean over the clients that have it
    protos[1].pop(2, None)
    counts[1][2] = 0  # client 1 lacks class 2
    stacked = np.stack([[p.get(k, np.zeros(z.shape[1])) for k in range(4)] for p in protos])
    c, total = global_prototypes(jnp.asarray(stacked, jnp.float32), jnp.asarray(np.stack(counts), jnp.float32))
    for k in range(4):
        have = [i for i in range(3) if k in protos[i]]
        ref = sum(counts[i][k] * protos[i][k] for i in have) / sum(counts[i][k] for i in have)
        np.testing.assert_allclose(c[k], ref, rtol=1e-5, atol=1e-6)
    absent, _ = global_prototypes(jnp.zeros((2, 4, 3)), jnp.zeros((2, 4)).at[:, 0].set(1.0))
    assert np.all(np.isfinite(absent))


def test_fedpac_alignment_term():
    _, data, server, _ = setup("fedpac")
    x, y = data.x[2, :10] / 255.0, data.y[2, :10]
    w = jnp.asarray([1.0] * 9 + [0.0])  # the last sample is padding: it counts nowhere
    targets = jax.random.normal(jax.random.key(1), (4, 64))
    args = (server["params"], server["batch_stats"], x, y, w, None, targets)
    loss = jax.jit(lambda gate: (alignment_loss(model(), 0.7)(*args, gate)[0], ce_loss(model())(*args[:6])[0],
                                 features({"params": args[0], "batch_stats": args[1]}, x, True, w)[0]))
    l0, ce, _ = loss(0.0)
    l1, _, z = loss(1.0)
    np.testing.assert_allclose(l0, ce, rtol=1e-6)
    z, t = np.asarray(z, float), np.asarray(targets, float)[np.asarray(y)]
    mse = np.sum(np.asarray(w)[:, None] * (z - t) ** 2) / (9 * 64)
    np.testing.assert_allclose(l1 - l0, 0.7 * mse, rtol=1e-4)


# -- FedPAC: the round -------------------------------------------------------------------------------------
def test_fedpac_without_alignment_and_combination_is_fedrep():
    a_s, a_c = rounds("fedpac", lam=0.0, combine_heads=False)
    b_s, b_c = rounds("fedrep", head_epochs=1)
    # two programs for the same math: equal up to float32 rounding of FedRep's two rounds
    server_tol, client_tol, _ = rounds_tolerance(*setup("fedrep", head_epochs=1), ROOT, rounds=2)
    part = lambda t: {k: t[k] for k in ("params", "batch_stats")}
    assert_trees_close(part(a_s), part(b_s), atol=part(server_tol), rtol=0)
    assert_trees_close(a_c, b_c, atol=client_tol, rtol=0)


@bit_identity("the body and prototype means are the plain weighted mean's operations")
def test_fedpac_aggregate_averages_bodies_and_prototypes_and_combines_heads():
    alg, data, server, clients = setup("fedpac")
    rng = np.random.default_rng(2)
    k = len(COUNTS)
    noisy = lambda t: jax.tree_util.tree_map(
        lambda x: jnp.asarray(x + rng.normal(size=(k,) + x.shape), x.dtype), t)
    counts = rng.integers(0, 5, (k, 4)).astype(np.float32)
    counts[:, 3] = 0  # a class nobody has
    rows = {"params": noisy(server["params"]), "batch_stats": noisy(server["batch_stats"]),
            "v": jnp.asarray(rng.uniform(0.1, 1.0, k), jnp.float32), "h": jnp.asarray(rng.normal(size=(k, 4, 64))),
            "protos": jnp.asarray(rng.normal(size=(k, 4, 64)), jnp.float32), "counts": jnp.asarray(counts)}
    weights = jnp.asarray(COUNTS, jnp.float32)
    new, heads = jax.jit(alg.aggregate)(server, rows, weights, None)

    @jax.jit
    def by_hand(rows, weights):  # the bodies' weighted mean, the prototypes' count-weighted mean, the QP's heads
        w = weights / weights.sum()
        body = {key: jax.tree_util.tree_map(lambda cl: jnp.tensordot(w, cl, 1), rows[key]["encoder"])
                for key in ("params", "batch_stats")}
        c = rows["counts"][:, :3]
        protos = jnp.einsum("ik,ikd->kd", c, rows["protos"][:, :3]) / c.sum(0)[:, None]
        A = head_weights(rows["v"], rows["h"])
        combined = {key: {"head": jax.tree_util.tree_map(lambda old: jnp.tensordot(A, old, 1), rows[key]["head"])}
                    for key in ("params", "batch_stats")}
        return body, protos, combined
    # another program: equal up to float32 rounding of the hand-made means and combination
    (body, protos, combined), (body_tol, protos_tol, combined_tol) = (by_hand(rows, weights),
                                                                       rounding_tolerance(by_hand, rows, weights))
    for key in ("params", "batch_stats"):  # the body: weighted mean; the server's head is never replaced
        assert_trees_close(new[key]["encoder"], body[key], atol=body_tol[key], rtol=0)
        assert_trees_close(new[key]["head"], server[key]["head"], atol=0, rtol=0)
    np.testing.assert_allclose(new["protos"][:3], protos, atol=protos_tol, rtol=0)
    np.testing.assert_array_equal(new["proto_count"], counts.sum(0))  # 0: class 3 absent (local fallback)
    # each client's head: its QP weights times the cohort's heads (the weights match the official QP's)
    A = np.asarray(jax.jit(head_weights)(rows["v"], rows["h"]))
    np.testing.assert_allclose(A, official_head_weights(np.asarray(rows["v"], float), np.asarray(rows["h"], float)),
                               atol=2e-3)
    assert set(heads["params"]) == {"head"}  # the client keeps its head and nothing else
    assert_trees_close(heads, combined, atol=combined_tol, rtol=0)
    # the round: no alignment in round 0 (and the head combination never touches the body), so the body of
    # round 1 is that of lam = 0 without combination; in round 2 the alignment moves it
    s1, _ = rounds("fedpac", n=1)
    s2, _ = rounds("fedpac")
    s_plain1, _ = rounds("fedpac", n=1, lam=0.0, combine_heads=False)
    s_plain2, _ = rounds("fedpac", lam=0.0, combine_heads=False)
    assert_trees_close(s_plain1["params"], s1["params"], atol=0, rtol=0)
    kernel = lambda s: jax.tree_util.tree_leaves(s["params"]["encoder"])[0]
    assert not np.allclose(kernel(s_plain2), kernel(s2), atol=1e-6)
    assert np.all(np.asarray(s2["proto_count"]) == np.bincount(
        np.concatenate([np.asarray(data.y[i, :n]) for i, n in enumerate(COUNTS)]), minlength=4))
