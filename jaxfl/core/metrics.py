"""What the engine computes on every batch, and the input checks of per-sample functions: per-sample
cross-entropy, the weighted batch mean, correct counts (weights: 1 for real samples, 0 for padding)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_labels(labels, num_classes: int, where: str) -> None:
    """Called outside jit (concrete labels): ValueError unless every label is in [0, num_classes), which would
    otherwise give NaN or a silently wrong gather. Under jit (traced labels) nothing is checked."""
    try:
        arr = np.asarray(labels)
    except jax.errors.TracerArrayConversionError:
        return
    bad = arr[(arr < 0) | (arr >= num_classes)]
    if bad.size:
        raise ValueError(f"{where}: labels must be in [0, {num_classes}) for {num_classes} classes, got {bad.flat[0]}")


def check_positive(value, name: str, where: str) -> None:
    """ValueError if a Python number ``value`` is <= 0 (traced values are not checked)."""
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{where}: {name}={value} must be > 0")


def cross_entropy(logits, labels):
    """Per-sample CE: -log softmax(logits)[y]. logits [B, C], labels int [B] in [0, C) -> [B]."""
    check_labels(labels, logits.shape[-1], "cross_entropy")
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def weighted_mean_loss(per_sample, weights):
    """sum_b w_b l_b / max(sum_b w_b, 1): batch mean over real samples, 0 for an all-padding batch.
    per_sample [B], weights [B] -> []."""
    weights = weights.astype(per_sample.dtype)
    return jnp.sum(weights * per_sample) / jnp.maximum(jnp.sum(weights), 1.0)


def correct_count(logits, labels, weights):
    """Number of real samples whose argmax prediction equals the label: logits [B, C], labels int [B],
    weights [B] (1 real, 0 padding) -> [] (float)."""
    return jnp.sum(weights * (jnp.argmax(logits, -1) == labels))
