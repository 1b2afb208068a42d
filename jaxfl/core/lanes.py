"""Padding-free vectorized clients inside one jitted call: the cohort sorted by local steps and cut into a few
segments of consecutive ranks, each run as ``lax.map`` over chunks of ``vmap`` lanes (``LanePlan``).

Under ``vmap`` a call runs every lane until its longest client is done, so one vmapped call over a cohort of
log-normal clients computes 4.7-10x its real steps. Sorted by steps, a chunk of consecutive ranks runs to its
own longest client; ``lax.map`` runs the chunks one after another, each with its own trip count. The plan is
static (shapes: lanes per chunk, chunks per segment), chosen on the host from the population's step counts
(``plan_lanes``), and the order inside the call is the cohort's own (``argsort`` of its steps), so one
compiled program serves every round and a plan changes no client's result: every client keeps its own
PRNG stream and inputs, and the trained rows are put back in cohort order before aggregation.

Cost model (what ``plan_lanes`` minimises): a chunk of L lanes whose longest client takes s steps costs
(overhead + L) * s, ``overhead`` being the fixed cost of one sequential step in lane-steps (launch and loop
latency: small on a CPU, tens of lanes on a GPU for small models). Summed over the chunks of the expected
sorted cohort (the mean order statistics of ``draws`` cohorts drawn from the population).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LanePlan:
    """Segments (lanes, chunks) in ascending rank order: segment g runs ``chunks`` x ``lanes`` clients of
    consecutive ranks as ``lax.map`` over chunks of a ``vmap`` over lanes. ``rows``: the clients per call
    (per device under a mesh); the plan covers ``size`` >= rows ranks, the ``size - rows`` lanes below rank 0
    repeat the shortest client and are dropped. ``batch_size``: B, for the sort key ceil(count / B)."""
    segments: tuple[tuple[int, int], ...]
    rows: int
    batch_size: int

    def __post_init__(self):
        if not self.segments or any(lanes < 1 or chunks < 1 for lanes, chunks in self.segments):
            raise ValueError(f"a lane plan needs segments of >= 1 lanes and chunks, got {self.segments}")
        if self.size < self.rows or self.size - self.rows >= self.segments[0][0]:
            raise ValueError(f"segments {self.segments} cover {self.size} ranks for {self.rows} rows: the padding "
                             f"must fit in the first chunk")

    @property
    def size(self) -> int:
        return sum(lanes * chunks for lanes, chunks in self.segments)

    def steps_key(self, count, work=None):
        """The sort key of the clients: their local steps per epoch ceil(count / B), times their share of the
        epochs (``ClientData.work``) when given. count int [k], work float [k] or None -> float32 [k]."""
        steps = ((jnp.asarray(count, jnp.int32) + self.batch_size - 1) // self.batch_size).astype(jnp.float32)
        return steps if work is None else steps * jnp.asarray(work, jnp.float32)

    def apply(self, fn: Callable, key, *stacked, bound=None):
        """fn(*one_row_each) mapped over the rows [k] of ``stacked`` (k = ``rows``), run as the plan says.

        Rows are sorted by ``key`` [k] (ascending; stable), cut into the segments, each ``lax.map`` over chunks
        of ``vmap``; the outputs are put back in the rows' order. bound: an int array [k]; each chunk's ``fn``
        then gets its largest value among the chunk's lanes as the keyword ``bound`` (not batched under the
        chunk's vmap). -> stacked outputs [k]."""
        k = jax.tree_util.tree_leaves(stacked)[0].shape[0]
        if k != self.rows:
            raise ValueError(f"a lane plan for {self.rows} rows applied to {k}")
        pad = self.size - k
        order = jnp.argsort(key, stable=True)
        order = jnp.concatenate([jnp.full((pad,), order[0], order.dtype), order]) if pad else order
        ranked = jax.tree_util.tree_map(lambda a: a[order], (stacked, bound))
        outs, start = [], 0
        for lanes, chunks in self.segments:
            part = jax.tree_util.tree_map(
                lambda a: a[start:start + lanes * chunks].reshape((chunks, lanes) + a.shape[1:]), ranked)
            out = jax.lax.map(lambda chunk: jax.vmap(fn if chunk[1] is None else functools.partial(
                fn, bound=jnp.max(chunk[1])))(*chunk[0]), part)
            outs.append(jax.tree_util.tree_map(lambda o: o.reshape((lanes * chunks,) + o.shape[2:]), out))
            start += lanes * chunks
        out = jax.tree_util.tree_map(lambda *parts: jnp.concatenate(parts)[pad:], *outs)
        inverse = jnp.zeros((k,), order.dtype).at[order[pad:]].set(jnp.arange(k, dtype=order.dtype))
        return jax.tree_util.tree_map(lambda o: o[inverse], out)

    def work(self, steps) -> int:
        """Lane-steps this plan computes for a cohort with per-client steps ``steps`` [rows] (numpy): the sum
        over chunks of lanes x the chunk's longest client (padding lanes included)."""
        s = np.sort(np.asarray(steps, np.int64))
        s = np.concatenate([np.full(self.size - len(s), s[0] if len(s) else 0, np.int64), s])
        done, start = 0, 0
        for lanes, chunks in self.segments:
            ends = start + lanes * np.arange(1, chunks + 1) - 1
            done += lanes * int(s[ends].sum())
            start += lanes * chunks
        return done


