"""The client axis: drawing a round's cohort (k of N without replacement, ``sample_cohort``, or Poisson
sampling, ``poisson_members``), each client's PRNG stream, and running a one-client function over stacked
clients (a ``ClientMap``: ``Vmap()``, ``Map()`` or ``Chunked(size)``, optionally split over a device mesh).

Randomness: the key of client i in round t is ``fold_in(fold_in(fold_in(root, 0), t), i)``, so results do
not depend on the strategy, the chunk size, the cohort or the device layout.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Callable, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, check_choice
from .distributed import CLIENT_AXIS, place_rows


# Measured on a 2-core CPU (docs/design.md, "Client strategies"): vmap of convolutions over per-client kernels
# lowers to slow grouped convolutions there, so CPU runs clients one after another inside the jit.
DEFAULT_STRATEGY = {"cpu": "map", "gpu": "vmap", "tpu": "vmap"}


def default_strategy(platform: str | None = None) -> str:
    """The client strategy every entry point uses when none is given: ``map`` on CPU, ``vmap`` elsewhere."""
    return DEFAULT_STRATEGY.get(platform or jax.default_backend(), "vmap")


@dataclasses.dataclass(frozen=True)
class ClientMap:
    """How a one-client function runs over the leading client axis of stacked clients inside one jit (FedJAX's
    ``for_each_client`` backends, as values): ``Vmap()`` all clients at once, ``Map()`` one after another
    (``lax.map``), ``Chunked(size)`` vmap over chunks of ``size`` clients, chunks one after another (bounded
    memory). ``mesh`` (keyword, e.g. ``Vmap(mesh=client_mesh(2))`` or ``Map().on(mesh)``): a 1-D device mesh
    over which the client axis is split, each device running its own block of clients the same way (None: one
    device). Results do not depend on the map or the mesh: each client's randomness comes from its own key."""
    name: ClassVar[str] = ""
    mesh: jax.sharding.Mesh | None = dataclasses.field(default=None, kw_only=True)

    @property
    def devices(self) -> int:
        """The number of devices the client axis is split over (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.devices.size)

    def on(self, mesh: jax.sharding.Mesh | None) -> ClientMap:
        """The same map with the client axis split over ``mesh`` (None: one device)."""
        return dataclasses.replace(self, mesh=mesh)

    def apply(self, fn: Callable, bound_arg: int | None = None) -> Callable:
        """``fn`` over the leading client axis of all its arguments, on one device (``over`` splits it over the
        mesh). bound_arg: the position of an int argument [k] (e.g. sample counts) whose largest value among the
        clients run together (one client under ``Map``, all of them otherwise) ``fn`` gets as the keyword
        ``bound``: a scalar not batched under vmap, so ``fn`` can pick a static size by it
        (``trainer.epoch_permutation``)."""
        if bound_arg is not None:  # all clients of the call share the largest value
            return lambda *args: self.apply(functools.partial(fn, bound=jnp.max(args[bound_arg])))(*args)
        return self._apply(fn)

    def _apply(self, fn: Callable) -> Callable:
        raise NotImplementedError

    def apply_into(self, fn: Callable, bound_arg: int | None = None) -> Callable:
        """``apply`` whose call takes a buffer shaped like the stacked outputs first, ``(out, *args)``: ``Map``
        writes each client's outputs into its row of ``out`` in place (``out`` donated to the jit: no [k, ...]
        output is allocated and zero-filled each call); the other maps ignore it and return new outputs. Every
        row is written, so what ``out`` held changes nothing."""
        return lambda out, *args: self.apply(fn, bound_arg)(*args)

    def lanes(self, clients: int) -> int:
        """Clients of ``clients`` that one call runs side by side (vmap lanes)."""
        raise NotImplementedError

    def over(self, fn: Callable, lanes=None, bound_arg: int | None = None, into: bool = False) -> Callable:
        """fn(shared, *stacked) -> stacked outputs, one client per row. Without a mesh: ``apply``; with one,
        every device applies it to its own block of clients (``jax.shard_map``) and ``shared`` (e.g. the
        server state) is replicated. The number of clients must divide evenly.

        lanes: a ``lanes.LanePlan`` instead of the map: the returned function then takes the rows' sort key
        first, ``(shared, key, *stacked)``, and every device runs its block as the plan says (sorted by the key,
        chunks of ``vmap`` lanes one after another; ``LanePlan.apply``). bound_arg: as in ``apply`` (an index
        into ``stacked``; under a plan the largest value of each chunk of lanes). into: the returned function
        takes a buffer for the outputs after ``shared``, ``(shared, out, *stacked)`` (``apply_into``; ignored
        under a plan)."""
        def local(shared, *stacked):
            one = lambda *a, **kw: fn(shared, *a, **kw)  # noqa: E731
            out, stacked = (stacked[0], stacked[1:]) if into else (None, stacked)
            if lanes is not None:
                key, rows = stacked[0], stacked[1:]
                return lanes.apply(one, key, *rows, bound=None if bound_arg is None else rows[bound_arg])
            if into:
                return self.apply_into(one, bound_arg)(out, *stacked)
            return self.apply(one, bound_arg)(*stacked)
        mesh = self.mesh
        if mesh is None:
            return local
        P = jax.sharding.PartitionSpec

        def sharded(shared, *stacked):
            n, d = jax.tree_util.tree_leaves(stacked)[0].shape[0], mesh.devices.size
            if n % d:
                raise ValueError(f"{n} clients per round cannot be split evenly over {d} devices; "
                                 f"choose a cohort size that is a multiple of {d}")
            in_specs = (P(),) + (P(CLIENT_AXIS),) * len(stacked)
            # check_vma=False: scans inside local updates carry per-client values that start from replicated ones
            return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(CLIENT_AXIS),
                                 check_vma=False)(shared, *stacked)
        return sharded

    def place(self, tree):
        """Host rows [lanes, ...] -> device arrays, the lanes split over the mesh's devices (``place_rows``)."""
        return place_rows(tree, self.mesh)

    @property
    def replicated(self) -> jax.sharding.NamedSharding | None:
        """The sharding of an array held whole on every device of the mesh (None without one)."""
        if self.mesh is None:
            return None
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def replicate(self, tree):
        """``tree`` on every device of the mesh (unchanged without one), e.g. the server state."""
        return tree if self.mesh is None else jax.device_put(tree, self.replicated)


