"""The cohort's updates of the shared parameters as one matrix, for the server-side rules that read or rewrite
them whole (``attacks``, ``compression``): Δ_i = x_i - x over the leaves an algorithm shares, flattened."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def shared_updates(server_params, trained_params, shared) -> tuple[jax.Array, Callable]:
    """(Δ [k, D], rebuild): the trained rows' updates x_i - x of the leaves ``shared`` marks (a tree of Python
    bools or traced bool scalars over ``server_params``; Python False leaves are left out), flattened in leaf
    order; rebuild(v [k, D]) -> ``trained_params`` with each marked leaf replaced by x + v (where a traced mark
    is False, the row's own leaf). server_params: leaves [...]; trained_params: leaves [k, ...]."""
    x, treedef = jax.tree_util.tree_flatten(server_params)
    rows = jax.tree_util.tree_leaves(trained_params)
    marks = jax.tree_util.tree_leaves(shared)
    used = [i for i, s in enumerate(marks) if s is not False]
    k = rows[0].shape[0]
    flat = (jnp.concatenate([(rows[i] - x[i][None]).reshape(k, -1) for i in used], axis=1) if used
            else jnp.zeros((k, 0), jnp.float32))

    def rebuild(v):
        out, start = list(rows), 0
        for i in used:
            size = x[i].size
            new = x[i][None] + v[:, start:start + size].reshape(rows[i].shape).astype(rows[i].dtype)
            out[i] = new if marks[i] is True else jnp.where(marks[i], new, rows[i])
            start += size
        return jax.tree_util.tree_unflatten(treedef, out)

    return flat, rebuild
