"""Masks as pure functions of arrays: relaxed Bernoulli masks (FedPick), mask growth (FedSelect),
structured channel masks (DapperFL), and counting helpers.

All functions work on one client; vmap them over the client axis. Ratios and rates may be traced
(per-client values under vmap); shapes are static.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core.metrics import check_positive
from ..core.trees import count_params


# --------------------------------------------------------------------------------------------------
# Relaxed Bernoulli masks: Gumbel-sigmoid + straight-through estimator
# --------------------------------------------------------------------------------------------------

def logistic_noise(key, shape, dtype=jnp.float32):
    """L = log U - log(1 - U), U ~ U(0, 1): one Logistic(0, 1) sample per entry.

    Equal in distribution to G1 - G2 for two independent standard Gumbels (mean 0, variance pi^2/3).
    U is drawn from [tiny, 1), so L is always finite.
    """
    u = jax.random.uniform(key, shape, dtype, minval=jnp.finfo(dtype).tiny, maxval=1.0)
    return jnp.log(u) - jnp.log1p(-u)


def gumbel_sigmoid(logits, key=None, tau=1.0):
    """Soft relaxed-Bernoulli sample m_s = sigmoid((z + L) / tau).

    L ~ Logistic(0, 1) (``logistic_noise``) when ``key`` is given (training); L = 0 when key is None
    (evaluation, deterministic). logits: any shape; returns the same shape in (0, 1). tau > 0.
    """
    check_positive(tau, "tau", "gumbel_sigmoid")
    logits = jnp.asarray(logits, jnp.result_type(logits, jnp.float32))  # integer logits: a float mask
    noise = 0.0 if key is None else logistic_noise(key, jnp.shape(logits), logits.dtype)
    return jax.nn.sigmoid((logits + noise) / tau)


def hard_threshold(soft, threshold=0.5):
    """m_hard = 1[m_s >= threshold] as a float array of 0s and 1s (no gradient)."""
    return (soft >= threshold).astype(jnp.result_type(soft))


def straight_through(hard, soft):
    """m = hard + (soft - stop_gradient(soft)): forward value exactly ``hard``, gradient that of ``soft``.
    Shapes: hard, soft of one shape -> that shape.
    """
    return hard + (soft - jax.lax.stop_gradient(soft))


def relaxed_mask(logits, key=None, tau=1.0, hard=True, threshold=0.5):
    """FedPick's mask: m_s = gumbel_sigmoid(z, key, tau); hard: m = ST(1[m_s >= threshold], m_s), else m_s.

    Forward values of the hard mask are exactly 0/1 and dm/dz = m_s (1 - m_s) / tau. With noise,
    P(m = 1) = P(z + L >= 0) = sigmoid(z), for every tau. Without noise m = 1[z >= 0].
    """
    soft = gumbel_sigmoid(logits, key, tau)
    return straight_through(hard_threshold(soft, threshold), soft) if hard else soft


def split_features(z, mask):
    """(z_p, z_u) = (z * m, z * (1 - m)): relevant and irrelevant parts, z_p + z_u = z.
    Shapes: z [B, d], m [B, d] (or broadcastable) -> (z_p [B, d], z_u [B, d]).
    """
    return z * mask, z * (1.0 - mask)


# --------------------------------------------------------------------------------------------------
# Top-k and growth (FedSelect)
# --------------------------------------------------------------------------------------------------

def descending_rank(scores):
    """rank[e] = position of entry e when the flattened scores are sorted descending (ties: lower index first)."""
    flat = jnp.ravel(scores)
    order = jnp.argsort(-flat, stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(flat.size, dtype=order.dtype)).reshape(jnp.shape(scores))


def topk_mask(scores, k):
    """Boolean mask of the k largest entries of ``scores`` (ties: lower flat index first); k may be traced.
    Shapes: scores [...] , k [] int -> bool mask of scores' shape.
    """
    return descending_rank(scores) < k


def kth_smallest_nonneg(values, valid, k):
    """The k-th smallest (0-based) of the non-negative ``values`` where ``valid`` is True, without a sort.

    Non-negative float32s order like their uint32 bit patterns, so the answer is the smallest pattern t with
    #{valid e : bits(v_e) <= t} >= k + 1, found by a 32-step bisection over [0, 2^32): 32 counting passes
    over the entries instead of an O(n log n) sort (about 10x faster on CPU for a ResNet-18's tensors).
    Equals ``jnp.sort(values[valid])[k]`` for 0 <= k < #valid. values, valid: same shape; k may be traced.
    """
    bits = jax.lax.bitcast_convert_type(jnp.ravel(values).astype(jnp.float32), jnp.uint32)
    valid = jnp.ravel(valid)
    target = jnp.asarray(k, jnp.int32) + 1

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(valid & (bits <= mid), dtype=jnp.int32) >= target
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)
    lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.uint32(0), jnp.uint32(0xFFFFFFFF)))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def grow_mask(mask, delta, rate, limit):
    """FedSelect GradSelect on one leaf: promote the largest-|delta| global entries to personal.

    n_p = #personal, n_g = n - n_p. If limit > 0, n_p / n <= limit and n_g > 0, then with
    idx = round((1 - rate) n_g) (half to even) and cut = the idx-th smallest |delta| among global entries,
    every global entry with |delta| >= cut becomes personal (about rate * n_g of them; ties at the cut all
    join). idx == n_g selects nothing; limit == 0 never grows (so FedSelect with limit 0 is FedAvg).
    Personal entries never revert. mask: bool [...]; delta: [...] (e.g. W_now - W_ref). Returns bool [...].
    The cut comes from ``kth_smallest_nonneg`` (bisection), not a sort.
    """
    m = jnp.ravel(mask).astype(bool)
    d = jnp.abs(jnp.ravel(delta))
    n = m.size
    n_p = jnp.sum(m)
    n_g = n - n_p
    grow = (limit > 0) & (n_p <= limit * n) & (n_g > 0)
    idx = jnp.round((1.0 - rate) * n_g).astype(jnp.int32)
    cut = kth_smallest_nonneg(d, ~m, jnp.clip(idx, 0, jnp.maximum(n_g - 1, 0)))
    new = m | (grow & (idx < n_g) & ~m & (d >= cut))
    return new.reshape(jnp.shape(mask))


def tree_grow_mask(masks, params, reference, rate, limit, eligible=None):
    """``grow_mask`` on every leaf with delta = params - reference; leaves whose ``eligible`` flag (a pytree
    of Python bools, default all True) is False keep their mask.
    Shapes: masks, params, reference: pytrees of one structure (bool, float, float leaves) -> masks' structure.
    """
    eligible = eligible if eligible is not None else jax.tree_util.tree_map(lambda _: True, masks)
    return jax.tree_util.tree_map(
        lambda m, p, r, e: grow_mask(m, p - r, rate, limit) if e else m, masks, params, reference, eligible)


# --------------------------------------------------------------------------------------------------
# Structured and unstructured pruning masks (DapperFL)
# --------------------------------------------------------------------------------------------------

def num_pruned(ratio, n):
    """round(ratio * n), half to even (Python's and torch.prune's rounding).
    Shapes: ratio [] in [0, 1], n int -> [] int32.
    """
    return jnp.round(ratio * n).astype(jnp.int32)


def channel_scores(kernel, axis, ord=1):
    """Norm of every slice along ``axis``: L1 (ord=1) sum |K| or L2 (ord=2) sqrt(sum K^2) over the other axes.
    Shapes: kernel [..., C_in, C_out] -> [kernel.shape[axis]].
    """
    axis = axis % kernel.ndim
    others = tuple(a for a in range(kernel.ndim) if a != axis)
    if ord == 1:
        return jnp.sum(jnp.abs(kernel), axis=others)
    if ord == 2:
        return jnp.sqrt(jnp.sum(jnp.square(kernel), axis=others))
    raise ValueError(f"ord must be 1 or 2, got {ord!r}")


def keep_largest(scores, ratio):
    """Bool mask over a 1-D (or any) score array keeping the n - round(ratio n) largest (ties: lower index kept).
    Shapes: scores [n] (or any shape), ratio [] in [0, 1] -> bool mask of scores' shape.
    """
    return topk_mask(scores, jnp.size(scores) - num_pruned(ratio, jnp.size(scores)))


def channel_mask(kernel, ratio, axis=-1, ord=1):
    """Structured mask of ``kernel``'s shape: prune the round(ratio n) channels along ``axis`` with the smallest
    L1/L2 norm (over all other axes); 0/1 float, constant along every other axis. ratio = 0 keeps everything."""
    axis = axis % kernel.ndim
    keep = keep_largest(channel_scores(kernel, axis, ord), ratio).astype(kernel.dtype)
    shape = [1] * kernel.ndim
    shape[axis] = kernel.shape[axis]
    return jnp.broadcast_to(keep.reshape(shape), kernel.shape)


def in_out_channel_mask(kernel, ratio, ord=1):
    """DapperFL mask for an inner conv / dense kernel [..., in, out]: input-channel mask m_in times
    output-channel mask m_out, both at ``ratio``, applied in the released code's order: m_in scored on the
    kernel, m_out scored on the input-masked kernel K * m_in (torch's ``prune.ln_structured`` on dim 1, then
    on dim 0, scores the already-masked weight). Density ~ (1 - ratio)^2."""
    m_in = channel_mask(kernel, ratio, axis=-2, ord=ord)
    return m_in * channel_mask(kernel * m_in, ratio, axis=-1, ord=ord)


def magnitude_mask(x, ratio):
    """Unstructured mask: zero the round(ratio n) entries of smallest |x|; among equal |x| the lower index is
    kept (the higher one pruned first), as in ``keep_largest``. torch's ``prune.l1_unstructured`` (DapperFL's
    BN pruning) breaks such ties in ``topk``'s implementation-defined order, and they are common there: BN
    scales sit at 1.0 +- a few float32 ulps after an epoch (``experiments/official/dapperfl.md``).
    Shapes: x [...], ratio [] in [0, 1] -> 0/1 float mask of x's shape.
    """
    return keep_largest(jnp.abs(x), ratio).reshape(jnp.shape(x)).astype(jnp.result_type(x))


# --------------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------------

def tree_count(mask_tree):
    """Total number of nonzero (True) entries over all leaves (a traced scalar).
    Shapes: mask pytree -> [] int.
    """
    leaves = jax.tree_util.tree_leaves(mask_tree)
    return sum(jnp.sum(jnp.asarray(m) != 0) for m in leaves) if leaves else jnp.array(0)


def tree_size(tree):
    """Total number of entries over all leaves (a Python int): ``metrics.count_params`` without masks.
    Shapes: pytree -> Python int.
    """
    return count_params(tree)


def tree_density(mask_tree):
    """Fraction of nonzero entries over all leaves: tree_count / tree_size.
    Shapes: mask pytree -> [] float in [0, 1].
    """
    return tree_count(mask_tree) / max(tree_size(mask_tree), 1)


def leaf_density(mask_tree):
    """Per-leaf fraction of nonzero entries (same structure as the mask tree).
    Shapes: mask pytree -> the same structure with [] float leaves.
    """
    return jax.tree_util.tree_map(lambda m: jnp.mean(jnp.asarray(m) != 0), mask_tree)
