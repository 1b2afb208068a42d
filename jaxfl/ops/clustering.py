"""FINCH clustering (Sarfraz et al., CVPR 2019) and FPL's clustered class prototypes, as pure jnp functions."""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
