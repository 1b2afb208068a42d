"""Scheduling a cohort by size: which clients train together, padded to what length (pure numpy, host side).

Under ``vmap`` a group of clients runs until its longest client is done, so clients of similar step counts
should share a group. Each bucket is one compiled call of shape (lanes, length). ``bucket_grid`` fixes a
run's shapes up front (``BucketGrid``: at most 8 classes of (length, lanes) from the population's step counts;
the ragged backend's plan); ``plan_buckets`` plans each cohort's buckets greedily, from shapes that come from
small fixed sets:

- length (in steps): the grid {1, 2, 3, 4, 6, 8, 12, 16, 24, ...} = {2^k} u {3 * 2^k}, rounded up;
- lanes (clients per call): powers of two times ``lane_multiple`` (the device count), capped at
  ``max_lanes``; lanes past the cohort's clients are empty (id -1, zero samples).

Padding the data to the grid length costs memory only: a client's step loop stops at its own count.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def grid_ceil(n: int) -> int:
    """The smallest value of {1, 2, 3, 4, 6, 8, 12, 16, 24, ...} that is >= n (1 for n <= 1)."""
    n = max(int(n), 1)
    p = 1 << (n - 1).bit_length()  # the power of two >= n
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


def grid_ceil_array(n) -> np.ndarray:
    """``grid_ceil`` of each element of an int array."""
    n = np.maximum(np.asarray(n, np.int64), 1)
    p = np.left_shift(1, np.ceil(np.log2(n)).astype(np.int64))  # the power of two >= n (exact for n < 2^52)
    p = np.where(p < n, p * 2, p)
    three = 3 * p // 4
    return np.where((p >= 4) & (three >= n), three, p)


def cohort_samples_bound(counts, *, cohort: int | None = None, rate: float | None = None,
                         sigmas: float = 4.0) -> int:
    """An up-front bound on the samples of one round's cohort: their sum's mean plus ``sigmas`` standard
    deviations, capped at the largest sum a cohort can have (at least 1).

    ``counts`` [N]: every client's samples. Fixed cohorts (``cohort`` = C clients drawn without replacement):
    mean C mu, variance C s^2 (N - C) / (N - 1) (mu, s^2: the counts' mean and population variance), cap the
    C largest counts' sum. Poisson cohorts (``rate`` = q, each client on its own): mean q sum(c), variance
    q (1 - q) sum(c^2), cap sum(c). Sized once, a round's inputs keep one shape in almost every round.
    """
    c = np.asarray(counts, np.float64)
    n = len(c)
    if (cohort is None) == (rate is None):
        raise ValueError("give exactly one of cohort (fixed cohorts) and rate (Poisson cohorts)")
    if rate is None:
        k = min(int(cohort or 0), n)
        mean = k * c.mean() if n else 0.0
        var = k * c.var() * (n - k) / (n - 1) if n > 1 else 0.0
        cap = float(np.sort(c)[n - k:].sum())
    else:
        q = float(rate)
        mean, var, cap = q * c.sum(), q * (1 - q) * np.square(c).sum(), float(c.sum())
    return max(int(math.ceil(min(mean + sigmas * math.sqrt(var), cap))), 1)


def lane_sizes(max_lanes: int, lane_multiple: int = 1) -> list[int]:
    """Allowed clients per call: lane_multiple * 2^k below max_lanes, then max_lanes rounded up to a multiple."""
    cap = -(-max(max_lanes, 1) // lane_multiple) * lane_multiple
    sizes, k = [], lane_multiple
    while k < cap:
        sizes.append(k)
        k *= 2
    return sizes + [cap]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One compiled call: ``positions`` [lanes] index the cohort (-1: an empty lane); ``steps`` the padded
    length in local steps per epoch (data is padded to steps * batch_size samples)."""
    positions: np.ndarray
    steps: int

    @property
    def lanes(self) -> int:
        return len(self.positions)


def plan_buckets(steps, *, max_lanes: int, lane_multiple: int = 1, single: bool = False) -> list[Bucket]:
    """Split a cohort with per-client step counts ``steps`` [C] into buckets, longest clients first.

    Greedy: the longest remaining client fixes the bucket's grid length g; the bucket takes the remaining
    clients whose grid length is g, rounded up to an allowed lane count by the next-longest clients (which are
    padded up to g) and, at the end of the cohort, by empty lanes. ``single``: one bucket of the whole cohort
    (``map``, where every client runs its own step count anyway).
    """
    steps = np.asarray(steps, np.int64)
    order = np.argsort(-steps, kind="stable")
    sizes = lane_sizes(max_lanes, lane_multiple)
    if single:
        return [Bucket(_pad(order, -(-len(steps) // lane_multiple) * lane_multiple), grid_ceil(steps.max(initial=1)))]
    grid = grid_ceil_array(steps[order])
    buckets, i = [], 0
    while i < len(order):
        same = int(np.sum(grid[i:] == grid[i]))
        lanes = next((s for s in sizes if s >= same), sizes[-1])
        take = order[i:i + lanes]
        buckets.append(Bucket(_pad(take, lanes), int(grid[i])))
        i += len(take)
    return buckets


def _pad(positions, lanes):
    return np.concatenate([positions, np.full(lanes - len(positions), -1, np.int64)]).astype(np.int64)


def last_batch_sizes(counts, batch_size: int, tail_sizes: tuple[int, ...]) -> np.ndarray:
    """[N]: the size each client's last batch is computed at, the smallest of ``tail_sizes`` (ascending, B last:
    ``LocalTrainer.tail_sizes``) that holds its n - (ceil(n / B) - 1) B real samples; 0 for a client of none."""
    counts = np.asarray(counts, np.int64)
    steps = -(-counts // batch_size)
    sizes = np.asarray(tail_sizes, np.int64)
    last = counts - (steps - 1) * batch_size  # the last batch's real samples (1..B; 0 steps: none)
    return np.where(steps > 0, sizes[np.minimum(np.searchsorted(sizes, last), len(sizes) - 1)], 0)


def padded_work(buckets: list[Bucket], counts, batch_size: int, *, per_client_trips: bool,
                tail_sizes: tuple[int, ...] = ()) -> tuple[int, int]:
    """(computed samples, real samples) of one epoch of a plan; their ratio is the padding overhead.

    A step computes a whole batch, so a client of n samples costs ceil(n / B) * B under ``lax.map``
    (``per_client_trips``: every client runs exactly its own steps), or with ``tail_sizes`` (ascending, B last:
    ``LocalTrainer.tail_sizes``) (ceil(n / B) - 1) B plus the smallest size that holds its last batch; under
    ``vmap`` every lane of a bucket, empty ones included, runs as many steps as the bucket's longest client.
    """
    counts = np.asarray(counts, np.int64)
    steps = -(-counts // batch_size)
    if per_client_trips:
        if not tail_sizes:
            return int(steps.sum()) * batch_size, int(counts.sum())
        tail = last_batch_sizes(counts, batch_size, tail_sizes)
        return int(((steps - 1).clip(0) * batch_size + tail).sum()), int(counts.sum())
    done = 0
    for b in buckets:
        present = b.positions[b.positions >= 0]
        done += b.lanes * int(steps[present].max(initial=0))
    return done * batch_size, int(counts.sum())


def tails_used(counts, batch_size: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of ``sizes`` (ascending, B last: ``trainer.tail_sizes``) that the partial last batches of clients
    with ``counts`` samples run at (each the smallest size >= its r = n - (ceil(n / B) - 1) B real samples), B
    last; () if none is below B (every last batch full, or none smaller fits). A step's ``lax.switch`` then
    compiles only these branches; a client outside ``counts`` still finds the smallest of them that holds its
    last batch (B at worst), so the choice changes no result, only which padded sizes exist."""
    taken = last_batch_sizes(counts, batch_size, sizes)
    smaller = tuple(int(s) for s in np.unique(taken[(taken > 0) & (taken < batch_size)]))
    return smaller + (batch_size,) if smaller else ()


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    """Bucket shapes fixed up front, so a run compiles one program per class: ``classes`` ((length, lanes),
    ...) by increasing length (local steps per epoch, lanes per call); each client of a cohort goes to the
    shortest class that holds its steps, and a class with more clients than its lanes runs several calls of
    the same shape (its last one padded with empty lanes)."""
    classes: tuple[tuple[int, int], ...]

    def plan(self, steps) -> list[Bucket]:
        """The buckets of a cohort with per-client step counts ``steps`` [C]: from the shortest class up, a class
        takes the clients its length holds that no shorter class took, shortest first, in as many full calls of
        its lanes as they fill (at least one call); the rest move on to the next class; the longest class runs
        every client left. A call's empty lanes are -1. Buckets are returned longest class first."""
        steps = np.asarray(steps, np.int64)
        order = np.argsort(steps, kind="stable")  # shortest first
        top = self.classes[-1][0]
        if len(steps) and steps.max() > top:
            raise ValueError(f"a client of {int(steps.max())} steps exceeds the grid's longest class ({top} steps)")
        buckets, i = [], 0
        for j, (length, lanes) in enumerate(self.classes):
            fits = int(np.searchsorted(steps[order], length, side="right"))  # clients of at most `length` steps
            take = fits - i if j == len(self.classes) - 1 else min(fits - i, lanes * max((fits - i) // lanes, 1))
            members = order[i:i + take]
            buckets += [Bucket(_pad(members[k:k + lanes], lanes), length) for k in range(0, len(members), lanes)]
            i += take
        return buckets[::-1]


def bucket_grid(steps, cohort: int, *, max_lanes: int, lane_multiple: int = 1, max_classes: int = 8) -> BucketGrid:
    """A ``BucketGrid`` for cohorts of ``cohort`` clients of a population with per-client step counts ``steps``
    [N] (at most ``max_lanes`` lanes a call, lanes a multiple of ``lane_multiple``).

    Start from one class per grid length the population has (``grid_ceil`` of its steps), each expected to hold
    e = cohort x (its share of the population) clients and to cost max(e, 1) x length lane-steps (its clients
    padded to the class length, at least one lane); merge the adjacent pair whose merge adds the least cost
    until at most ``max_classes`` remain. A class's lanes: e rounded up to ``lane_multiple``, at most
    ``max_lanes``."""
    steps = np.asarray(steps, np.int64)
    grid = grid_ceil_array(steps) if len(steps) else np.ones(1, np.int64)
    unique, counts = np.unique(grid, return_counts=True)
    members = [float(c) * min(cohort, len(steps) or 1) / max(len(steps), 1) for c in counts]  # expected clients
    lengths = [int(g) for g in unique]

    def cost(e, length):
        return max(e, 1.0) * length

    while len(lengths) > max(max_classes, 1):
        added = [cost(members[j] + members[j + 1], lengths[j + 1]) - cost(members[j], lengths[j])
                 - cost(members[j + 1], lengths[j + 1]) for j in range(len(lengths) - 1)]
        j = int(np.argmin(added))
        members[j + 1] += members[j]
        members.pop(j)
        lengths.pop(j)
    cap = -(-max(max_lanes, 1) // lane_multiple) * lane_multiple
    return BucketGrid(tuple((int(length), min(cap, -(-max(math.ceil(e - 1e-9), 1) // lane_multiple) * lane_multiple))
                            for length, e in zip(lengths, members)))
