"""A federated round whose cost follows the cohort's real samples, over a population of any size.

- Data: ``RaggedClients`` (every sample stored once on the host); a round gathers only its cohort.
- State: ``ClientStore`` holds only what the algorithm keeps per client between rounds (``Algorithm.init``'s
  client state: FedAvg nothing, FedBN its BatchNorm leaves), stacked [N], on the device or on the host.
- Work: the cohort is sorted by local steps and trained in buckets (``schedule.plan_buckets``); each client's
  step loop stops at its own count, so no all-padding batch is computed.

Results equal ``engine.make_round`` (one jit over padded, fully stacked clients) up to float reassociation:
per-client keys depend on the client id only, and the trained states are aggregated in cohort order.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .data.ragged import RaggedClients
from .distributed import client_sharding, fetch, from_process_rows, process_rows
from .engine import (Algorithm, RoundInfo, aggregation_weights, init_state, make_cohort_update,
                     make_evaluate, sample_cohort)
from .errors import check_choice
from .schedule import grid_ceil, padded_work, plan_buckets
from .trees import tree_bytes

PLACEMENTS = ("auto", "device", "host")


def device_memory_bytes() -> int:
    """Memory of the default device: the accelerator's limit, or the host's RAM for CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ClientStore:
    """Every client's persistent state stacked [N, ...]: jax arrays on the device, or numpy on the host.

    ``placement="auto"`` keeps it on the device when it takes at most a quarter of the device's memory and
    the run is not sharded, else on the host. ``gather(ids)`` -> the rows [k]; ``scatter(ids, rows)`` writes
    them back (in place: donated on the device, assigned on the host).
    """

    def __init__(self, state, placement: str = "auto", sharded: bool = False):
        check_choice("client_store", placement, PLACEMENTS)
        if placement == "auto":
            placement = "host" if sharded or tree_bytes(state) > device_memory_bytes() // 4 else "device"
        self.placement = placement
        self.state = state
        self.set(state)
        self._scatter = jax.jit(lambda st, ids, rows: jax.tree_util.tree_map(
            lambda a, b: a.at[ids].set(b), st, rows), donate_argnums=(0,))
        self._gather = jax.jit(lambda st, ids: jax.tree_util.tree_map(lambda a: a[ids], st))

    def set(self, state) -> None:
        """Replace the whole state (e.g. from a checkpoint)."""
        self.state = jax.device_put(state) if self.placement == "device" else fetch(state)

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


