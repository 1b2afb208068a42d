"""Three data backends for one round function (``step.make_step``): where the population lives, how a round's
cohort reaches the step.

- ``Stacked``: everything on the device. Every client's samples (flat, the ``RaggedClients`` layout) and
  persistent states stay there; a round is one jitted call that draws the cohort, gathers its rows padded to
  the population's longest client, runs the step and writes the kept states back. For populations that fit.
- ``Ragged``: the samples on the host (``RaggedClients``), the persistent states in a ``ClientStore`` (device
  or host); a round gathers only its cohort, sorts it by local steps and trains it in buckets of similar
  clients, each bucket one compiled call of a shape from a grid fixed for the run (``buckets.bucket_grid``),
  then aggregates. For any population size and over several processes.
- ``Streamed``: the samples on the host, the states in a ``ClientStore``; a round sends its cohort's samples as
  one flat store of a size set up front and runs ``Stacked``'s round on it in one call. For populations that
  do not fit, in one process.

``Stacked`` can run K rounds per call (``rounds_per_call``): a loop over rounds inside the jitted function, the
per-round metrics stacked and fetched once; the run's results do not depend on K (tested bit for bit).

Both keep per client only what the algorithm keeps (``Algorithm.init``'s client state: FedAvg nothing,
FedBN its BatchNorm leaves); both give every client its own step count, so padding costs memory, not compute
(under ``vmap`` a call runs until its longest client is done: ``Ragged`` groups similar clients for that).
Results agree up to float reassociation: per-client keys depend on the client id only, and the trained
states are aggregated in cohort order (sorted ids); over a mesh, ``Stacked`` and ``Streamed`` order the rows so
that each device's block gets an equal share of the local steps (``cohort.device_balanced_order``: one device
would otherwise wait for the other's larger clients), aggregate in that order and report the clients' metrics in
cohort order. Interface of both:

    init(key, sample_x) -> (server, store)
    round(server, store, round_idx, root, before_aggregate=None) -> (server, metrics)
    run_rounds(server, store, first, count, root) -> (server, [metrics of each round])

With Poisson sampling (``sampling="poisson"``) a round's cohort varies in size: both pad it with rows of count 0
(weight 0, ``step.drop_padding``) to a size class, ``Ragged`` per round (a multiple of 8 rows), ``Stacked`` once
(its mean plus 4 standard deviations; a larger cohort, seen on the host before the call, recompiles), and
report the members only.

Each round's metrics carry ``host_share``: the fraction of the backend's wall time for it spent outside jitted
computations (the cohort draw, host gathers and scatters, dispatch, fetching metrics).
"""
from __future__ import annotations

import math
import os
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..data.clients import ClientData
from ..data.ragged import RaggedClients
from ..errors import ConfigError, DeviceMemoryError, check_choice, first_line
from .buckets import Bucket, BucketGrid, bucket_grid, cohort_samples_bound, grid_ceil, padded_work, plan_buckets
from .cohort import (SAMPLINGS, Chunked, ClientMap, Sampling, client_map, device_balanced_order, poisson_cohort,
                     poisson_members, poisson_rows, sample_cohort)
from .cost import MAX_LANE_OVERHEAD
from .distributed import client_sharding, fetch
from .lanes import LanePlan, expected_sorted_steps, plan_lanes
from .step import Weighting, init_state, make_step, with_round_metrics
from .trainer import ClientRows
from .trees import tree_bytes
from .types import Algorithm


PLACEMENTS = ("auto", "device", "host")
BACKENDS = ("stacked", "streamed", "ragged")


# The fixed cost of one sequential local step, in lane-steps, that ``plan_lanes`` weighs against padded lanes
# (``Stacked(lane_overhead=...)``). CPU: 0, measured (benchmarks/RESULTS.md, "Lane plans"): logreg and the 2NN
# at cohort 100 ran fastest with every client alone in its chunk (0.081 / 0.64 s a round, against 0.090 / 0.69
# s at 1 lane of overhead and 0.16 / 1.29 s for one vmap over the cohort). An accelerator's steps cost launches:
# the runner derives it from ``core.cost`` (tau P / (B f), at most ``MAX_LANE_OVERHEAD``); the cap stands in
# where no FLOP count is known.
DEFAULT_LANE_OVERHEAD = {"cpu": 0.0, "gpu": MAX_LANE_OVERHEAD, "tpu": MAX_LANE_OVERHEAD}


def default_lane_overhead(platform: str | None = None) -> float:
    """``DEFAULT_LANE_OVERHEAD`` of ``platform`` (default: jax's default backend)."""
    return DEFAULT_LANE_OVERHEAD.get(platform or jax.default_backend(), MAX_LANE_OVERHEAD)