@dataclasses.dataclass(frozen=True)
class Vmap(ClientMap):
    name = "vmap"

    def _apply(self, fn):
        return jax.vmap(fn)

    def lanes(self, clients: int) -> int:
        return clients


@dataclasses.dataclass(frozen=True)
class Map(ClientMap):
    name = "map"

    def apply(self, fn, bound_arg=None):
        if bound_arg is not None:  # each client alone, its own value
            return lambda *args: jax.lax.map(lambda a: fn(*a, bound=a[bound_arg]), args)
        return self._apply(fn)

    def _apply(self, fn):
        return lambda *args: jax.lax.map(lambda a: fn(*a), args)

    def apply_into(self, fn, bound_arg=None):
        def run(out, *args):
            def body(j, out):
                row = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), args)
                new = fn(*row) if bound_arg is None else fn(*row, bound=row[bound_arg])
                return jax.tree_util.tree_map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, j, 0), out, new)
            return jax.lax.fori_loop(0, jax.tree_util.tree_leaves(args)[0].shape[0], body, out)
        return run

    def lanes(self, clients: int) -> int:
        return min(clients, 1)


@dataclasses.dataclass(frozen=True)
class Chunked(ClientMap):
    size: int = 8
    name = "chunked"

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"chunk_size={self.size!r} must be an integer >= 1")

    def _apply(self, fn):
        return lambda *args: jax.lax.map(lambda a: fn(*a), args, batch_size=self.size)

    def lanes(self, clients: int) -> int:
        return min(clients, self.size)


