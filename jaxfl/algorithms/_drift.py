"""Drift correction shared by SCAFFOLD, FedDyn and FedDC: sums over the cohort scaled by 1/N and SCAFFOLD's
option-II control variate (FedDC uses it too). The client learning rate a correction divides by is
``_common.client_lr``."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core.aggregation import member_weights, tree_weighted_mean


def cohort_sum_over_n(tree, weights, num_clients: int | None):
    """1/N sum_{i in S} tree_i (= |S|/N times the cohort mean); N: ``num_clients`` or, if None, the cohort size
    (its rows of positive weight: a padded cohort's other rows are no clients)."""
    k = weights.shape[0]
    if num_clients is None:
        return tree_weighted_mean(tree, member_weights(weights).astype(jnp.float32))
    mean = tree_weighted_mean(tree, jnp.ones((k,), jnp.float32))  # (padding rows are zeros: they add nothing)
    scale = k / num_clients
    return mean if scale == 1.0 else jax.tree_util.tree_map(lambda m: m * scale, mean)


def control_variate(c_i, c, x, y, steps, lr: float):
    """SCAFFOLD option II: c_i+ = c_i - c + (x - y) / (K lr), K = ``steps``."""
    k_lr = jnp.maximum(steps, 1.0) * lr
    return jax.tree_util.tree_map(lambda ci, cg, xx, yy: ci - cg + (xx - yy) / k_lr, c_i, c, x, y)