def device_memory_bytes() -> int:
    """Memory of this process's first device: the accelerator's limit, or the host's RAM for CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_out_of_memory(err: Exception) -> bool:
    """Whether a runtime error is a failed device allocation (XLA's RESOURCE_EXHAUSTED status)."""
    return "RESOURCE_EXHAUSTED" in str(err)


class ClientStore:
    """Every client's persistent state stacked [N, ...]: jax arrays on the device, or numpy on the host.

    ``placement="auto"`` keeps it on the device when it takes at most a quarter of the device's memory and
    the run is not sharded, else on the host. ``gather(ids)`` -> the rows [k]; ``scatter(ids, rows)`` writes
    them back (in place: donated on the device, assigned on the host).
    """

    def __init__(self, state, placement: str = "auto", sharded: bool = False, sharding=None):
        if placement == "auto":
            placement = "host" if sharded or tree_bytes(state) > device_memory_bytes() // 4 else "device"
        self.placement, self.sharding = placement, sharding  # sharding: of the device copy (None: default device)
        self.state = state
        self.set(state)
        self._scatter = jax.jit(lambda st, ids, rows: jax.tree_util.tree_map(
            lambda a, b: a.at[ids].set(b), st, rows), donate_argnums=(0,))
        self._gather = jax.jit(lambda st, ids: jax.tree_util.tree_map(lambda a: a[ids], st))

    def set(self, state) -> None:
        """Replace the whole state (e.g. from a checkpoint)."""
        self.state = jax.device_put(state, self.sharding) if self.placement == "device" else fetch(state)

    @property
    def empty(self) -> bool:
        return not jax.tree_util.tree_leaves(self.state)

    def gather(self, ids):
        if self.empty:
            return self.state
        if self.placement == "device":
            return self._gather(self.state, jnp.asarray(ids))
        return jax.tree_util.tree_map(lambda a: a[ids], self.state)

    def scatter(self, ids, rows) -> None:
        if self.empty:
            return
        if self.placement == "device":
            self.state = self._scatter(self.state, jnp.asarray(ids), rows)
        else:
            rows = fetch(rows)
            for a, b in zip(jax.tree_util.tree_leaves(self.state), jax.tree_util.tree_leaves(rows)):
                a[ids] = b


class _Backend:
    """What both backends share: the step, the cohort draw, the initial state and the per-round report.

    trainer: the ``LocalTrainer`` the algorithm was built on, if given: under ``map`` ``padded_work`` counts the
    partial last batches at the sizes it computed them at (``LocalTrainer.tails_in_use``).

    clients: how a call runs its clients, a ``cohort.ClientMap`` (``Vmap()``, ``Map()``, ``Chunked(size)``,
    each optionally split over a device mesh: ``Vmap(mesh=client_mesh(2))``) or its name (``cohort.client_map``;
    None: the platform's default, one device).

    sampling: ``fixed`` (``cohort_size`` = k clients a round, drawn without replacement: ``sample_cohort``) or
    ``poisson`` (each client joins a round with probability q = ``rate``, default k / N, on its own stream:
    ``poisson_members``;
    the cohort, of Binomial(N, q) clients, is padded to a size class with rows of count 0, which
    ``make_step(padded=True)`` gives weight 0, and the metrics report its members only)."""

    def __init__(self, alg: Algorithm, train: RaggedClients, *, batch_size: int, clients: ClientMap | str | None = None,
                 cohort_size: int | None = None, weighting: Weighting = "samples",
                 num_rounds: int | None = None, stragglers: float = 0.0, sampling: Sampling = "fixed",
                 rate: float | None = None, trainer=None):
        check_choice("sampling", sampling, SAMPLINGS)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1")
        if cohort_size is not None and (not isinstance(cohort_size, int) or cohort_size < 1):
            raise ConfigError(f"cohort_size={cohort_size!r} must be an integer >= 1 (None: every client)")
        self.alg, self.train, self.batch_size = alg, train, batch_size
        self.clients = client_map(clients)
        self.weighting, self.num_rounds = weighting, num_rounds
        self.num_clients = train.num_clients
        self.cohort_size = min(cohort_size or self.num_clients, self.num_clients)
        self.sampling, self.rate = sampling, self.cohort_size / self.num_clients if rate is None else rate
        self.devices = self.clients.devices
        self.row_multiple = 8 * self.devices  # a padded Poisson cohort's rows: a multiple of this
        self.stragglers = stragglers
        self.trainer = trainer  # (optional: its ``tails_in_use`` for ``padded_work`` under ``map``)
        self.step = self.make_step()
        self.device_s = 0.0  # seconds spent in jitted computations (``timed``), for ``host_share``

    @property
    def mesh(self):
        """The device mesh the client axis is split over (the client map's; None: one device)."""
        return self.clients.mesh

    @property
    def strategy(self) -> str:
        """The client map's name (``vmap`` | ``map`` | ``chunked``), as the CLI and the metrics name it."""
        return self.clients.name

    def make_step(self, lanes: LanePlan | None = None):
        """The round's ``step.Step`` for this backend's settings (``lanes``: the cohort's ``LanePlan``)."""
        return make_step(self.alg, clients=self.clients,
                         num_rounds=self.num_rounds, weighting=self.weighting, stragglers=self.stragglers,
                         padded=self.sampling == "poisson", lanes=lanes)

    def timed(self, fn, *args):
        """fn(*args), waited for; its wall time is added to ``device_s``."""
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.device_s += time.perf_counter() - t
        return out

    def check_rounds(self, first: int, count: int = 1) -> None:
        """ConfigError unless rounds first .. first + count - 1 are round indices: 0 <= t < num_rounds (T, if
        given: the algorithms' schedules assume t < T) and below 2^31 - 1 (a traced int32)."""
        end = self.num_rounds if self.num_rounds is not None else 2 ** 31 - 1
        if not (isinstance(first, (int, np.integer)) and 0 <= first and first + count <= end):
            raise ConfigError(f"round index {first!r}{f' (+{count - 1})' if count > 1 else ''} is outside "
                              f"[0, {end})" + (" (num_rounds)" if self.num_rounds is not None else ""))

    def draw(self, round_idx: int, root) -> np.ndarray:
        """Round ``round_idx``'s cohort on the host: its clients' ids, sorted (int [k])."""
        if self.sampling == "poisson":
            return np.flatnonzero(np.asarray(poisson_members(root, round_idx, self.num_clients, self.rate)))
        return np.asarray(sample_cohort(root, round_idx, self.num_clients, self.cohort_size))

    def round(self, server, store: ClientStore, round_idx: int, root, before_aggregate=None):
        """One round: (server, metrics). Each backend defines it."""
        raise NotImplementedError

    def run_rounds(self, server, store, first: int, count: int, root):
        """``count`` rounds from round ``first``: (server, [metrics of each round]) (one call per round here;
        ``Stacked`` overrides it with one call for up to ``rounds_per_call`` rounds)."""
        out = []
        for r in range(first, first + count):
            server, m = self.round(server, store, r, root)
            out.append(m)
        return server, out

    def init_states(self, key, sample_x):
        """(server, every client's initial state stacked [N]). sample_x: a batch of the clients' inputs
        [b, ...] (e.g. ``train.x[:1]``), whose shape sizes the model."""
        want = tuple(self.train.x.shape[1:])
        if tuple(np.shape(sample_x)[1:]) != want:
            raise ConfigError(f"sample_x has shape {tuple(np.shape(sample_x))}; the clients' inputs are {want} a "
                              f"sample: pass a batch of them, e.g. train.x[:1]")
        server, clients = init_state(self.alg, key, sample_x, self.num_clients)
        return self.clients.replicate(server), clients

    def report(self, plan, ids) -> dict:
        """Per-round metrics: ``padded_work`` (computed / real samples of an epoch) and ``buckets``."""
        tails = self.trainer.tails_in_use() if self.trainer is not None and self.strategy == "map" else ()
        done, real = padded_work(plan, self.train.counts[ids], self.batch_size,
                                 per_client_trips=self.strategy == "map", tail_sizes=tails)
        return {"padded_work": done / max(real, 1), "buckets": len(plan)}


class Ragged(_Backend):
    """Rounds over a ragged population of any size (see the module docstring).

    clients: ``Map()`` (one call, every client its own step count), ``Vmap()`` (buckets of similar clients, the
    classes of a ``BucketGrid``) or ``Chunked(size)`` (the same, at most ``size`` lanes a bucket). The map's mesh
    splits every call's lanes over devices (lanes are then multiples of the device count; the cohort must be
    one too).
    client_store: where the persistent states live (``ClientStore``).
    A bucket that runs out of device memory (``vmap`` / ``chunked``) is not fatal: the round is retrained in
    buckets of at most half as many lanes, and that cap (``lane_cap``) stays for the rest of the run.
    """

    def __init__(self, alg: Algorithm, train: RaggedClients, *, client_store: str = "auto", **kw):
        check_choice("client_store", client_store, PLACEMENTS)
        super().__init__(alg, train, **kw)
        self.placement = client_store
        step = self.step

        def train_into(buffer, server, clients, data, ids, positions, round_idx, root):
            # train one bucket and write its rows into the cohort buffer; empty lanes (position C) are dropped
            new = step.train(server, clients, data, ids, round_idx, root)
            return jax.tree_util.tree_map(lambda buf, b: buf.at[positions].set(b, mode="drop"), buffer, new)

        self._train_into = jax.jit(train_into, donate_argnums=(0,))
        self._train_shape = jax.jit(step.train)
        self._aggregate = jax.jit(step.aggregate)
        self._round_metrics = jax.jit(step.round_metrics)
        self._make_buffer: dict[int, Callable] = {}  # rows -> a jitted function making the cohort's zero buffer
        self.shapes: set[tuple[int, int]] = set()  # (lanes, samples) of every bucket compiled so far
        self.lane_cap: int | None = None  # set when a bucket ran out of device memory (``round``)
        self.grid: BucketGrid | None = None  # the bucket shapes, fixed when the first cohort is planned

    def init(self, key, sample_x):
        """(server, store): the server state and every client's initial persistent state."""
        server, clients = self.init_states(key, sample_x)
        return server, ClientStore(clients, self.placement, sharded=self.mesh is not None)

    def plan(self, ids):
        """The buckets of cohort ``ids``: under ``map`` one bucket of the whole cohort (``buckets.plan_buckets``);
        under ``vmap`` and ``chunked`` the classes of ``bucket_grid``, fixed for the run from the population's step
        counts and the expected cohort (at most ``chunk_size`` lanes a call under ``chunked``, ``lane_cap``
        after running out of memory), so a run compiles at most ``max_classes`` bucket shapes."""
        steps = -(-self.train.counts[ids] // self.batch_size)
        if self.strategy == "map":  # (over a mesh its lanes ordered so that each device gets its share of the steps)
            [bucket] = plan_buckets(steps, max_lanes=len(ids), lane_multiple=self.devices, single=True)
            work = np.where(bucket.positions >= 0, steps[np.maximum(bucket.positions, 0)], 0)
            return [Bucket(bucket.positions[device_balanced_order(work, self.devices)], bucket.steps)]
        if self.grid is None:
            cohort = self.cohort_size if self.sampling == "fixed" else max(round(self.rate * self.num_clients), 1)
            max_lanes = self.clients.size * self.devices if isinstance(self.clients, Chunked) else cohort
            if self.lane_cap is not None:
                max_lanes = min(max_lanes, self.lane_cap)
            self.grid = bucket_grid(-(-self.train.counts // self.batch_size), cohort, max_lanes=max_lanes,
                                    lane_multiple=self.devices)
        return self.grid.plan(steps)

    def round(self, server, store: ClientStore, round_idx: int, root, before_aggregate=None):
        """One round: sample the cohort, train it bucket by bucket, aggregate, write back the kept states.

        Returns (server, metrics): per cohort client (cohort order = sorted ids) ``loss``, ``accuracy``,
        ``seen``, ``steps``, ``finite``, ``client_id`` and the algorithm's own; per round ``padded_work``
        (computed / real samples), ``buckets`` and ``compiled_shapes`` (distinct bucket shapes so far).
        ``before_aggregate(server, trained, ids)``, if given, sees the cohort's trained rows (stacked in cohort
        order) before aggregation (to evaluate the models right after local training).
        """
        self.check_rounds(round_idx)
        t0, d0 = time.perf_counter(), self.device_s
        ids = self.draw(round_idx, root)
        k = len(ids)  # a Poisson cohort's buffer has rows for a size class: padding rows after the k members
        rows = poisson_rows(k, self.row_multiple) if self.sampling == "poisson" else k
        while True:
            plan = self.plan(ids) if k else []
            try:
                buffer = self._train_buckets(plan, server, store, ids, round_idx, root, rows)
                break
            except jax.errors.JaxRuntimeError as err:
                lanes = max(b.lanes for b in plan)
                if not is_out_of_memory(err) or self.strategy == "map" or lanes <= self.devices:
                    raise
                # a bucket's activations did not fit: retrain the cohort (its keys depend on client ids only,
                # so the results do not change) in buckets of at most half as many lanes, from now on
                self.lane_cap = max(self.devices, lanes // 2 // self.devices * self.devices)
                self.grid = None  # planned again with the cap
                warnings.warn(f"out of device memory training {lanes} clients in one call; buckets are capped "
                              f"at {self.lane_cap} clients from now on", stacklevel=2)
        trained, metrics = buffer
        members = (lambda tree: tree) if rows == k else (lambda tree: jax.tree_util.tree_map(lambda a: a[:k], tree))
        if before_aggregate is not None:
            t = time.perf_counter()
            before_aggregate(server, members(trained), ids)
            t0 += time.perf_counter() - t  # evaluation is not part of the round
        counts, row_ids = self.train.counts[ids], ids
        if rows > k:  # padding rows: count 0 (weight 0), id N
            counts = np.concatenate([counts, np.zeros(rows - k, counts.dtype)])
            row_ids = np.concatenate([ids, np.full(rows - k, self.num_clients, ids.dtype)])
        new, kept = self.timed(self._aggregate, server, trained, counts, row_ids, round_idx)
        own = self.timed(self._round_metrics, server, new) if self.alg.round_metrics is not None else {}
        server = new
        store.scatter(ids, members(kept))
        metrics = with_round_metrics({name: np.asarray(v)[:k] for name, v in fetch(metrics).items()},
                                     {name: np.asarray(v) for name, v in fetch(own).items()})
        host = 1.0 - (self.device_s - d0) / max(time.perf_counter() - t0, 1e-9)
        return server, dict(metrics, client_id=ids, **self.report(plan, ids), compiled_shapes=len(self.shapes),
                            host_share=max(host, 0.0))

    def _train_buckets(self, plan, server, store: ClientStore, ids, round_idx: int, root, rows: int):
        """Train cohort ``ids`` bucket by bucket: (trained rows, metrics), stacked in cohort order into a
        buffer of ``rows`` rows (rows past the cohort stay zero)."""
        buffer = None
        for b in plan:
            args = self._bucket_args(server, store, ids, b.positions, b.steps, round_idx, root, rows)
            if buffer is None:  # the cohort's rows, in cohort order, filled bucket by bucket
                buffer = self._empty_buffer(args, rows)
            buffer = self.timed(self._train_into, buffer, *args)
            self.shapes.add((b.lanes, b.steps))
        if buffer is None:  # an empty (Poisson) cohort: the buffer's shapes from a bucket of empty lanes
            buffer = self._empty_buffer(self._bucket_args(server, store, ids, np.full(self.devices, -1), 1,
                                                          round_idx, root, rows), rows)
        return buffer

    def _bucket_args(self, server, store: ClientStore, ids, positions, steps: int, round_idx: int, root, rows: int):
        """_train_into's arguments after the buffer for the lanes ``positions`` (cohort positions; -1: empty)."""
        real = positions >= 0
        bid = np.where(real, ids[np.maximum(positions, 0)] if len(ids) else 0, -1)
        data = self.train.gather(bid, steps * self.batch_size)
        return (server, self.clients.place(store.gather(np.maximum(bid, 0))), self.clients.place(data),
                self.clients.place(np.maximum(bid, 0).astype(np.int32)),
                self.clients.place(np.where(real, positions, rows)), round_idx, root)

    def _empty_buffer(self, args, rows: int):
        if rows not in self._make_buffer:  # the output rows' shapes do not depend on the bucket: trace once
            server, clients, data, ids, _, round_idx, root = args
            out = jax.eval_shape(self._train_shape, server, clients, data, ids, round_idx, root)
            self._make_buffer[rows] = jax.jit(
                lambda: jax.tree_util.tree_map(lambda s: jnp.zeros((rows,) + s.shape[1:], s.dtype), out),
                out_shardings=None if self.mesh is None else client_sharding(self.mesh))
        return self._make_buffer[rows]()


def client_rows(data, ids, length: int) -> ClientRows:
    """The clients ``ids`` [k] of data = (x [S, ...], y [S], offsets [N], counts [N]) (device arrays) as
    ``ClientRows`` with rows [k, length] into the flat store (padding points at the client's first sample; it
    gets weight 0): nothing is copied until a minibatch reads its rows."""
    x, y, offsets, counts = data
    n = counts[ids]
    pos = jnp.arange(length)
    rows = offsets[ids][:, None] + jnp.where(pos[None, :] < n[:, None], pos[None, :], 0)
    rows = jnp.minimum(rows, max(y.shape[0] - 1, 0))
    return ClientRows(x, y, rows.astype(jnp.int32), n.astype(jnp.int32))


def gather_clients(data, ids, length: int) -> ClientData:
    """``RaggedClients.gather`` inside jit: data = (x [S, ...], y [S], offsets [N], counts [N]) device arrays,
    ids [k] -> ClientData [k, length] (padding repeats the client's first sample; it gets weight 0)."""
    r = client_rows(data, ids, length)
    return ClientData(r.x, r.y, r.count)


class Stacked(_Backend):
    """Rounds with the whole population on the device (see the module docstring): one jitted call per round.

    The cohort's data is padded to the population's longest client, rounded up to the step grid, so every
    round has the same shapes and compiles once; every client runs its own step count. Under ``vmap`` and
    ``chunked`` the cohort is sorted by local steps inside the call and run as chunks of lanes that each stop at
    their own longest client (``lanes.LanePlan``: ``lane_plan``, or planned for this population by
    ``lanes.plan_lanes`` with at most ``lane_segments`` segments and a step cost of ``lane_overhead`` lanes;
    ``lane_segments=0``: one vmap over the cohort, every lane to its longest client). The
    padded data is never copied: each client gets row indices into the flat store (``ClientRows``) and a
    minibatch gathers only its own rows (a copy of cohort x longest client cost 40% of a logistic-regression
    round of 100 FEMNIST-sized clients on CPU).
    rounds_per_call: K, the most rounds one call runs (``run_rounds``): a loop whose trip count is an argument,
    so the same compiled program runs 1 to K rounds and K does not change the numbers.
    keep_rows: under ``map``, write each round's trained rows into the buffer of the round before (``keeps_rows``;
    it stays allocated between rounds) instead of a new one; False: a new one every call.
    """

    def __init__(self, alg: Algorithm, train: RaggedClients, rounds_per_call: int = 1, lane_segments: int = 3,
                 lane_overhead: float | None = None, lane_plan: LanePlan | None = None, keep_rows: bool = True,
                 **kw):
        kw.pop("client_store", None)  # the states always live on the device here
        super().__init__(alg, train, **kw)
        if not isinstance(lane_segments, int) or lane_segments < 0:
            raise ConfigError(f"lane_segments={lane_segments!r} must be an integer >= 0 (0: one vmap call over "
                              f"the cohort)")
        if lane_overhead is not None and not lane_overhead >= 0:
            raise ConfigError(f"lane_overhead={lane_overhead!r} must be a number >= 0")
        self.rounds_per_call = rounds_per_call
        self.keep_rows = keep_rows
        self.lane_segments = lane_segments
        self.lane_overhead = default_lane_overhead() if lane_overhead is None else float(lane_overhead)
        self.lanes: LanePlan | None = None
        self.given_plan = lane_plan
        if lane_plan is not None and (self.sampling != "fixed" or self.strategy == "map"
                                      or lane_plan.rows * self.devices != self.cohort_size):
            raise ConfigError(f"lane_plan for {lane_plan.rows} rows a device needs fixed cohorts of "
                              f"{lane_plan.rows * self.devices} clients under vmap or chunked")
        # with a mesh, every device holds the whole population (its samples and states), placed once: an array
        # on one device would be copied to the others in every round (3.3x a logreg round on 2 CPU devices)
        self.replicated = self.clients.replicated
        self.data = self._place(train)
        steps = -(-int(train.counts.max(initial=1)) // self.batch_size)
        self.length = self.batch_size * grid_ceil(steps)
        # a Poisson cohort's rows: its mean plus 4 standard deviations, rounded up (a larger cohort, checked on
        # the host before each call, recompiles with more rows)
        n, q = self.num_clients, self.rate
        self.rows = min(poisson_rows(math.ceil(n * q + 4 * math.sqrt(n * q * (1 - q))), self.row_multiple),
                        poisson_rows(n, self.row_multiple))
        self._build()

    def _build(self):
        """The lane plan and the jitted round functions (again when a Poisson cohort outgrows ``rows``)."""
        self.lanes = self.lane_plan()
        self.step = step = self.make_step(self.lanes)
        self.rows_buffer = None  # (``held_rows``: its shape follows the rows, which a rebuild may change)
        n, c, rows = self.num_clients, self.cohort_size, self.rows
        rounds_per_call = self.rounds_per_call

        def counts_of(data, ids):  # sample counts of the cohort's rows; a padding row (id N) has none
            return jnp.where(ids < n, data[3][jnp.minimum(ids, n - 1)], 0)

        def balanced(ids, data):  # over a mesh: each device's block of rows gets its share of the local steps
            if self.devices == 1:
                return ids
            return ids[device_balanced_order(-(-counts_of(data, ids) // self.batch_size), self.devices)]

        def cohort(states, data, round_idx, root):
            if self.sampling == "fixed":
                ids = balanced(sample_cohort(root, round_idx, n, c).astype(jnp.int32), data)
                return ids, jax.tree_util.tree_map(lambda a: a[ids], states), client_rows(data, ids, self.length)
            ids = balanced(poisson_cohort(root, round_idx, n, self.rate, rows), data)  # members, padding (id N)
            at = jnp.minimum(ids, n - 1)
            cdata = client_rows(data, at, self.length)
            cdata = cdata.replace(count=counts_of(data, ids))
            return ids, jax.tree_util.tree_map(lambda a: a[at], states), cdata

        def write_back(states, ids, kept):  # (a padding row's id N is out of bounds: its write is dropped)
            states = jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b, mode="drop"), states, kept)
            if self.replicated is None:
                return states
            return jax.lax.with_sharding_constraint(states, self.replicated)  # stays where the next round reads it

        def round_fn(server, states, data, round_idx, root, buffer=None):
            # buffer: the trained rows' buffer (``keeps_rows``; None: none), donated, written in place and returned
            ids, clients, cdata = cohort(states, data, round_idx, root)
            new, kept, metrics, rows = step.with_rows(server, clients, cdata, ids, round_idx, root, out=buffer)
            metrics = with_round_metrics(dict(metrics, client_id=ids), step.round_metrics(server, new))
            return new, write_back(states, ids, kept), metrics, None if buffer is None else rows

        def rows_shape(server, states, data, root):  # the shapes of round_fn's trained rows
            ids, clients, cdata = cohort(states, data, 0, root)
            return step.train(server, clients, cdata, ids, 0, root)

        def train_fn(server, states, data, round_idx, root):
            ids, clients, cdata = cohort(states, data, round_idx, root)
            trained, metrics = step.train(server, clients, cdata, ids, round_idx, root)
            return ids, trained, dict(metrics, client_id=ids)

        def finish_fn(server, states, trained, ids, data, round_idx):
            new, kept = step.aggregate(server, trained, counts_of(data, ids), ids, round_idx)
            return new, write_back(states, ids, kept), step.round_metrics(server, new)

        def rounds_fn(server, states, data, first, count, root, rows=None):
            # rounds first .. first + count - 1 (count <= K, traced): one program for any count
            shapes = jax.eval_shape(round_fn, server, states, data, first, root, rows)[2]
            logged = jax.tree_util.tree_map(lambda s: jnp.zeros((rounds_per_call,) + s.shape, s.dtype), shapes)

            def body(j, carry):
                server, states, logged, rows = carry
                server, states, m, rows = round_fn(server, states, data, first + j, root, rows)
                logged = jax.tree_util.tree_map(lambda b, v: b.at[j].set(v), logged, m)
                return server, states, logged, rows

            return jax.lax.fori_loop(0, count, body, (server, states, logged, rows))

        self._rows_shape = rows_shape
        self._round = jax.jit(round_fn, donate_argnums=(1, 5))
        self._rounds = jax.jit(rounds_fn, donate_argnums=(1, 6))
        self._train = jax.jit(train_fn)
        self._finish = jax.jit(finish_fn, donate_argnums=(1,))

    def timed(self, fn, *args):
        """``_Backend.timed``; a call out of device memory becomes a one-line ``DeviceMemoryError`` (the whole
        cohort is one call here: the ragged backend splits it into buckets that fit)."""
        try:
            return super().timed(fn, *args)
        except jax.errors.JaxRuntimeError as err:
            if not is_out_of_memory(err):
                raise
            raise DeviceMemoryError(
                f"out of device memory training {self.cohort_size} clients in one call ({first_line(err, 120)}); "
                f"--backend ragged trains the cohort in buckets that fit, or --strategy chunked with a smaller "
                f"--chunk-size") from None

    def load(self, train: RaggedClients) -> None:
        """Replace the population's samples by ``train`` with the same client counts (e.g. another draw of the
        same clients): the compiled round is reused."""
        if not np.array_equal(train.counts, self.train.counts) or train.x.shape != self.train.x.shape:
            raise ValueError("load() needs the same clients with the same sample counts")
        self.train = train
        self.data = self._place(train)

    def _place(self, train: RaggedClients):
        """The population's flat samples, offsets and counts on the device (on every device of the mesh; inputs
        read lazily, ``data.lazy``, are all read here)."""
        return jax.device_put((np.asarray(train.x), train.y, train.offsets.astype(np.int32),
                               train.counts.astype(np.int32)), self.replicated)

    def init(self, key, sample_x):
        """(server, store): the server state and every client's initial persistent state, on the device."""
        server, clients = self.init_states(key, sample_x)
        return server, ClientStore(clients, "device", sharding=self.replicated)

    def round(self, server, store: ClientStore, round_idx: int, root, before_aggregate=None):
        """One round in one jitted call (two around ``before_aggregate``, which sees the trained rows);
        returns (server, metrics) as ``Ragged.round``."""
        self.check_rounds(round_idx)
        t0, d0 = time.perf_counter(), self.device_s
        self._fit_rows(round_idx, 1, root)
        if before_aggregate is None:
            rows = self.held_rows(server, store.state, self.data, root)
            server, store.state, metrics, self.rows_buffer = self.timed(
                self._round, server, store.state, self.data, round_idx, root, rows)
        else:
            ids, trained, metrics = self.timed(self._train, server, store.state, self.data, round_idx, root)
            t = time.perf_counter()
            rows = cohort_order(np.asarray(ids), self.num_clients)
            before_aggregate(server, jax.tree_util.tree_map(lambda a: a[rows], trained), np.asarray(ids)[rows])
            t0 += time.perf_counter() - t  # evaluation is not part of the round
            server, store.state, own = self.timed(self._finish, server, store.state, trained, ids, self.data,
                                                  round_idx)
            metrics = with_round_metrics(metrics, own)
        return server, self._report(fetch(metrics), t0, d0)

    def run_rounds(self, server, store: ClientStore, first: int, count: int, root):
        """Rounds ``first`` .. ``first + count - 1`` in calls of at most ``rounds_per_call`` rounds:
        (server, [metrics of each round]), each as ``round`` returns them."""
        self.check_rounds(first, count)
        out = []
        while count > 0:
            n = min(count, self.rounds_per_call)
            t0, d0 = time.perf_counter(), self.device_s
            self._fit_rows(first, n, root)
            rows = self.held_rows(server, store.state, self.data, root)
            server, store.state, stacked, self.rows_buffer = self.timed(
                self._rounds, server, store.state, self.data, first, n, root, rows)
            stacked = fetch(stacked)
            for j in range(n):  # the call's time is shared equally by its rounds
                out.append(self._report({k: v[j] for k, v in stacked.items()}, t0, d0))
            first, count = first + n, count - n
        return server, out

    @property
    def keeps_rows(self) -> bool:
        """Whether a round writes its trained rows into a buffer kept from the round before (``map`` without a
        lane plan: ``ClientMap.apply_into``), instead of a new [cohort, ...] output zero-filled in every call
        (124 ms of a 2.5 s FedAvg-CNN round at cohort 50 on one CPU core, its page faults included)."""
        return self.keep_rows and self.strategy == "map" and self.lanes is None

    def held_rows(self, *args):
        """The trained rows' buffer for the next call (made on first use; None unless ``keeps_rows``). args: the
        round's arguments its shapes follow (``_rows_shape``'s: ``server, states, data, root`` here)."""
        if self.rows_buffer is not None and any(a.is_deleted() for a in jax.tree_util.tree_leaves(self.rows_buffer)):
            self.rows_buffer = None  # (donated to a call that did not return, e.g. one interrupted)
        if self.keeps_rows and self.rows_buffer is None:  # (zeros from the host: no program compiled for them)
            shapes = jax.eval_shape(self._rows_shape, *args)
            self.rows_buffer = jax.device_put(jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes),
                                              None if self.mesh is None else client_sharding(self.mesh))
        return self.rows_buffer

    def _fit_rows(self, first: int, count: int, root) -> None:
        """Poisson sampling: make ``rows`` hold the cohorts of rounds first .. first + count - 1 (drawn on the host
        as the round draws them), recompiling with more rows if one does not fit."""
        if self.sampling != "poisson":
            return
        largest = max(len(self.draw(r, root)) for r in range(first, first + count))
        if largest > self.rows:
            self.rows = poisson_rows(largest, self.row_multiple)
            self._build()

    def _report(self, metrics, t0, d0) -> dict:
        metrics = {k: np.asarray(v) for k, v in metrics.items()}
        members = metrics["client_id"] < self.num_clients  # a Poisson cohort's padding rows are left out
        if not members.all():  # (per-client rows only: the algorithm's round metrics are scalars)
            metrics = {k: v[members] if v.ndim else v for k, v in metrics.items()}
        if self.devices > 1:  # the rows were ordered for the devices (``device_balanced_order``): cohort order
            order = np.argsort(metrics["client_id"], kind="stable")
            metrics = {k: v[order] if v.ndim else v for k, v in metrics.items()}
        ids = metrics["client_id"]
        host = 1.0 - (self.device_s - d0) / max(time.perf_counter() - t0, 1e-9)
        if self.lanes is None:  # one call of the cohort's rows: map (every client its own steps) or one vmap,
            # whose lanes (a Poisson cohort's padding rows too) all run to the longest client
            rows = self.rows if self.sampling == "poisson" and self.strategy == "vmap" else 1
            work = self.report(plan_buckets(-(-self.train.counts[ids] // self.batch_size), max_lanes=len(ids),
                                            single=True, lane_multiple=rows), ids)
        else:
            work = {"padded_work": self.lane_work(ids), "buckets": len(self.lanes.segments)}
        return dict(metrics, **work, compiled_shapes=1, host_share=max(host, 0.0))

    def lane_plan(self) -> LanePlan | None:
        """The cohort's ``LanePlan`` under ``vmap`` and ``chunked`` (None under ``map``, where every client runs
        its own steps already): for the rows each device trains (the cohort's, or a Poisson cohort's padded rows,
        over the mesh's devices). ``Chunked(size)``: sorted chunks of ``size`` lanes; ``Vmap()``: ``plan_lanes``
        over the expected sorted steps of a cohort of this population, at most ``lane_segments`` segments
        (0: None, the plain strategy: one vmap call over the rows, every lane to the cohort's longest client)."""
        if self.strategy == "map":
            return None
        if self.given_plan is not None:
            return self.given_plan
        rows = (self.rows if self.sampling == "poisson" else self.cohort_size) // self.devices
        if isinstance(self.clients, Chunked):
            lanes = self.clients.lanes(rows)
            return LanePlan(((lanes, -(-rows // lanes)),), rows=rows, batch_size=self.batch_size)
        if self.lane_segments == 0:  # the plain strategy: one vmap over the rows
            return None
        steps = -(-self.train.counts // self.batch_size)
        if self.sampling == "poisson":  # a device's block: its share of the population (every d-th client)
            expected = expected_sorted_steps(steps[::self.devices], rows, rate=self.rate)
        else:  # a uniform block of a uniform cohort is a uniform subset of the population
            expected = expected_sorted_steps(steps, rows, members=rows)
        return plan_lanes(expected, batch_size=self.batch_size, max_segments=self.lane_segments,
                          overhead=self.lane_overhead)

    def lane_work(self, ids) -> float:
        """Computed / real samples of an epoch of the cohort ``ids`` (members) under the lane plan: each device's
        block of rows (a Poisson cohort's padding rows last, 0 steps) run as the plan's chunks."""
        plan = self.lanes
        assert plan is not None, "lane_work needs a lane plan"
        steps = -(-self.train.counts[ids] // self.batch_size)
        rows = plan.rows * self.devices
        steps = np.concatenate([steps, np.zeros(rows - len(steps), steps.dtype)])
        steps = steps[device_balanced_order(steps, self.devices)]  # each device's block, as trained
        done = sum(int(plan.work(block)) for block in steps.reshape(self.devices, -1))
        return done * self.batch_size / max(int(self.train.counts[ids].sum()), 1)


def cohort_order(row_ids: np.ndarray, num_clients: int) -> np.ndarray:
    """The positions of a call's member rows (id < N; id N: padding) in cohort order (ascending ids): the rows
    a backend ordered for its devices (``device_balanced_order``) put back for what reads them by cohort."""
    members = np.flatnonzero(row_ids < num_clients)
    return members[np.argsort(row_ids[members], kind="stable")]


def cohort_sample_index(train: RaggedClients, ids) -> np.ndarray:
    """The flat positions of the samples of clients ``ids`` in ``train``, client after client (int [sum of
    their counts]): the cohort's own flat store is ``train.x[index]``."""
    counts = train.counts[ids].astype(np.int64)
    starts = np.cumsum(counts) - counts  # each client's first position in the cohort's store
    return (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
            + np.repeat(train.offsets[ids].astype(np.int64), counts))


class Streamed(Stacked):
    """Rounds over a population kept on the host, each cohort sent to the device as one flat store of its own
    samples and trained in one jitted call: ``Stacked``'s round (the lane plan, every client its own step
    count, one program) without the population on the device, and ``Ragged``'s memory (only the cohort's
    samples and states move) without its buckets.

    The call's shapes are set up front: the rows (the cohort, or a Poisson cohort's size class as ``Stacked``
    sets it), the population's longest client rounded to the step grid, and the store's samples,
    ``store_samples`` (default ``buckets.cohort_samples_bound``: the cohort sample count's mean plus 4 standard
    deviations, capped at the largest possible). A cohort with more samples than that (rare: beyond 4 standard
    deviations) runs with its count rounded up to {2^k, 3 2^k} (``buckets.grid_ceil``), so a run compiles one
    program, and one more per such rounded count (``compiled_shapes``). A round's store size depends only on its
    cohort, so a resumed run runs the same programs. The persistent states live in a ``ClientStore``
    (``client_store``: device or host), gathered and scattered around the call. One round per call (the host
    streams each round's samples); within one process.
    """

    def __init__(self, alg: Algorithm, train: RaggedClients, *, client_store: str = "auto",
                 store_samples: int | None = None, **kw):
        check_choice("client_store", client_store, PLACEMENTS)
        if kw.pop("rounds_per_call", 1) != 1:
            raise ConfigError("the streamed backend runs one round per call (the host sends each round's samples); "
                              "rounds_per_call > 1 needs --backend stacked")
        if store_samples is not None and (not isinstance(store_samples, int) or store_samples < 1):
            raise ConfigError(f"store_samples={store_samples!r} must be an integer >= 1 (None: sized from the "
                              f"population)")
        self.placement = client_store
        self.shapes: set[tuple[int, int]] = set()  # (rows, cohort samples) of every call compiled so far
        super().__init__(alg, train, **kw)
        if store_samples is None:
            store_samples = (cohort_samples_bound(train.counts, rate=self.rate) if self.sampling == "poisson"
                             else cohort_samples_bound(train.counts, cohort=self.cohort_size))
        self.store_samples = store_samples

    def _place(self, train: RaggedClients):
        return None  # the population stays on the host

    def _build(self):
        self.lanes = self.lane_plan()
        self.step = step = self.make_step(self.lanes)
        self.rows_buffer = None  # (``held_rows``: its shape follows the rows, which a rebuild may change)
        length = self.length

        def cohort_rows(x, y, counts) -> ClientRows:  # the cohort's rows [rows, length] into its own store
            counts = counts.astype(jnp.int32)
            return client_rows((x, y, jnp.cumsum(counts) - counts, counts), jnp.arange(counts.shape[0]), length)

        def round_fn(server, clients, x, y, counts, ids, round_idx, root, buffer=None):
            # buffer: the trained rows' buffer (``keeps_rows``; None: none), donated, written in place and returned
            new, kept, metrics, rows = step.with_rows(server, clients, cohort_rows(x, y, counts), ids, round_idx, root,
                                                      out=buffer)
            metrics = with_round_metrics(dict(metrics, client_id=ids), step.round_metrics(server, new))
            return new, kept, metrics, None if buffer is None else rows

        def rows_shape(server, clients, x, y, counts, ids, root):  # the shapes of round_fn's trained rows
            return step.train(server, clients, cohort_rows(x, y, counts), ids, 0, root)

        def train_fn(server, clients, x, y, counts, ids, round_idx, root):
            trained, metrics = step.train(server, clients, cohort_rows(x, y, counts), ids, round_idx, root)
            return trained, dict(metrics, client_id=ids)

        def finish_fn(server, trained, counts, ids, round_idx):
            new, kept = step.aggregate(server, trained, counts, ids, round_idx)
            return new, kept, step.round_metrics(server, new)

        self._rows_shape = rows_shape
        self._round = jax.jit(round_fn, donate_argnums=(8,))
        self._train = jax.jit(train_fn)
        self._finish = jax.jit(finish_fn)

    def init(self, key, sample_x):
        """(server, store): the server state and every client's initial persistent state (``client_store``)."""
        server, clients = self.init_states(key, sample_x)
        return server, ClientStore(clients, self.placement, sharded=self.mesh is not None)

    def row_ids(self, ids) -> np.ndarray:
        """The call's rows for cohort ``ids``: its ids (a Poisson cohort's padded with id N to ``rows``), over a
        mesh in the order that gives each device its share of the local steps (``device_balanced_order``, as
        ``Stacked`` orders them on the device). -> int32 [rows]."""
        rows = self.rows if self.sampling == "poisson" else len(ids)
        row_ids = np.concatenate([ids, np.full(rows - len(ids), self.num_clients)]).astype(np.int32)
        if self.devices > 1:
            steps = -(-self.row_counts(row_ids) // self.batch_size)
            row_ids = row_ids[device_balanced_order(steps, self.devices)]
        return row_ids

    def row_counts(self, row_ids) -> np.ndarray:
        """The training samples of the rows ``row_ids`` (an empty row, id N, has none). -> int32 [rows]."""
        members = row_ids < self.num_clients
        return np.where(members, self.train.counts[np.where(members, row_ids, 0)], 0).astype(np.int32)

    def cohort_args(self, store: ClientStore, row_ids):
        """(clients, x, y, counts, row ids) of the rows ``row_ids`` (``row_ids``; id N: an empty row) on the
        device: their states and their samples in row order, padded to the sample grid."""
        members = row_ids < self.num_clients
        index = cohort_sample_index(self.train, row_ids[members])
        size = self.store_samples if len(index) <= self.store_samples else grid_ceil(len(index))
        index = np.concatenate([index, np.zeros(size - len(index), np.int64)])
        counts = self.row_counts(row_ids)
        clients = store.gather(np.where(members, row_ids, 0))
        self.shapes.add((len(row_ids), size))
        x, y = jax.device_put((self.train.x[index], self.train.y[index]), self.replicated)
        return (self.clients.place(clients), x, y, self.clients.place(counts), self.clients.place(row_ids))

    def round(self, server, store: ClientStore, round_idx: int, root, before_aggregate=None):
        """One round in one jitted call (two around ``before_aggregate``, which sees the trained rows);
        returns (server, metrics) as ``Ragged.round``."""
        self.check_rounds(round_idx)
        t0, d0 = time.perf_counter(), self.device_s
        ids = self.draw(round_idx, root)
        k = len(ids)
        if self.sampling == "poisson" and k > self.rows:  # a cohort past the size class: more rows
            self.rows = poisson_rows(k, self.row_multiple)
            self._build()
        host_rows = self.row_ids(ids)
        rows = cohort_order(host_rows, self.num_clients)  # the members' rows, in cohort order
        clients, x, y, counts, row_ids = self.cohort_args(store, host_rows)
        if before_aggregate is None:
            buffer = self.held_rows(server, clients, x, y, counts, row_ids, root)
            server, kept, metrics, self.rows_buffer = self.timed(self._round, server, clients, x, y, counts, row_ids,
                                                                 round_idx, root, buffer)
        else:
            trained, metrics = self.timed(self._train, server, clients, x, y, counts, row_ids, round_idx, root)
            t = time.perf_counter()
            before_aggregate(server, jax.tree_util.tree_map(lambda a: a[rows], trained), ids)
            t0 += time.perf_counter() - t  # evaluation is not part of the round
            server, kept, own = self.timed(self._finish, server, trained, counts, row_ids, round_idx)
            metrics = with_round_metrics(metrics, own)
        store.scatter(ids, jax.tree_util.tree_map(lambda a: a[rows], kept))
        report = self._report(fetch(metrics), t0, d0)
        return server, dict(report, compiled_shapes=len(self.shapes))

    def run_rounds(self, server, store, first: int, count: int, root):
        """Rounds ``first`` .. ``first + count - 1``, one call each: (server, [metrics of each round])."""
        self.check_rounds(first, count)
        return _Backend.run_rounds(self, server, store, first, count, root)