def expected_sorted_steps(steps, rows: int, *, members: int | None = None, rate: float | None = None,
                          draws: int = 64, seed: int = 0) -> np.ndarray:
    """E[s_(r)], r = 0..rows-1: the mean ascending order statistics of the local steps of a cohort of ``rows``
    rows drawn from the population's per-client ``steps`` [N] (numpy; deterministic for ``seed``).

    Fixed cohorts: ``members`` = rows clients without replacement (all N: the population itself, sorted).
    Poisson cohorts (``rate`` q): Binomial(N, q) members (at most ``rows``), the rows past them padding (0 steps).
    Under a mesh of d devices each device sorts its own block: pass rows = k / d and members = k / d (a
    uniform block of a uniform cohort is a uniform subset)."""
    steps = np.asarray(steps, np.float64)
    n = len(steps)
    if rate is None and (members or rows) >= n:
        return np.sort(np.resize(steps, rows))
    rng = np.random.default_rng(seed)
    total = np.zeros(rows)
    for _ in range(draws):
        k = min(rows, members or rows) if rate is None else min(rows, int(rng.binomial(n, rate)))
        s = np.zeros(rows)
        s[rows - k:] = np.sort(steps[rng.choice(n, k, replace=False)])
        total += s
    return total / draws


def plan_lanes(expected, *, batch_size: int, max_segments: int = 3, overhead: float = 1.0,
               max_lanes: int | None = None, lane_sizes=None) -> LanePlan:
    """The plan of at most ``max_segments`` segments minimising the modelled cost of the expected sorted cohort
    ``expected`` [rows] (``expected_sorted_steps``): sum over chunks of (overhead + L) * E[longest step count].

    Dynamic programme over the rank at which a segment ends; a segment of L lanes (a power of two, at most
    ``max_lanes``; or one of ``lane_sizes``) and c chunks covers the c L ranks below it, the first segment
    possibly fewer (its bottom chunk padded). O(max_segments x rows^2 x log rows) host work."""
    e = np.asarray(expected, np.float64)
    k = len(e)
    if k == 0:
        raise ValueError("a lane plan needs at least one row")
    cap = min(max_lanes or k, k)
    sizes = sorted(set(int(s) for s in lane_sizes)) if lane_sizes is not None else \
        [1 << i for i in range(cap.bit_length()) if 1 << i <= cap] + ([cap] if cap & (cap - 1) else [])
    # chain[L][j]: sum of e at ranks j-1, j-1-L, j-1-2L, ... >= 0 (the chunk ends of chunks of L below rank j)
    chain = {}
    for lanes in sizes:
        c = np.zeros(k + 1)
        for j in range(1, k + 1):
            c[j] = e[j - 1] + (c[j - lanes] if j > lanes else 0.0)
        chain[lanes] = c
    inf = float("inf")
    best = np.full((max_segments + 1, k + 1), inf)
    best[0, 0] = 0.0
    choice = {}
    for g in range(1, max_segments + 1):
        for j in range(1, k + 1):
            for lanes in sizes:
                per = overhead + lanes
                c = chain[lanes]
                # the first segment: ranks [0, j), ceil(j / L) chunks, padded at the bottom
                if g == 1:
                    cost = per * c[j]
                    if cost < best[g, j]:
                        best[g, j], choice[g, j] = cost, (0, lanes)
                    continue
                starts = np.arange(j - lanes, 0, -lanes)  # i > 0 with (j - i) % L == 0
                if not len(starts):
                    continue
                costs = best[g - 1, starts] + per * (c[j] - c[starts])
                m = int(np.argmin(costs))
                if costs[m] < best[g, j]:
                    best[g, j], choice[g, j] = costs[m], (int(starts[m]), lanes)
    g = int(np.argmin(best[1:, k])) + 1
    segments, j = [], k
    while j > 0:
        i, lanes = choice[g, j]
        segments.append((lanes, -(-(j - i) // lanes)))
        j, g = i, g - 1
    return LanePlan(tuple(reversed(segments)), rows=k, batch_size=batch_size)


def single_vmap_plan(rows: int, batch_size: int) -> LanePlan:
    """One chunk of every row: a plain ``vmap`` over the cohort (what the engine ran before lane plans)."""
    return LanePlan(((rows, 1),), rows=rows, batch_size=batch_size)
