"""Per-sample losses and metrics with sample weights (0 for padded samples)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, labels):
    """Per-sample CE: -log softmax(logits)[y]. logits [B, C], labels int [B] -> [B]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def weighted_mean_loss(per_sample, weights):
    """sum_b w_b l_b / max(sum_b w_b, 1): batch mean over real samples, 0 for an all-padding batch."""
    weights = weights.astype(per_sample.dtype)
    return jnp.sum(weights * per_sample) / jnp.maximum(jnp.sum(weights), 1.0)


def correct_count(logits, labels, weights):
    """Number of real samples whose argmax prediction equals the label."""
    return jnp.sum(weights * (jnp.argmax(logits, -1) == labels))
