"""Byzantine-robust aggregation over the client axis: reductions of a cohort's stacked updates that a few
malicious rows cannot move far.

Every function takes ``x`` [N, D] (one flattened update per row; ``tree_robust`` applies one to a pytree of
stacked leaves) and ``present`` [N] bool: rows that are not real clients (a padded cohort, an absent client)
are ignored whatever they hold, NaN included. k = sum(present) is the number of real rows (dynamic: the
functions jit once for a cohort size and work under ``vmap``). f is the number of Byzantine rows a rule is
built to tolerate.

kth_smallest        per coordinate, the r-th smallest present value (radix selection: 32 counting passes);
                    kth_largest_near_top the t-th largest for t < a small bound (one pass per rank)
coordinate_median   m_d = median of {x_id : i present}, per coordinate (Yin et al., ICML 2018)
trimmed_mean        per coordinate, the mean of the present values without the b = floor(beta k) largest and
                    b smallest (Yin et al., ICML 2018)
krum_scores         s_i = sum of ||x_i - x_j||^2 over the k - f - 2 present j != i closest to x_i (Blanchard et
                    al., NeurIPS 2017); absent rows score +inf
multi_krum          the mean of the m present rows of smallest Krum score (m = 1: Krum)
bulyan              theta = k - 2f rows chosen one at a time by Krum among those left, then per coordinate the
                    mean of the beta = theta - 2f chosen values closest to their median (El Mhamdi et al., 2018)
geometric_median    argmin_z sum_i w_i ||x_i - z||, by smoothed Weiszfeld iterations (Pillutla et al., RFA, 2022)
norm_bounded_mean   the weighted mean of x_i min(1, M / ||x_i||) (Sun et al., 2019)
centered_clip       v <- v + mean_i clip(x_i - v, tau), L times from v0 (Karimireddy et al., ICML 2021)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _present_values(x, present, fill):
    """x with the absent rows replaced by ``fill`` (their content, NaN included, never reaches the result)."""
    return jnp.where(present[:, None], x, fill)


def _ordered_keys(x):
    """float32 -> uint32 keys whose unsigned order is the floats' order (-inf < ... < -0 < +0 < ... < inf < NaN)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_keys(keys):
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def kth_smallest(x, present, r):
    """Per coordinate, the r-th smallest (0-based) of the present rows' values, by radix selection: 32 passes
    that each count, per coordinate, the values below a candidate, instead of a sort (O(32 N D) comparisons,
    exact). x [N, D] float32, present [N] bool, r int [] or [D] (0 <= r < k) -> [D]."""
    keys = jnp.where(present[:, None], _ordered_keys(x), jnp.uint32(0xFFFFFFFF))  # absent rows: above all
    r = jnp.broadcast_to(jnp.asarray(r, jnp.int32), x.shape[1:])

    def bit(i, found):
        candidate = found | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        below = jnp.sum(keys < candidate, axis=0, dtype=jnp.int32)
        return jnp.where(below <= r, candidate, found)

    return _from_keys(jax.lax.fori_loop(0, 32, bit, jnp.zeros(x.shape[1:], jnp.uint32))).astype(x.dtype)


def kth_largest_near_top(x, present, t, steps: int, smallest: bool = False):
    """Per coordinate, the t-th largest (0-based) of the present rows' values for a rank near the top
    (0 <= t < ``steps``, t dynamic, ``steps`` static): ``steps`` passes that each find the largest value below
    the previous one and count the values at or above it, instead of ``kth_smallest``'s 32 (exact, ties kept
    whole). ``smallest``: the t-th smallest instead (the same passes up from the bottom). x [N, D] float32,
    present [N] bool, t int [] (< the present rows) -> [D]."""
    keys = _ordered_keys(x)
    keys = ~keys if smallest else keys  # (the complement reverses the order exactly)
    keys = jnp.where(present[:, None], keys, jnp.uint32(0))  # absent rows: below all

    def down(i, state):
        prev, found, done = state
        cur = jnp.max(jnp.where((i == 0) | (keys < prev), keys, jnp.uint32(0)), axis=0)
        reached = jnp.sum(present[:, None] & (keys >= cur), axis=0) > t
        return cur, jnp.where(done, found, cur), done | reached

    start = (jnp.zeros(x.shape[1:], jnp.uint32), jnp.zeros(x.shape[1:], jnp.uint32), jnp.zeros(x.shape[1:], bool))
    found = jax.lax.fori_loop(0, steps, down, start)[1]
    return _from_keys(~found if smallest else found).astype(x.dtype)


