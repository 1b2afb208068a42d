"""Aggregation as masked tree reductions over the leading client axis.

Every function takes stacked leaves ``x[N, ...]`` and client weights ``w[N]`` (sample counts or any
non-negative numbers; they need not sum to 1). ``head_weights`` (FedPAC) computes personalized combination
weights over the cohort by a simplex-constrained QP per client (``simplex_qp``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _bcast(w, leaf):
    return w.reshape(w.shape + (1,) * (leaf.ndim - w.ndim))


def _contract_clients(p, x):
    """sum_i p[i] * x[i] over the leading axis, as a matrix-vector product.

    Why not ``jnp.sum(p[:, None] * x, 0)``: XLA:CPU compiles that broadcast-multiply-reduce over the
    leading axis of a large leaf (e.g. [N, 8192, 2048]) into code minutes slower than a GEMV.
    """
    return (p @ x.reshape(x.shape[0], -1)).reshape(x.shape[1:])


def weighted_mean(x, weights):
    """mean = sum_i p_i x_i with p_i = w_i / sum_j w_j, over axis 0; all-zero weights give 0 (never NaN).

    Weights are normalised first, so one client (p = 1) returns its leaf bit for bit.
    x: [N, ...], weights: [N]. Returns [...].
    """
    w = weights.astype(x.dtype)
    total = jnp.sum(w)
    return _contract_clients(w / jnp.where(total > 0, total, 1.0), x)


def masked_mean(x, weights, mask, previous):
    """Per-entry masked weighted mean over clients, keeping ``previous`` where no client shares.

        out[e] = sum_i w_i m_i[e] x_i[e] / sum_i w_i m_i[e]   if sum_i w_i m_i[e] > 0
                 previous[e]                                  otherwise

    x: [N, ...]; weights: [N]; mask: bool/0-1, broadcastable to x (per client [N], per leaf scalar, or
    per entry [N, ...]); previous: [...]. Exact for one client, zero weights, and no sharer; never NaN.
    """
    mask = jnp.asarray(mask, x.dtype)
    w = weights.astype(x.dtype)
    if mask.ndim <= 1 or all(d == 1 for d in mask.shape[1:]):  # one flag per client (or per leaf)
        wm = w * jnp.broadcast_to(mask.reshape(mask.shape[:1]) if mask.ndim else mask, w.shape)
        total = jnp.sum(wm)
        return jnp.where(total > 0, _contract_clients(wm / jnp.where(total > 0, total, 1.0), x), previous)
    wm = jnp.broadcast_to(_bcast(w, x) * mask, x.shape)
    ones = jnp.ones(x.shape[:1], x.dtype)
    total = _contract_clients(ones, wm)
    p = wm / jnp.where(total > 0, total, 1.0)  # normalise first: one sharer returns its entry exactly
    return jnp.where(total > 0, _contract_clients(ones, p * x), previous)


def recovered_mean(x, weights, mask, previous):
    """Heterogeneous aggregation with recovery (DapperFL Eq. 6-7): pruned entries are filled from ``previous``
    before a weighted mean, i.e.

        out = sum_i p_i (m_i x_i + (1 - m_i) W) = W + sum_i p_i m_i (x_i - W),   p_i = w_i / sum_j w_j.

    Unlike ``masked_mean`` the weights are not renormalised over the clients that keep an entry; an entry
    no client keeps stays W exactly, and the values of x_i where m_i = 0 never matter.
    x: [N, ...]; weights [N]; mask broadcastable to x; previous [...].
    """
    w = weights.astype(x.dtype)
    total = jnp.sum(w)
    p = w / jnp.where(total > 0, total, 1.0)
    delta = jnp.where(jnp.asarray(mask, bool), x - previous, 0.0)
    return previous + _contract_clients(p, jnp.broadcast_to(delta, x.shape))


def tree_weighted_mean(tree, weights):
    """``weighted_mean`` on every leaf of a stacked pytree.
    Shapes: tree of leaves [k, ...], weights [k] -> tree of leaves [...].
    """
    return jax.tree_util.tree_map(lambda x: weighted_mean(x, weights), tree)


def tree_masked_mean(tree, weights, mask_tree, previous_tree):
    """``masked_mean`` leaf by leaf: mask_tree has tree's structure, each leaf a Python bool, a bool array
    broadcastable to the stacked leaf, or per entry. Leaves whose mask is the Python bool False return
    ``previous`` unchanged without computing a reduction.
    Shapes: tree: leaves [k, ...]; weights [k]; mask_tree: Python bools or bool [k, ...]; previous_tree:
    leaves [...] -> leaves [...].
    """
    def one(x, m, prev):
        if m is False:
            return prev
        if m is True:
            return weighted_mean(x, weights)
        return masked_mean(x, weights, m, prev)
    return jax.tree_util.tree_map(one, tree, mask_tree, previous_tree)


def tree_where(mask_tree, a, b):
    """Leafwise ``where(mask, a, b)``; Python-bool masks select the whole leaf without computing.
    Shapes: mask_tree (Python bools or arrays), a, b: pytrees of one structure -> that structure.
    """
    def one(m, x, y):
        if m is True:
            return x
        if m is False:
            return y
        return jnp.where(m, x, y)
    return jax.tree_util.tree_map(one, mask_tree, a, b)


def broadcast_clients(tree, n: int):
    """Stack ``n`` copies of a pytree along a new leading client axis.
    Shapes: tree of leaves [...] -> the same tree with leaves [n, ...].
    """
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


ALPHA_EPS = 1e-3  # FedPAC official: head weights below eps are zeroed before normalising


def simplex_projection(v):
    """Euclidean projection of v [k] onto {a >= 0, sum a = 1} (Duchi et al. 2008, sort-based)."""
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u)
    j = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
    rho = jnp.sum(u - (css - 1.0) / j > 0)  # >= 1 always
    theta = (css[rho - 1] - 1.0) / rho.astype(v.dtype)
    return jnp.maximum(v - theta, 0.0)


def simplex_qp(P, iters: int = 1000):
    """argmin_{a in simplex} a^T P a for a symmetric PSD P [k, k]: FISTA projected gradient, step 1/L with
    L = 2 lambda_max(P), from the uniform point. Pure and vmappable."""
    k = P.shape[0]
    L = jnp.maximum(2.0 * jnp.linalg.eigvalsh(P)[-1], 1e-30)
    x0 = jnp.full((k,), 1.0 / k, P.dtype)

    def step(_, carry):
        x, y, t = carry
        x_new = simplex_projection(y - (2.0 * (P @ y)) / L)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        return x_new, x_new + ((t - 1.0) / t_new) * (x_new - x), t_new

    return jax.lax.fori_loop(0, iters, step, (x0, x0, jnp.ones((), P.dtype)))[0]


def head_weights(v, H, iters: int = 1000):
    """The cohort's classifier-combination weights A [k, k] (row i: client i's alpha), from v [k] and
    H [k, C, d]: alpha_i = simplex_qp(diag(v) + D_i), D_i[j, l] = <H_i - H_j, H_i - H_l>; entries below 1e-3
    zeroed and rows renormalised (official ``get_head_agg_weight`` + ``agg_classifier_weighted_p``)."""
    flat = H.reshape(H.shape[0], -1)
    K = flat @ flat.T  # Gram matrix <H_j, H_l>

    def one(i):
        D = K[i, i] - K[i][None, :] - K[i][:, None] + K
        a = simplex_qp(jnp.diag(v) + D, iters)
        a = jnp.where(a > ALPHA_EPS, a, 0.0)
        return a / jnp.sum(a)  # the largest entry of a point of the simplex is >= 1/k > eps

    return jax.vmap(one)(jnp.arange(H.shape[0]))


def _cluster_means(labels, points, valid):
    """(means [M, D], counts [M]) of the clusters named by ``labels`` [M] (ids in [0, M)) over the valid points."""
    m = points.shape[0]
    member = (labels[:, None] == jnp.arange(m)[None, :]) & valid[:, None]  # [point, cluster]
    counts = jnp.sum(member, 0).astype(points.dtype)
    means = member.astype(points.dtype).T @ points / jnp.maximum(counts, 1.0)[:, None]
    return means, counts


def _first_neighbour_step(labels, points, valid):
    """One FINCH merge: the clusters named by ``labels`` are linked to their first (cosine-nearest) neighbour
    cluster, links i -> j, j -> i and shared neighbours joined (A = (N + I)(N + I)^T), and each connected component
    becomes one cluster named by its smallest member id. Returns (new labels [M], number of clusters [])."""
    m = points.shape[0]
    means, counts = _cluster_means(labels, points, valid)
    active = counts > 0
    unit = means / jnp.maximum(jnp.linalg.norm(means, axis=-1, keepdims=True), 1e-12)
    dist = 1.0 - unit @ unit.T
    usable = active[:, None] & active[None, :] & ~jnp.eye(m, dtype=bool)
    dist = jnp.where(usable, dist, jnp.inf)
    nearest = jnp.where(jnp.any(usable, 1), jnp.argmin(dist, 1), jnp.arange(m))  # a lone cluster links to itself
    link = jax.nn.one_hot(nearest, m) + jnp.eye(m)
    reach = ((link @ link.T) > 0) & active[:, None] & active[None, :]
    for _ in range(max(1, (m - 1).bit_length())):  # transitive closure by squaring: paths of length <= 2^k
        reach = (reach.astype(jnp.float32) @ reach.astype(jnp.float32)) > 0
    root = jnp.argmax(reach, 1)  # the smallest id reachable from each active cluster
    new_labels = jnp.where(valid, root[labels], labels)
    return new_labels, jnp.sum(active & (root == jnp.arange(m)))


def finch_partition(points, valid):
    """FINCH's last partition (Sarfraz et al., CVPR 2019), cosine distance, as FPL uses it: points [M, D] with
    valid [M] (invalid rows are ignored) -> cluster labels [M] (each the smallest member's index; an invalid
    point keeps its own index) and the number of clusters [].

    Partition 0 joins each point with its first neighbour (connected components of (N + I)(N + I)^T, N the
    first-neighbour indicator); each further partition does the same to the previous partition's cluster means.
    Merging stops before a partition that would have one cluster or no fewer clusters than the last, and the
    last partition kept is returned (partition 0 is kept even with one cluster, as ``FINCH(...)[0][:, -1]``).
    Each merge at least halves the clusters, so ceil(log2 M) + 1 steps are unrolled."""
    m = points.shape[0]
    labels, n = _first_neighbour_step(jnp.arange(m), points, valid)
    done = jnp.asarray(False)
    for _ in range(max(1, (m - 1).bit_length())):
        nxt, n_next = _first_neighbour_step(labels, points, valid)
        go = ~done & (n_next > 1) & (n_next < n)
        labels, n, done = jnp.where(go, nxt, labels), jnp.where(go, n_next, n), done | ~go
    return labels, n


def cluster_prototypes(protos, present, slots: int):
    """FPL's server step: per class, FINCH-cluster the clients' prototypes and average each cluster.

    protos [K, C, D] (client k's mean feature of class c), present [K, C] (client k has class c), slots: the
    clusters kept per class (the most populous first; FINCH leaves at most K/2 for K >= 2 clients).
    Returns (cluster [C, slots, D] cluster means, cluster_valid [C, slots], unbiased [C, D] the mean of the class's
    cluster means, class_valid [C] some client has the class)."""
    def one_class(p, v):
        labels, _ = finch_partition(p, v)
        means, counts = _cluster_means(labels, p, v)
        order = jnp.argsort(-counts, stable=True)[:slots]
        means, counts = means[order], counts[order]
        if means.shape[0] < slots:  # fewer clients than slots
            pad = slots - means.shape[0]
            means, counts = jnp.pad(means, ((0, pad), (0, 0))), jnp.pad(counts, (0, pad))
        ok = counts > 0
        unbiased = jnp.sum(means * ok[:, None], 0) / jnp.maximum(jnp.sum(ok), 1)
        return means, ok, unbiased, jnp.any(ok)
    return jax.vmap(one_class, in_axes=(1, 1))(protos, present)