class Simulation:
    """Rounds and evaluation of ``alg`` over a ragged population (see the module docstring).

    strategy: ``map`` (one call, every client its own step count), ``vmap`` (buckets of similar clients, any
    number of lanes) or ``chunked`` (buckets of at most ``chunk_size`` lanes). ``mesh`` splits every call's
    lanes over devices (lanes are then multiples of the device count; the cohort must be one too).
    num_rounds: T, given to the algorithm in its ``RoundInfo`` (methods with schedules need it).
    """

    def __init__(self, alg: Algorithm, train: RaggedClients, *, batch_size: int, strategy: str = "map",
                 chunk_size: int = 8, cohort_size: int | None = None, weighting: str = "samples", mesh=None,
                 client_store: str = "auto", num_rounds: int | None = None):
        check_choice("client strategy", strategy, ("vmap", "map", "chunked"))
        check_choice("weighting", weighting, ("samples", "uniform"))
        check_choice("client_store", client_store, PLACEMENTS)
        self.alg, self.train, self.batch_size = alg, train, batch_size
        self.strategy, self.chunk_size, self.weighting, self.mesh = strategy, chunk_size, weighting, mesh
        self.placement = client_store
        self.num_clients = train.num_clients
        self.cohort_size = min(cohort_size or self.num_clients, self.num_clients)
        self.devices = 1 if mesh is None else mesh.devices.size
        self.num_rounds = num_rounds
        update = make_cohort_update(alg, strategy=strategy, chunk_size=chunk_size, mesh=mesh, num_rounds=num_rounds)

        def update_into(buffer, server, clients, data, ids, positions, round_idx, root):
            # train one bucket and write its rows into the cohort buffer; empty lanes (position C) are dropped
            new = update(server, clients, data, ids, round_idx, root)
            return jax.tree_util.tree_map(lambda buf, b: buf.at[positions].set(b, mode="drop"), buffer, new)

        self._update_into = jax.jit(update_into, donate_argnums=(0,))
        self._update_shape = jax.jit(update)
        self._aggregate = jax.jit(lambda server, trained, weights, ids, round_idx: alg.aggregate(
            server, trained, weights, RoundInfo(jnp.asarray(round_idx, jnp.int32), ids, num_rounds)))
        self._make_buffer = None
        self.shapes: set[tuple[int, int]] = set()  # (lanes, samples) of every bucket compiled so far

    # -- state -------------------------------------------------------------------------------------------
    def init(self, key, sample_x):
        """(server, store): the server state and every client's initial persistent state."""
        server, clients = init_state(self.alg, key, sample_x, self.num_clients)
        if self.mesh is not None:
            server = jax.device_put(server, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        return server, ClientStore(clients, self.placement, sharded=self.mesh is not None)

    def _place(self, tree):
        return place_rows(tree, self.mesh)

    # -- one round ---------------------------------------------------------------------------------------
    def plan(self, ids):
        """The buckets of cohort ``ids`` (``schedule.plan_buckets`` with this strategy's lane limits)."""
        steps = -(-self.train.counts[ids] // self.batch_size)
        max_lanes = self.chunk_size * self.devices if self.strategy == "chunked" else len(ids)
        return plan_buckets(steps, max_lanes=max_lanes, lane_multiple=self.devices, single=self.strategy == "map")

    def round(self, server, store: ClientStore, round_idx: int, root, before_aggregate=None):
        """One round: sample the cohort, train it bucket by bucket, aggregate, write back the kept states.

        Returns (server, metrics): per cohort client (cohort order = sorted ids) ``loss``, ``accuracy``,
        ``seen``, ``steps``, ``finite``, ``client_id`` and the algorithm's own; per round ``padded_work``
        (computed / real samples), ``buckets`` and ``compiled_shapes`` (distinct bucket shapes so far).
        ``before_aggregate(server, trained, ids)``, if given, sees the cohort's trained rows (stacked in cohort
        order) before aggregation (to evaluate the models right after local training).
        """
        c = self.cohort_size
        ids = np.asarray(sample_cohort(root, round_idx, self.num_clients, c))
        plan = self.plan(ids)
        buffer = None
        for b in plan:
            real = b.positions >= 0
            bid = np.where(real, ids[np.maximum(b.positions, 0)], -1)
            data = self.train.gather(bid, b.steps * self.batch_size)
            args = (server, self._place(store.gather(np.maximum(bid, 0))), self._place(data),
                    self._place(np.maximum(bid, 0).astype(np.int32)), self._place(np.where(real, b.positions, c)),
                    round_idx, root)
            if buffer is None:  # the cohort's rows, in cohort order, filled bucket by bucket
                buffer = self._empty_buffer(args, c)
            buffer = self._update_into(buffer, *args)
            self.shapes.add((b.lanes, b.steps))
        trained, metrics = buffer
        if before_aggregate is not None:
            before_aggregate(server, trained, ids)
        weights = np.asarray(aggregation_weights(self.train.counts[ids], self.weighting))
        server, kept = self._aggregate(server, trained, weights, jnp.asarray(ids, jnp.int32), round_idx)
        store.scatter(ids, kept)
        metrics = {k: np.asarray(v) for k, v in fetch(metrics).items()}
        done, real = padded_work(plan, self.train.counts[ids], self.batch_size,
                                 per_client_trips=self.strategy == "map")
        return server, dict(metrics, client_id=ids, padded_work=done / max(real, 1), buckets=len(plan),
                            compiled_shapes=len(self.shapes))

    def _empty_buffer(self, args, c):
        if self._make_buffer is None:  # the output rows' shapes do not depend on the bucket: trace once
            server, clients, data, ids, _, round_idx, root = args
            out = jax.eval_shape(self._update_shape, server, clients, data, ids, round_idx, root)
            self._make_buffer = jax.jit(
                lambda: jax.tree_util.tree_map(lambda s: jnp.zeros((c,) + s.shape[1:], s.dtype), out),
                out_shardings=None if self.mesh is None else client_sharding(self.mesh))
        return self._make_buffer()


def place_rows(tree, mesh=None):
    """Host rows [lanes, ...] -> device arrays; with a mesh, the lanes split over its devices (in a
    multi-process run each process places only the rows of its own devices)."""
    if mesh is None or not jax.tree_util.tree_leaves(tree):
        return jax.device_put(tree)
    if jax.process_count() == 1:
        return jax.device_put(tree, client_sharding(mesh))
    lanes = jax.tree_util.tree_leaves(tree)[0].shape[0]
    rows = process_rows(mesh, lanes)
    return from_process_rows(jax.tree_util.tree_map(lambda a: np.asarray(a)[rows], tree), mesh, lanes)


def make_block_evaluate(alg: Algorithm, test: RaggedClients, *, eval_batch_size: int, preprocess,
                        strategy: str = "map", chunk_size: int = 8, mesh=None, block: int = 64,
                        train: RaggedClients | None = None):
    """evaluate(server, store) -> {"loss", "accuracy", "count", diagnostics...} per client [N] (numpy), over
    blocks of ``block`` clients (a multiple of the device count), each padded to its largest test set rounded
    to the step grid of ``eval_batch_size``. train: the clients' training sets, gathered block by block the
    same way, for an algorithm that predicts from them (``Algorithm.prepare_predict``)."""
    if alg.prepare_predict is not None and train is None:
        raise ValueError(f"{alg.name} predicts from each client's training set: pass train=")
    devices = 1 if mesh is None else mesh.devices.size
    block = max(devices, -(-min(block, test.num_clients) // devices) * devices)
    fn = jax.jit(make_evaluate(alg, eval_batch_size=eval_batch_size, strategy=strategy, chunk_size=chunk_size,
                               preprocess=preprocess, mesh=mesh))

    def evaluate(server, store: ClientStore) -> dict[str, Any]:
        parts = []
        for start in range(0, test.num_clients, block):
            ids = np.arange(start, start + block)
            real = ids < test.num_clients
            bid = np.where(real, ids, -1)
            # each set padded to the block's largest, rounded to the step grid (few compiled shapes)
            rows = lambda ragged: ragged.gather(bid, eval_batch_size * grid_ceil(
                -(-int(ragged.counts[ids[real]].max()) // eval_batch_size)))
            data = rows(test)
            safe = np.where(real, ids, 0).astype(np.int32)
            extra = {"train": place_rows(rows(train), mesh)} if alg.prepare_predict is not None else {}
            m = fetch(fn(server, place_rows(store.gather(safe), mesh), place_rows(data, mesh), place_rows(safe, mesh),
                         **extra))
            parts.append({k: np.asarray(v)[real] for k, v in m.items()})
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    return evaluate
