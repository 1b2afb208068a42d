"""Aggregation as masked tree reductions over the leading client axis.

Every function takes stacked leaves ``x[N, ...]`` and client weights ``w[N]`` (sample counts or any
non-negative numbers; they need not sum to 1).
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


def member_weights(weights):
    """Equal weights for the cohort's clients: 1 for a row of positive weight, 0 for a padded cohort's rows of
    weight 0 (a uniform mean over ones would count them). weights [k] -> [k], same dtype."""
    return (weights > 0).astype(weights.dtype)


def real_rows(ids, weights, n: int):
    """The cohort's row ids into a per-client table of ``n`` rows, with the padded cohort rows (weight 0, which
    may carry a real client's id) sent past the table, for scatters with ``mode="drop"``. ids, weights [k] -> [k]."""
    return jnp.where(weights > 0, ids, n)


def write_rows(table, ids, weights, new):
    """``table`` (leaves [n, ...]) with row ids[i] replaced by new[i] (leaves [k, ...]) for the cohort rows of
    positive weight; padded rows write nothing."""
    n = jax.tree_util.tree_leaves(table)[0].shape[0]
    rows = real_rows(ids, weights, n)
    return jax.tree_util.tree_map(lambda t, v: t.at[rows].set(v, mode="drop"), table, new)


def broadcast_clients(tree, n: int):
    """Stack ``n`` copies of a pytree along a new leading client axis.
    Shapes: tree of leaves [...] -> the same tree with leaves [n, ...].
    """
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)