CLIENT_MAPS = {"vmap": Vmap, "map": Map, "chunked": Chunked}
STRATEGIES = tuple(CLIENT_MAPS)


def client_map(clients: ClientMap | str | None = None, chunk_size: int = 8, mesh=None) -> ClientMap:
    """A ``ClientMap`` from itself or a strategy name (``vmap`` | ``map`` | ``chunked``, the latter with chunks of
    ``chunk_size`` clients; None: ``default_strategy()``, the platform's), split over ``mesh`` if one is given
    (a given map keeps its own mesh otherwise)."""
    if isinstance(clients, ClientMap):
        return clients if mesh is None else clients.on(mesh)
    name = clients or default_strategy()
    check_choice("strategy", name, STRATEGIES)
    return (Chunked(chunk_size) if name == "chunked" else CLIENT_MAPS[name]()).on(mesh)


def map_clients(fn: Callable, clients: ClientMap | str | None = None, chunk_size: int = 8,
                bound_arg: int | None = None) -> Callable:
    """``client_map(clients, chunk_size).apply(fn, bound_arg)``: a one-client function over the leading client
    axis of all its arguments (``ClientMap.apply``)."""
    return client_map(clients, chunk_size).apply(fn, bound_arg)


def client_keys(root, round_idx, client_ids):
    """Key of client i in round t: fold_in(fold_in(fold_in(root, 0), t), i)."""
    rkey = jax.random.fold_in(jax.random.fold_in(root, 0), round_idx)
    return jax.vmap(lambda i: jax.random.fold_in(rkey, i))(client_ids)


def straggler_work(root, round_idx, client_ids, fraction: float):
    """Systems heterogeneity (FedProx, Li et al. 2020, section 5.2): each client of the round is a straggler with
    probability ``fraction``, and a straggler's share of its local epochs is work ~ U[0, 1) (so a phase of E
    epochs runs 1..E-1 of them with equal chance, ``trainer.local_epochs``); the others have work 1 (all E).

    Client i's draw in round t comes from its own stream, ``client_keys`` of the root fold_in(root, 3), so it
    does not depend on the cohort, the strategy or the device layout. client_ids: int [k] -> work float32 [k].
    """
    def one(key):
        slow, share = jax.random.split(key)
        return jnp.where(jax.random.uniform(slow) < fraction, jax.random.uniform(share), 1.0)
    return jax.vmap(one)(client_keys(jax.random.fold_in(root, 3), round_idx, client_ids)).astype(jnp.float32)


