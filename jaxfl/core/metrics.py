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


def client_spread(values) -> dict:
    """How a per-client metric spreads over the clients (NaN: a client without a value, left out): the mean,
    the population std, the 10th / 50th / 90th percentiles (linear interpolation) and the mean of the worst
    10% (the ceil(0.1 n) smallest values). values [n] -> {name: float}; all NaN when no client has a value."""
    v = np.asarray([np.nan if x is None else x for x in values], np.float64)
    v = np.sort(v[np.isfinite(v)])
    if not len(v):
        return {k: float("nan") for k in ("mean", "std", "p10", "p50", "p90", "worst10_mean")}
    p10, p50, p90 = np.percentile(v, [10, 50, 90])
    return {"mean": float(v.mean()), "std": float(v.std()), "p10": float(p10), "p50": float(p50),
            "p90": float(p90), "worst10_mean": float(v[:max(1, int(np.ceil(0.1 * len(v))))].mean())}
