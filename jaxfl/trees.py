"""Path-addressed pytree utilities: leaf paths, per-leaf masks, and the split of a nested dict into the part a
client keeps and the part it takes from the server.

Model variables are nested dicts (Flax); a path is the tuple of dict keys from the root to a leaf.
"""
from __future__ import annotations

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


def tree_vdot(a, b):
    """<a, b> over a whole pytree: sum over leaves of sum(a * b). a, b: same structure -> []."""
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def tree_sq_distance(a, b):
    """||a - b||^2 over a whole pytree: sum over leaves of sum((a - b)^2). a, b: same structure -> []."""
    sq = jax.tree_util.tree_map(lambda x, y: jnp.sum(jnp.square(x - y)), a, b)
    return sum(jax.tree_util.tree_leaves(sq))


def tree_zeros(tree):
    """Zeros shaped like every leaf of ``tree``."""
    return jax.tree_util.tree_map(jnp.zeros_like, tree)