def coordinate_median(x, present):
    """Per coordinate, the median of the present rows' values (the mean of the two middle ones for even k).
    x [N, D], present [N] bool -> [D]. The lower middle value by radix selection (``kth_smallest``); the upper
    one is the same value unless fewer than k/2 + 1 values are at or below it, then the next value above it."""
    k = jnp.sum(present)
    lo = kth_smallest(x, present, (k - 1) // 2)
    keys, lo_key = _ordered_keys(x), _ordered_keys(lo)
    at_or_below = jnp.sum(present[:, None] & (keys <= lo_key), axis=0)
    above = jnp.min(jnp.where(present[:, None] & (keys > lo_key), keys, jnp.uint32(0xFFFFFFFF)), axis=0)
    hi = jnp.where((k % 2 == 1) | (at_or_below > k // 2), lo, _from_keys(above).astype(x.dtype))
    return 0.5 * (lo + hi)


def trimmed_mean(x, present, beta: float):
    """Per coordinate, the mean of the present values after dropping the b = floor(beta k) largest and the b
    smallest (0 <= beta < 1/2). x [N, D], present [N] bool -> [D].

    Computed from the two cut values L (rank b) and H (rank k - b - 1): the values strictly between them, plus
    as many copies of L and of H as the kept ranks [b, k - b) hold. The cuts are b from either end: found by
    floor(beta N) + 2 passes in from that end (``kth_largest_near_top``) while that is at most 16, else by
    radix selection (``kth_smallest``, 32 passes)."""
    k = jnp.sum(present)
    b = jnp.floor(beta * k).astype(k.dtype)
    bound = int(beta * x.shape[0]) + 2  # b < bound for any k <= N (static; one spare for float32 rounding)
    if bound <= 16:
        low = kth_largest_near_top(x, present, b, bound, smallest=True)
        high = jnp.maximum(kth_largest_near_top(x, present, b, bound), low)  # (k < 2b + 1 keeps one value: L)
    else:
        low, high = kth_smallest(x, present, b), kth_smallest(x, present, jnp.maximum(k - b - 1, b))
    z = _present_values(x, present, 0.0)
    p = present[:, None]

    def kept_copies(v):  # how many of the ranks v occupies, [#(x < v), #(x <= v)), lie in [b, k - b)
        first = jnp.sum(p & (z < v), axis=0)
        last = jnp.sum(p & (z <= v), axis=0)
        return jnp.maximum(jnp.minimum(last, k - b) - jnp.maximum(first, b), 0).astype(x.dtype)

    middle = jnp.sum(jnp.where(p & (z > low) & (z < high), z, 0.0), axis=0)
    total = middle + kept_copies(low) * low + jnp.where(high > low, kept_copies(high) * high, 0.0)
    return total / jnp.maximum(k - 2 * b, 1).astype(x.dtype)


def pairwise_sq_distances(x, present):
    """||x_i - x_j||^2 for present i != j, +inf for i == j or an absent row. x [N, D] -> [N, N]."""
    z = _present_values(x, present, 0.0)
    sq = jnp.sum(z * z, axis=1)
    d = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * z @ z.T, 0.0)
    valid = present[:, None] & present[None, :] & ~jnp.eye(x.shape[0], dtype=bool)
    return jnp.where(valid, d, jnp.inf)


def krum_scores(x, present, f: int):
    """s_i = sum of the k - f - 2 smallest ||x_i - x_j||^2 over present j != i (at least one neighbour);
    +inf for absent rows. x [N, D], present [N] bool -> [N]."""
    return krum_scores_from_distances(pairwise_sq_distances(x, present), present, f)


def krum_scores_from_distances(d, present, f: int):
    """``krum_scores`` from the squared distances d [N, N] (``pairwise_sq_distances``; only the entries between
    present rows are read): the rows of ``present`` alone count as neighbours. -> [N]."""
    k = jnp.sum(present)
    q = jnp.maximum(k - f - 2, 1)
    d = jnp.where(present[:, None] & present[None, :] & ~jnp.eye(d.shape[0], dtype=bool), d, jnp.inf)
    # the sum of each row's q smallest: those below its q-th smallest t, plus t for the rest (ties). Among the
    # k entries of a present row (k - 1 neighbours and its own +inf) t is the (k - q)-th largest, k - q <= f + 2:
    # found in f + 3 passes down from the top (``kth_largest_near_top``) rather than a sort or a radix selection
    t = kth_largest_near_top(d.T, present, k - q, f + 3)
    below = d < t[:, None]
    rest = (q - jnp.sum(below, axis=1)).astype(d.dtype)
    scores = jnp.sum(jnp.where(below, d, 0.0), axis=1) + jnp.where(rest > 0, rest * t, 0.0)
    return jnp.where(present, scores, jnp.inf)


def multi_krum(x, present, f: int, m: int = 1):
    """The mean of the min(m, k) present rows with the smallest Krum scores (ties by index); m = 1 is Krum.
    x [N, D], present [N] bool -> ([D], selected [N] bool)."""
    scores = krum_scores(x, present, f)
    rank = jnp.argsort(jnp.argsort(scores, stable=True), stable=True)
    selected = present & (rank < m)
    w = selected.astype(x.dtype)
    return jnp.sum(w[:, None] * _present_values(x, present, 0.0), axis=0) / jnp.maximum(jnp.sum(w), 1.0), selected


def bulyan(x, present, f: int):
    """Bulyan over the present rows: theta = max(k - 2f, 1) rows selected one after another, each the Krum
    choice (``krum_scores`` with f, ties by index) among the rows not yet selected; then per coordinate the mean
    of the beta = max(theta - 2f, 1) selected values closest to the selected values' median (ties by row).
    The paper asks for k >= 4f + 3. x [N, D], present [N] bool -> ([D], selected [N] bool)."""
    k = jnp.sum(present)
    theta = jnp.maximum(k - 2 * f, 1)
    d = pairwise_sq_distances(x, present)  # once: each selection reads the rows still left

    def pick(i, selected):
        left = present & ~selected
        # (a last row left has no neighbour: its score is inf, still below the rows not left)
        scores = krum_scores_from_distances(d, left, f)
        scores = jnp.where(left, jnp.minimum(scores, jnp.finfo(x.dtype).max), jnp.inf)
        return jnp.where(i < theta, selected.at[jnp.argmin(scores)].set(True), selected)

    selected = jax.lax.fori_loop(0, x.shape[0], pick, jnp.zeros(x.shape[0], bool))
    beta = jnp.maximum(theta - 2 * f, 1)
    med = coordinate_median(x, selected)
    z = _present_values(x, selected, 0.0)
    dist = jnp.abs(z - med)
    # the beta closest per coordinate: below the beta-th distance, then ties at it by row; that distance is the
    # (theta - beta)-th largest (0-based), at most 2f from the top: 2f + 1 passes down from the largest
    cut = kth_largest_near_top(dist, selected, theta - beta, 2 * f + 1)
    sel = selected[:, None]
    below = sel & (dist < cut)
    tied = sel & (dist == cut)
    keep = below | (tied & (jnp.cumsum(tied, axis=0) <= beta - jnp.sum(below, axis=0)))
    return jnp.sum(jnp.where(keep, z, 0.0), axis=0) / beta.astype(x.dtype), selected


def geometric_median(x, present, weights=None, iters: int = 8, nu: float = 1e-6):
    """argmin_z sum_i w_i ||x_i - z|| over the present rows, by smoothed Weiszfeld iterations from the weighted
    mean: z <- sum_i b_i x_i / sum_i b_i, b_i = w_i / max(nu, ||x_i - z||). x [N, D], present [N] bool,
    weights [N] (default 1) -> [D]."""
    w = jnp.where(present, 1.0 if weights is None else weights, 0.0).astype(x.dtype)
    z0 = _present_values(x, present, 0.0)
    mean = jnp.sum(w[:, None] * z0, axis=0) / jnp.maximum(jnp.sum(w), 1e-12)

    def step(z, _):
        b = w / jnp.maximum(jnp.linalg.norm(z0 - z, axis=1), nu)
        return jnp.sum(b[:, None] * z0, axis=0) / jnp.maximum(jnp.sum(b), 1e-12), None
    return jax.lax.scan(step, mean, None, length=iters)[0]


def norm_bounded_mean(x, present, bound: float, weights=None):
    """sum_i w_i x_i min(1, bound / ||x_i||) / sum_i w_i over the present rows. x [N, D] -> [D]."""
    w = jnp.where(present, 1.0 if weights is None else weights, 0.0).astype(x.dtype)
    z = _present_values(x, present, 0.0)
    scale = jnp.minimum(1.0, bound / jnp.maximum(jnp.linalg.norm(z, axis=1), 1e-12))
    return jnp.sum((w * scale)[:, None] * z, axis=0) / jnp.maximum(jnp.sum(w), 1e-12)


def centered_clip(x, present, tau: float, iters: int = 1, v0=None):
    """v <- v + (1/k) sum_i (x_i - v) min(1, tau / ||x_i - v||) over the present rows, ``iters`` times from
    ``v0`` (default 0: the previous round's aggregate, when kept, is the paper's choice). x [N, D] -> [D]."""
    z = _present_values(x, present, 0.0)
    w = present.astype(x.dtype)
    v = jnp.zeros(x.shape[1], x.dtype) if v0 is None else v0

    def step(v, _):
        d = z - v
        scale = jnp.minimum(1.0, tau / jnp.maximum(jnp.linalg.norm(d, axis=1), 1e-12))
        return v + jnp.sum((w * scale)[:, None] * d, axis=0) / jnp.maximum(jnp.sum(w), 1.0), None
    return jax.lax.scan(step, v, None, length=iters)[0]


def tree_robust(rule, tree, present, *args, **kwargs):
    """``rule`` (one of the functions above, returning [D] or ([D], extra)) applied to a pytree of stacked
    leaves [N, ...] as one flattened update per row; -> a tree shaped like one row (and the extra, if any)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    n = leaves[0].shape[0]
    flat = jnp.concatenate([leaf.reshape(n, -1) for leaf in leaves], axis=1)
    out = rule(flat, present, *args, **kwargs)
    vec, extra = (out if isinstance(out, tuple) else (out, None))
    parts, start = [], 0
    for leaf in leaves:
        size = leaf[0].size
        parts.append(vec[start:start + size].reshape(leaf.shape[1:]).astype(leaf.dtype))
        start += size
    result = jax.tree_util.tree_unflatten(treedef, parts)
    return result if extra is None else (result, extra)
