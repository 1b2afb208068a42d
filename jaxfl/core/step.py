"""One federated round over a cohort, as pure functions: ``make_step`` builds it from an ``Algorithm``.

    step(server, clients, data, ids, round, root) -> (server, kept, metrics)

trains the cohort's k clients (``Step.train``: every client's ``local_update`` with its own key and
``RoundInfo``), then weighs and aggregates them (``Step.aggregate``). ``clients`` are the cohort's persistent
states stacked [k], ``data`` their ``ClientData`` [k, M], ``ids`` [k] their client ids (sorted: the cohort
order); ``kept`` are the cohort's new persistent states. Both backends (``jaxfl.core.backends``) run this step:
``Stacked`` inside one jit with the whole population on the device, ``Ragged`` with the training split into
buckets of similar clients.
"""
from __future__ import annotations

import typing
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from ..data.clients import ClientData
from ..errors import check_choice
from .aggregation import broadcast_clients
from .cohort import ClientMap, client_keys, client_map, straggler_work
from .lanes import LanePlan
from .trainer import ClientRows
from .trees import tree_all_finite
from .types import Algorithm, RoundInfo


# how the cohort's rows are weighted in the aggregate: by training samples | equally
Weighting = Literal["samples", "uniform"]
WEIGHTINGS: tuple[Weighting, ...] = typing.get_args(Weighting)


def init_state(alg: Algorithm, key, sample_x, num_clients: int):
    """(server_state, clients): every client starts from the same initial state, stacked [num_clients]."""
    server, client = alg.init(key, sample_x)
    return server, jax.tree_util.tree_map(jnp.array, broadcast_clients(client, num_clients))


def aggregation_weights(counts, weighting: Weighting):
    """Client weights for aggregation: their sample counts (``samples``) or 1 each (``uniform``); [k] -> [k]."""
    counts = jnp.asarray(counts).astype(jnp.float32)
    return counts if weighting == "samples" else jnp.ones_like(counts)


def cohort_train(alg: Algorithm, *, clients: ClientMap | str | None = None, num_rounds: int | None = None,
                 stragglers: float = 0.0, lanes: LanePlan | None = None) -> Callable:
    """train(server, clients, data, ids, round_idx, root, out=None) -> (trained, metrics), one row per client.

    clients: the persistent states of k clients stacked [k]; data: their ClientData [k, M], or ``ClientRows``
    with rows [k, M] into a flat store (each client then gets its ``ClientRows``); ids [k]: their
    client ids (their PRNG streams, ``client_keys``, and ``RoundInfo.client_id``). The clients run by the
    ``ClientMap`` ``clients`` (``cohort.client_map``: a name is read as ``vmap`` | ``map`` | ``chunked``; None:
    the platform's default), split over its mesh's devices if it has one. metrics per client:
    ``loss``, ``accuracy``, ``seen``, ``steps`` (and what the algorithm adds) and ``finite`` (loss and new
    state all finite). num_rounds: T, for ``RoundInfo`` (algorithms with schedules need it). stragglers: the
    probability that a client is a straggler this round (``cohort.straggler_work``: its data then carries the
    share of its local epochs it runs, ``ClientData.work``); 0: every client runs all its epochs.
    lanes: a ``LanePlan`` for the cohort's rows (per device under the map's mesh), which replaces how ``clients``
    runs them: the clients sorted by their local steps run as chunks of ``vmap`` lanes, each chunk to its own
    longest client (the same per-client results: only the order of the work changes).
    out: a buffer shaped like ``(trained, metrics)``, e.g. the previous round's (donated), which ``map`` writes
    the rows into instead of allocating new ones (``ClientMap.apply_into``); its values change nothing.
    """
    clients_map = client_map(clients)

    def one(shared, client, x, y, count, key, cid, work, rows=None):
        server, round_idx = shared
        info = RoundInfo(round_idx, cid, num_rounds)
        data = ClientData(x, y, count, work) if rows is None else rows
        new, metrics = alg.local_update(server, client, data, key, info)
        return new, dict(metrics, finite=tree_all_finite(new) & jnp.isfinite(metrics["loss"]))

    def one_rows(shared, client, rows, count, key, cid, work, bound=None):
        (server, round_idx, store_x, store_y) = shared
        return one((server, round_idx), client, None, None, count, key, cid, None,
                   ClientRows(store_x, store_y, rows, count, work, bound))

    def train(server, clients, data, ids, round_idx, root, out=None):
        ids = jnp.asarray(ids, jnp.int32)
        keys = client_keys(root, round_idx, ids)
        work = straggler_work(root, round_idx, ids, stragglers) if stragglers else None
        round_idx = jnp.asarray(round_idx, jnp.int32)
        order = () if lanes is None else (lanes.steps_key(data.count, work),)  # (the plan's sort key first)
        into, buffer = out is not None, () if out is None else (out,)
        if isinstance(data, ClientRows):  # rows [k, M] into one flat store, shared by the clients
            # bound: the longest client among the lanes run together, so each epoch's shuffle sorts a length
            # near it instead of the population's longest (``trainer.epoch_permutation``)
            return clients_map.over(one_rows, lanes, bound_arg=2, into=into)(
                (server, round_idx, data.store_x, data.store_y), *buffer, *order, clients, data.rows, data.count,
                keys, ids, work)
        return clients_map.over(one, lanes, into=into)((server, round_idx), *buffer, *order, clients, data.x, data.y,
                                                       data.count, keys, ids, work)

    return train


