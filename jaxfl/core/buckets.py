"""Scheduling a cohort by size: which clients train together, padded to what length (pure numpy, host side).

Under ``vmap`` a group of clients runs until its longest client is done, so clients of similar step counts
should share a group. ``plan_buckets`` sorts the cohort by local steps and cuts it into buckets; each bucket
is one compiled call of shape (lanes, length). Both come from small fixed sets, so a long run compiles a
bounded number of shapes:

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
    grid = np.array([grid_ceil(s) for s in steps[order]], np.int64)
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


def padded_work(buckets: list[Bucket], counts, batch_size: int, *, per_client_trips: bool) -> tuple[int, int]:
    """(computed samples, real samples) of one epoch of a plan; their ratio is the padding overhead.

    A step computes a whole batch, so a client of n samples costs ceil(n / B) * B under ``lax.map``
    (``per_client_trips``: every client runs exactly its own steps); under ``vmap`` every lane of a bucket,
    empty ones included, runs as many steps as the bucket's longest client.
    """
    counts = np.asarray(counts, np.int64)
    steps = -(-counts // batch_size)
    if per_client_trips:
        return int(steps.sum()) * batch_size, int(counts.sum())
    done = 0
    for b in buckets:
        present = b.positions[b.positions >= 0]
        done += b.lanes * int(steps[present].max(initial=0))
    return done * batch_size, int(counts.sum())
