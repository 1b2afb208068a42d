"""What the engine computes on every batch, and the input checks of per-sample functions: per-sample
cross-entropy, the weighted batch mean, correct counts (weights: 1 for real samples, 0 for padding). Labels are
class ids [B], multi-hot [B, C] for a multi-label task (``multilabel``: binary cross-entropy and recall@5), or
float targets in [0, 1] [B, D] for a reconstruction task (``reconstruction``: squared error of sigmoid outputs,
scored by 1 - MSE)."""
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


def multilabel(logits, labels) -> bool:
    """Whether ``labels`` are multi-hot (one 0/1 integer entry per class, [B, C]: a multi-label task) rather than
    class ids [B]; decided by their rank and dtype, so statically under jit."""
    return jnp.ndim(labels) == jnp.ndim(logits) and not jnp.issubdtype(jnp.result_type(labels), jnp.floating)


def reconstruction(logits, labels) -> bool:
    """Whether ``labels`` are float targets [B, D], one per output (a reconstruction task, e.g. an autoencoder's
    inputs), rather than class ids or multi-hot rows; decided by rank and dtype, statically under jit."""
    return jnp.ndim(labels) == jnp.ndim(logits) and jnp.issubdtype(jnp.result_type(labels), jnp.floating)


def squared_error(logits, targets):
    """Per-sample mean squared error of sigmoid outputs: (1/D) sum_d (sigmoid(z_d) - t_d)^2, logits and targets
    [..., B, D] -> [..., B] (Keras' MeanSquaredError of a sigmoid output layer, as FedOpt's EMNIST autoencoder)."""
    return jnp.mean(jnp.square(jax.nn.sigmoid(logits) - targets.astype(logits.dtype)), axis=-1)


def cross_entropy(logits, labels):
    """Per-sample cross-entropy, logits [..., B, C] -> [..., B] (leading axes: e.g. the clients of a stacked
    evaluation). Class ids, labels int [..., B] in [0, C): -log softmax(z)[y].
    Multi-hot labels [..., B, C] (a multi-label task, ``multilabel``): the binary cross-entropy of each class's
    sigmoid, averaged over the C classes, (1/C) sum_c [softplus(z_c) - y_c z_c] (Keras' BinaryCrossentropy of
    sigmoid outputs, computed from the logits). Float targets [..., B, D] (a reconstruction task,
    ``reconstruction``): the loss is their ``squared_error`` instead (the name says what a class task computes)."""
    if reconstruction(logits, labels):
        return squared_error(logits, labels)
    if multilabel(logits, labels):
        y = labels.astype(logits.dtype)
        return jnp.mean(jax.nn.softplus(logits) - y * logits, axis=-1)
    check_labels(labels, logits.shape[-1], "cross_entropy")
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


RECALL_AT = 5  # the multi-label score: recall among the top 5 classes (FedOpt's Stack Overflow tag prediction)


def recall_at_k(logits, labels, k: int = RECALL_AT):
    """Per-sample recall@k of multi-hot labels: |top-k classes of logits ∩ true classes| / |true classes|, 0 for a
    sample without a true class. logits [B, C], labels 0/1 [B, C] -> [B] in [0, 1]; k is capped at C."""
    k = min(k, logits.shape[-1])
    top = jax.lax.top_k(logits, k)[1]  # [B, k]
    hits = jnp.take_along_axis(labels, top, axis=-1).astype(jnp.float32).sum(-1)
    true = labels.astype(jnp.float32).sum(-1)
    return jnp.where(true > 0, hits / jnp.maximum(true, 1.0), 0.0)


def weighted_mean_loss(per_sample, weights):
    """sum_b w_b l_b / max(sum_b w_b, 1): batch mean over real samples, 0 for an all-padding batch.
    per_sample [B], weights [B] -> []."""
    weights = weights.astype(per_sample.dtype)
    return jnp.sum(weights * per_sample) / jnp.maximum(jnp.sum(weights), 1.0)


def correct_count(logits, labels, weights):
    """Number of real samples whose argmax prediction equals the label: logits [B, C], labels int [B],
    weights [B] (1 real, 0 padding) -> [] (float). Multi-hot labels [B, C]: the sum of the real samples'
    ``recall_at_k`` (so the engine's "accuracy", this over the sample count, is the sample-averaged recall@5).
    Float targets [B, D]: the sum of the real samples' 1 - ``squared_error`` (the "accuracy" is 1 - MSE)."""
    if reconstruction(logits, labels):
        return jnp.sum(weights * (1.0 - squared_error(logits, labels)))
    if multilabel(logits, labels):
        return jnp.sum(weights * recall_at_k(logits, labels))
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
