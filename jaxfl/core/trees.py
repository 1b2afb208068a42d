"""Path-addressed pytree utilities: leaf paths, per-leaf masks, and the split of a nested dict into the part a
client keeps and the part it takes from the server.

Model variables are nested dicts (Flax); a path is the tuple of dict keys from the root to a leaf.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp


PyTree = Any
PathPredicate = Callable[[tuple[str, ...]], bool]


def _key_name(k):
    return str(getattr(k, "key", getattr(k, "name", k)))


def leaf_paths(tree) -> list[tuple[str, ...]]:
    """Every leaf's path as a tuple of dict keys, in ``tree_leaves`` order."""
    return [tuple(map(_key_name, p)) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def map_with_paths(fn: Callable[[tuple[str, ...], Any], Any], tree):
    """``tree_map`` whose function also gets each leaf's path (tuple of dict keys): fn(path, leaf)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(tuple(map(_key_name, p)), x), tree)


def path_mask(tree, predicate: PathPredicate):
    """A tree of Python bools: predicate(path) for each leaf, path = tuple of dict keys."""
    return map_with_paths(lambda path, _: bool(predicate(path)), tree)


def prune(tree: dict, keep) -> dict:
    """The sub-dict of ``tree`` with only the leaves where ``keep`` (same structure, Python bools) is True;
    dicts left empty are dropped. ``prune(t, keep)`` and ``fill(t, prune(t, keep))`` round-trip to ``t``.

    Example: prune({"a": {"w": 1, "b": 2}, "c": 3}, {"a": {"w": True, "b": False}, "c": False}) == {"a": {"w": 1}}
    """
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = prune(v, keep[k])
            if sub:
                out[k] = sub
        elif keep[k]:
            out[k] = v
    return out


def fill(base: dict, part: dict) -> dict:
    """``base`` with every leaf that ``part`` (a pruned sub-dict of the same nesting) has replaced by it."""
    out = dict(base)
    for k, v in part.items():
        out[k] = fill(base[k], v) if isinstance(v, dict) else v
    return out


def tree_bytes(tree) -> int:
    """Total bytes of the array leaves of a pytree."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree)))


def flat_leaves(tree):
    """{path tuple: leaf}, Python bools treated as leaves."""
    return {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda m: isinstance(m, bool))[0]}


def kept_entries(leaf, mask):
    """Entries of ``leaf`` a mask keeps: all (True / None), none (False), or the nonzeros of a broadcast mask."""
    shape = tuple(getattr(leaf, "shape", ()))  # arrays and jax.ShapeDtypeStruct alike
    if mask is None or mask is True:
        return math.prod(shape)
    if mask is False:
        return 0
    return jnp.sum(jnp.broadcast_to(jnp.asarray(mask) != 0, shape))


def count_params(params, masks=None):
    """Number of parameters: all entries, or with a mask pytree of params' structure (array or Python-bool
    leaves) the entries the masks keep.
    Shapes: params pytree (mask: the same structure) -> Python int.
    """
    m = {} if masks is None else flat_leaves(masks)
    return sum(kept_entries(leaf, m.get(path)) for path, leaf in flat_leaves(params).items())


def tree_all_finite(tree):
    """True iff every floating entry of the pytree is finite; pytree -> [] bool."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
