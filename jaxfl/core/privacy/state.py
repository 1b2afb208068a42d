"""What an algorithm's state says about privacy, from shapes only (``jax.eval_shape`` of its ``init``): whether
the server averages BatchNorm statistics (data a DP run would release unprotected), whether a model has them,
whether clients keep state between rounds (which decides whether a fixed-size cohort's draw amplifies privacy)."""
from __future__ import annotations

import jax

from ..types import Algorithm


def bn_stats_shared(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg`` has BatchNorm statistics its clients do not keep to themselves (so the server averages
    them, without clipping or noise): its server state's top-level ``batch_stats`` has leaves and its client
    state's has fewer. Shapes only (``jax.eval_shape``)."""
    server, client = jax.eval_shape(alg.init, key, sample_x)
    count = lambda state: (len(jax.tree_util.tree_leaves(state.get("batch_stats", {})))
                           if isinstance(state, dict) else 0)
    return count(server) > count(client)


def has_batch_stats(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg``'s server or client state holds BatchNorm statistics (top-level ``batch_stats`` with
    leaves). Shapes only."""
    server, client = jax.eval_shape(alg.init, key, sample_x)
    return any(isinstance(state, dict) and jax.tree_util.tree_leaves(state.get("batch_stats", {}))
               for state in (server, client))


def clients_keep_state(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg``'s clients keep any state between rounds (their client state has leaves). Shapes only."""
    _, client = jax.eval_shape(alg.init, key, sample_x)
    return bool(jax.tree_util.tree_leaves(client))
