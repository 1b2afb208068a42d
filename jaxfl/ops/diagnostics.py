"""Metrics and diagnostics as pure functions: calibration, OOD separation, feature sparsity, Fisher score,
mask overlap, and parameter / FLOP counts of masked models.

``weights`` [N] (0 for padded samples) makes every per-sample average an average over real samples.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..core.metrics import weighted_mean_loss
from ..core.trees import flat_leaves, kept_entries


def _weights(n, weights, dtype=jnp.float32):
    return jnp.ones((n,), dtype) if weights is None else jnp.asarray(weights, dtype)


def expected_calibration_error(confidence, correct, n_bins: int = 15, weights=None):
    """ECE = sum_b (n_b / n) |acc_b - conf_b| over ``n_bins`` equal-width bins (lo, hi] of the confidence.

    confidence [N] in [0, 1] (e.g. max softmax prob or max_k alpha_k / S); correct [N] bool/0-1.
    A confidence of exactly 0 falls in the first bin.
    """
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins={n_bins!r} must be an integer >= 1")
    conf = jnp.asarray(confidence, jnp.float32)
    w = _weights(conf.shape[0], weights)
    bins = jnp.clip(jnp.ceil(conf * n_bins).astype(jnp.int32) - 1, 0, n_bins - 1)
    # (n_b / n) |acc_b - conf_b| = |sum of correct in b - sum of confidence in b| / n: bin counts cancel
    acc_b = jax.ops.segment_sum(w * jnp.asarray(correct, jnp.float32), bins, n_bins)
    conf_b = jax.ops.segment_sum(w * conf, bins, n_bins)
    return jnp.sum(jnp.abs(acc_b - conf_b)) / jnp.maximum(jnp.sum(w), 1.0)


def auroc(scores_positive, scores_negative):
    """Area under the ROC curve for separating positives (higher score) from negatives:
    P(s+ > s-) + 0.5 P(s+ = s-) (Mann-Whitney U / (n+ n-), ties counted half).
    Shapes: scores_positive [P], scores_negative [Q] (any shapes, flattened) -> [] float (NaN if either is
    empty).
    """
    pos = jnp.ravel(jnp.asarray(scores_positive, jnp.float32))
    neg = jnp.ravel(jnp.asarray(scores_negative, jnp.float32))
    allv = jnp.sort(jnp.concatenate([pos, neg]))
    lo = jnp.searchsorted(allv, pos, side="left")
    hi = jnp.searchsorted(allv, pos, side="right")
    rank = (lo + hi + 1) / 2.0  # 1-based average rank among all scores
    n_p, n_n = pos.size, neg.size
    # (float products: n+ n- passes 2^31 at 46,341 samples each)
    return (jnp.sum(rank) - float(n_p) * (n_p + 1) / 2.0) / (float(n_p) * float(n_n))


def sparsity_per_sample(z, eps: float = 1e-5):
    """(1/d) #{k : |z_k| / ||z||_2 <= eps} for each row of z [..., d] (an all-zero row gives 1)."""
    norm = jnp.linalg.norm(z, axis=-1, keepdims=True)
    return jnp.mean(jnp.abs(z) / jnp.where(norm > 0, norm, 1.0) <= eps, -1)


def sparsity_ratio(z, eps: float = 1e-5, weights=None):
    """FedPick's feature sparsity: mean over samples of ``sparsity_per_sample``; z [N, d].

    Scale-invariant per sample; a vector with k zeros among d entries gives k/d.
    """
    return weighted_mean_loss(sparsity_per_sample(z, eps), _weights(z.shape[0], weights))


def fisher_score(z, labels, num_classes: int, weights=None, eps: float = 1e-12):
    """Per-feature Fisher score F_k = sum_j m_j (mu_kj - mu_k)^2 / (sum_j m_j sigma_kj^2 + eps).

    m_j: class counts; mu_kj, sigma_kj^2: within-class mean and population variance of feature k;
    mu_k: mean over all samples. z [N, d], labels int [N] -> [d]. 0 where both terms are 0.
    Invariant (up to eps) to per-feature affine maps a z + b with a != 0.
    """
    w = _weights(z.shape[0], weights)
    onehot = jax.nn.one_hot(labels, num_classes, dtype=z.dtype) * w[:, None]  # [N, C]
    m = jnp.sum(onehot, 0)  # [C]
    mu_class = (onehot.T @ z) / jnp.maximum(m, 1.0)[:, None]  # [C, d]
    mu = (w @ z) / jnp.maximum(jnp.sum(w), 1.0)  # [d]
    between = m @ jnp.square(mu_class - mu)  # [d]
    within = jnp.sum(w[:, None] * jnp.square(z - mu_class[labels]), 0)  # [d]
    return between / (within + eps)