def with_round_metrics(metrics: dict, own: dict) -> dict:
    """A round's per-client ``metrics`` and the algorithm's round metrics ``own`` in one dict; ValueError if a
    name is both (the round's value would hide the clients')."""
    clash = sorted(set(own) & set(metrics))
    if clash:
        raise ValueError(f"round metrics {', '.join(clash)} have the names of per-client metrics")
    return {**metrics, **own}


class Step(NamedTuple):
    """A round's cohort step: ``train`` then ``aggregate``; calling it runs both.

    train(server, clients, data, ids, round_idx, root, out=None) -> (trained, metrics)   (``cohort_train``)
    aggregate(server, trained, counts, ids, round_idx) -> (server, kept)          weights from the cohort's
        sample counts [k] (``aggregation_weights``), then ``Algorithm.aggregate`` with the cohort's RoundInfo
    round_metrics(before, after) -> {name: scalar}                                the algorithm's per-round
        metrics from the server state before and after the round ({} if it has none)
    """
    train: Callable
    aggregate: Callable
    round_metrics: Callable = lambda before, after: {}

    def __call__(self, server, clients, data: ClientData, ids, round_idx, root):
        return self.with_rows(server, clients, data, ids, round_idx, root)[:3]

    def with_rows(self, server, clients, data: ClientData, ids, round_idx, root, out=None):
        """The step, also returning the trained rows ``(trained, metrics)``: -> (server, kept, metrics, rows).
        out: their buffer (``cohort_train``)."""
        rows = self.train(server, clients, data, ids, round_idx, root, out=out)
        server, kept = self.aggregate(server, rows[0], data.count, ids, round_idx)
        return server, kept, rows[1], rows


def drop_padding(trained, counts):
    """The cohort's trained rows with every padding row (count 0: a row of a cohort padded to a size class,
    not a client) set to zeros, so that nothing a padding row computed can reach the aggregate (weight 0 times
    a non-finite value is not 0). trained: leaves [k, ...]; counts [k] -> leaves [k, ...]."""
    real = jnp.asarray(counts) > 0
    return jax.tree_util.tree_map(
        lambda t: jnp.where(real.reshape((-1,) + (1,) * (t.ndim - 1)), t, jnp.zeros((), t.dtype)), trained)


def make_step(alg: Algorithm, *, clients: ClientMap | str | None = None, num_rounds: int | None = None,
              weighting: Weighting = "samples", stragglers: float = 0.0, padded: bool = False,
              lanes: LanePlan | None = None) -> Step:
    """The cohort step of ``alg``: clients run by the ``ClientMap`` ``clients`` (or its name; None: the
    platform's default), split over the map's mesh if it has one (the aggregation's reductions over clients then
    become all-reduces); aggregation weights by ``weighting``; num_rounds: T, given to the algorithm in its
    ``RoundInfo``; stragglers: the chance a client runs only part of its local epochs (``cohort_train``).
    padded: the cohort may carry padding rows (count 0; Poisson sampling pads its cohort to a size class):
    they get weight 0 and zero trained rows (``drop_padding``), the algorithm's aggregate must treat a row of
    weight 0 as absent, and a cohort without a member leaves the server state as it was (unless the algorithm
    defines that round itself: ``Algorithm.aggregates_empty``). lanes: the cohort's ``LanePlan`` (``cohort_train``).
    """
    check_choice("weighting", weighting, WEIGHTINGS)  # (a typo would silently weigh uniformly)

    def aggregate(server, trained, counts, ids, round_idx):
        info = RoundInfo(jnp.asarray(round_idx, jnp.int32), jnp.asarray(ids, jnp.int32), num_rounds)
        weights = aggregation_weights(counts, weighting)
        if not padded:
            return alg.aggregate(server, trained, weights, info)
        trained, weights = drop_padding(trained, counts), jnp.where(jnp.asarray(counts) > 0, weights, 0.0)
        new, kept = alg.aggregate(server, trained, weights, info)
        if not alg.aggregates_empty:  # (a mean over no client is not a model)
            anyone = jnp.any(weights > 0)
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(anyone, a, b), new, server)
        return new, kept

    def round_metrics(before, after):
        if alg.round_metrics is None:
            return {}
        out = dict(alg.round_metrics(before, after))
        bad = sorted(name for name, v in out.items() if jnp.ndim(v) != 0)
        if bad:  # (the logs tell a round's scalars from a client's arrays by their shape)
            raise ValueError(f"{alg.name}'s round_metrics must be scalars: {', '.join(bad)} are not")
        return out

    return Step(cohort_train(alg, clients=clients, num_rounds=num_rounds, stragglers=stragglers, lanes=lanes),
                aggregate, round_metrics)