def device_balanced_order(work, devices: int):
    """An order of the k = D m rows of a cohort whose D blocks of m consecutive positions (one block a device,
    as ``ClientMap.over`` splits the client axis over a mesh) carry nearly equal work: the rows ranked by
    ``work``, largest first (ties by position), dealt to the blocks in a snake, 0, 1, ..., D-1, D-1, ..., 1, 0,
    0, 1, ..., so that any two blocks' totals differ by at most the largest row's work (in each pair of laps the
    block that got the larger row of one lap gets the smaller of the other, and the differences telescope).

    work: [k] (k a multiple of D) -> int32 [k], order[j] = the row at position j; D = 1: the identity. A numpy
    ``work`` (the host's plans) is ordered with numpy, a jax array (inside the jitted round) with jax."""
    xp = jnp if isinstance(work, jax.Array) else np
    k = work.shape[0]
    if devices == 1:
        return xp.arange(k, dtype=xp.int32)
    if k % devices:
        raise ValueError(f"{k} rows do not split into {devices} equal device blocks")
    ranked = xp.argsort(-xp.asarray(work, xp.float32), stable=True)
    j = xp.arange(k)
    lap, r = j // devices, j % devices
    block = xp.where(lap % 2 == 0, r, devices - 1 - r)
    # rank j goes to position block * m + lap: the order is the ranking read through that permutation's inverse
    return ranked[xp.argsort(block * (k // devices) + lap)].astype(xp.int32)


def sample_cohort(root, round_idx, num_clients: int, cohort_size: int):
    """Sorted ids of ``cohort_size`` = k clients drawn uniformly without replacement from N (everyone if k >= N).

    Floyd's algorithm, O(k^2) work and O(k) memory whatever N (a permutation of all N ids would cost O(N log N)
    per round: 84 ms at N = 100,000 on CPU): for t = 0..k-1, with j = N - k + t and
    r_t = randint(fold_in(key, t), 0, j + 1), add r_t to the cohort unless it is already there, else add j.
    Every k-subset is equally likely. key = fold_in(fold_in(root, 1), round).
    """
    if cohort_size >= num_clients:
        return jnp.arange(num_clients)
    key = jax.random.fold_in(jax.random.fold_in(root, 1), round_idx)
    return _floyd_draw(key, int(num_clients), int(cohort_size))


# how a round's cohort is drawn: "fixed" (k of N without replacement) | "poisson" (each client with probability q)
Sampling = Literal["fixed", "poisson"]
SAMPLINGS: tuple[Sampling, ...] = typing.get_args(Sampling)
POISSON_STREAM = 5  # fold_in(root, 5): Poisson sampling's draws (0 client keys, 1 fixed cohorts, 2 init, 3
# stragglers; 4 of the seed's key: DP noise)


def position_uniforms(key, m: int):
    """u_j ~ U[0, 1) for the positions j = 0..m-1, u_j from ``fold_in(key, j)`` alone: the first n values are the
    same for any m >= n, so padding a client's data changes no draw of its real samples. -> float32 [m]."""
    return jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, j)))(jnp.arange(m))


@functools.partial(jax.jit, static_argnums=(2, 3))  # the Ragged backend draws on the host every round
def poisson_members(root, round_idx, num_clients: int, rate: float):
    """Poisson sampling (the cohort DP-FedAvg's add/remove accounting assumes): client i joins round t iff
    u_i < q, u_i ~ U[0, 1) from its own stream (``client_keys`` of the root fold_in(root, 5)), independently of
    the others; the cohort's size is Binomial(N, q). O(N) draws a round. -> bool [N]."""
    keys = client_keys(jax.random.fold_in(root, POISSON_STREAM), round_idx, jnp.arange(num_clients))
    return jax.vmap(jax.random.uniform)(keys) < rate


def poisson_cohort(root, round_idx, num_clients: int, rate: float, rows: int):
    """The Poisson cohort of round t as ``rows`` = R rows: its members' ids sorted, then N (padding) in the
    rows left over (members past R are cut off: R must be at least the cohort's size). -> int32 [R]."""
    member = poisson_members(root, round_idx, num_clients, rate)
    return jnp.nonzero(member, size=rows, fill_value=num_clients)[0].astype(jnp.int32)


def poisson_rows(count: int, multiple: int = 8) -> int:
    """Rows a Poisson cohort of ``count`` clients is padded to: ``count`` rounded up to ``multiple`` (at least
    one multiple), so that a run compiles one aggregation per size class, not per size."""
    return max(multiple, -(-count // multiple) * multiple)


@functools.partial(jax.jit, static_argnums=(1, 2))  # jitted: the Ragged backend calls it on the host every round
def _floyd_draw(key, n: int, k: int):
    def draw(t, chosen):
        j = n - k + t
        r = jax.random.randint(jax.random.fold_in(key, t), (), 0, j + 1)
        return chosen.at[t].set(jnp.where(jnp.any(chosen == r), j, r))

    return jnp.sort(jax.lax.fori_loop(0, k, draw, jnp.full((k,), -1, jnp.int32)))
