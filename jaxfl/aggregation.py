"""Aggregation as masked tree reductions over the leading client axis.

Every function takes stacked leaves ``x[N, ...]`` and client weights ``w[N]`` (sample counts or any
non-negative numbers; they need not sum to 1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _bcast(w, leaf):
    return w.reshape(w.shape + (1,) * (leaf.ndim - w.ndim))


def weighted_mean(x, weights):
    """mean = sum_i p_i x_i with p_i = w_i / sum_j w_j, over axis 0; all-zero weights give 0 (never NaN).

    Weights are normalised first, so one client (p = 1) returns its leaf bit for bit.
    x: [N, ...], weights: [N]. Returns [...].
    """
    w = weights.astype(x.dtype)
    total = jnp.sum(w)
    p = _bcast(w / jnp.where(total > 0, total, 1.0), x)
    return jnp.sum(p * x, axis=0)


def masked_mean(x, weights, mask, previous):
    """Per-entry masked weighted mean over clients, keeping ``previous`` where no client shares.

        out[e] = sum_i w_i m_i[e] x_i[e] / sum_i w_i m_i[e]   if sum_i w_i m_i[e] > 0
                 previous[e]                                  otherwise

    x: [N, ...]; weights: [N]; mask: bool/0-1, broadcastable to x (per client [N], per leaf scalar, or
    per entry [N, ...]); previous: [...]. Exact for one client, zero weights, and no sharer; never NaN.
    """
    wm = _bcast(weights.astype(x.dtype), x) * jnp.asarray(mask, x.dtype)
    wm = jnp.broadcast_to(wm, x.shape)
    total = jnp.sum(wm, axis=0)
    p = wm / jnp.where(total > 0, total, 1.0)  # normalise first: one sharer returns its entry exactly
    return jnp.where(total > 0, jnp.sum(p * x, axis=0), previous)


def tree_weighted_mean(tree, weights):
    """``weighted_mean`` on every leaf of a stacked pytree."""
    return jax.tree_util.tree_map(lambda x: weighted_mean(x, weights), tree)


def tree_masked_mean(tree, weights, mask_tree, previous_tree):
    """``masked_mean`` leaf by leaf: mask_tree has tree's structure, each leaf a Python bool, a bool array
    broadcastable to the stacked leaf, or per entry. Leaves whose mask is the Python bool False return
    ``previous`` unchanged without computing a reduction.
    """
    def one(x, m, prev):
        if m is False:
            return prev
        if m is True:
            return weighted_mean(x, weights)
        return masked_mean(x, weights, m, prev)
    return jax.tree_util.tree_map(one, tree, mask_tree, previous_tree)


def tree_where(mask_tree, a, b):
    """Leafwise ``where(mask, a, b)``; Python-bool masks select the whole leaf without computing."""
    def one(m, x, y):
        if m is True:
            return x
        if m is False:
            return y
        return jnp.where(m, x, y)
    return jax.tree_util.tree_map(one, mask_tree, a, b)


def broadcast_clients(tree, n: int):
    """Stack ``n`` copies of a pytree along a new leading client axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)