def knn_predict(train_z, train_y, test_z, num_classes: int, k: int = 10):
    """k-nearest-neighbour labels (Euclidean): the most frequent label among the k closest training rows
    (ties: the smallest label). train_z [N, d], train_y int [N], test_z [M, d] -> int [M]."""
    d2 = (jnp.sum(jnp.square(test_z), -1)[:, None] - 2.0 * test_z @ train_z.T
          + jnp.sum(jnp.square(train_z), -1)[None, :])  # [M, N] squared distances
    _, nearest = jax.lax.top_k(-d2, k)
    votes = jnp.sum(jax.nn.one_hot(train_y[nearest], num_classes), 1)  # [M, C]
    return jnp.argmax(votes, -1)


def fisher_selection_probe(train_z, train_y, test_z, test_y, num_classes: int, ratios=(0.1, 0.25, 0.5, 0.75, 1.0),
                           k: int = 10):
    """FedPick's vanilla selection probe (section IV, Fig. 1): keep the top fraction r of feature dimensions by
    Fisher score on the training features (threshold at the (1 - r) quantile), zero the rest, and report the
    k-NN (k = 10) test accuracy on the masked features z * m, one per r. Returns [len(ratios)].
    """
    f = fisher_score(train_z, train_y, num_classes)
    accs = []
    for r in ratios:
        keep = (f >= jnp.quantile(f, 1.0 - r)).astype(train_z.dtype)
        pred = knn_predict(train_z * keep, train_y, test_z * keep, num_classes, k)
        accs.append(jnp.mean(pred == test_y))
    return jnp.stack(accs)


def overlap_ratio(a, b):
    """Jaccard overlap |A n B| / |A u B| of two boolean sets (1 for identical, 0 for disjoint; 1 if both empty).
    Shapes: a, b bool [...] of one shape -> [] float.
    """
    a, b = jnp.asarray(a, bool), jnp.asarray(b, bool)
    union = jnp.sum(a | b)
    return jnp.where(union > 0, jnp.sum(a & b) / jnp.maximum(union, 1), 1.0)


def selection_ratio(mask, weights=None):
    """Mean of a per-sample feature mask [N, d] over its entries and real samples (FedPick Fig. 7)."""
    return weighted_mean_loss(jnp.mean(mask, -1), _weights(mask.shape[0], weights))


def layer_positions(model, variables, x, **kwargs):
    """Output positions per sample of every module that owns a ``kernel`` (1 for Dense, H_out*W_out for Conv).

    Returns {kernel path tuple: positions}. Uses ``jax.eval_shape``: nothing is computed.
    """
    def run(v, x):
        _, state = model.apply(v, x, capture_intermediates=True, mutable=["intermediates"], **kwargs)
        return state["intermediates"]
    inter = jax.eval_shape(run, variables, x)
    out = {}
    for keys in flat_leaves(variables["params"]):
        if keys[-1] != "kernel":
            continue
        node = inter
        for k in keys[:-1]:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        call = node.get("__call__") if isinstance(node, dict) else None
        if call:
            shape = call[0].shape
            out[keys] = math.prod(shape[1:-1])
    return out


def masked_flops(params, positions, masks=None):
    """FLOPs per sample of the kernels' multiply-adds: sum_layers 2 * positions * nnz(kernel * mask).

    positions from ``layer_positions``; masks: params' structure (array or bool leaves) or None.
    Biases, norms and activations are not counted.
    Shapes: kernels and masks: pytrees of the same structure -> Python or traced scalar.
    """
    flat, m = flat_leaves(params), ({} if masks is None else flat_leaves(masks))
    return sum(2 * pos * kept_entries(flat[path], m.get(path)) for path, pos in positions.items())
