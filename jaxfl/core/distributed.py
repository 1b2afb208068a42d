"""Multi-process (multi-host) runs: one process per host, the client axis sharded over every device of every
process (a 1-D ``client_mesh`` over ``jax.devices()``, which lists the devices process by process).

The mesh helpers live here too: ``client_mesh`` (a 1-D mesh named "clients"), ``client_sharding`` (rows of
the client axis split over it) and ``place_rows`` (host rows onto the mesh).

Each process stacks and places only the rows of its own clients (``process_rows``, ``from_process_rows``);
the server state is replicated; aggregation's reductions over clients become cross-process all-reduces
inside the one jitted round. Per-client metrics are gathered to every process (``fetch``) for logging.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from ..errors import ConfigError


CLIENT_AXIS = "clients"


def client_mesh(num_devices: int | None = None, devices=None):
    """A 1-D ``jax.sharding.Mesh`` named "clients" over the first ``num_devices`` devices (default: all,
    across every host after ``jax.distributed.initialize``)."""
    devices = list(devices if devices is not None else jax.devices())
    n = num_devices or len(devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={n} must be between 1 and the {len(devices)} available devices")
    return jax.sharding.Mesh(devices[:n], (CLIENT_AXIS,))


def client_sharding(mesh):
    """Rows of the leading (client) axis split over ``mesh``'s "clients" axis."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(CLIENT_AXIS))


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask: ``taskset`` and containers limit it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_cpu_devices(n: int) -> bool:
    """Ask for ``n`` CPU devices (``jax_num_cpu_devices``) so that ``--devices n`` can split a CPU run's clients
    over its cores: one device per core runs its block of clients on its own thread. Only for 1 < n <=
    ``cpu_cores()`` and before jax starts its backends (else returns False and changes nothing); on a machine
    with an accelerator the run's devices are the accelerators and this changes nothing either."""
    if not 1 < n <= cpu_cores():
        return False
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backends have started: the device count is fixed
        return False
    return True


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join a run of ``num_processes`` processes (``jax.distributed.initialize``); call before any jax work.

    ``coordinator_address`` is "host:port" of process 0, the same for every process; ``process_id`` in
    [0, num_processes). On CPU, cross-process collectives use gloo. ``num_processes == 1`` does nothing.
    """
    if num_processes < 1:
        raise ConfigError(f"num_processes={num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, {num_processes})")
    if num_processes == 1:
        return
    if not coordinator_address or ":" not in coordinator_address:
        raise ConfigError(f"coordinator_address={coordinator_address!r} must be 'host:port' of process 0")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def process_rows(mesh, num_rows: int) -> np.ndarray:
    """Sorted indices of the client rows that live on this process's devices (all rows in one process)."""
    index_map = client_sharding(mesh).addressable_devices_indices_map((num_rows,))
    return np.array(sorted({i for idx in index_map.values() for i in range(*idx[0].indices(num_rows))}), np.int64)


def from_process_rows(tree, mesh, num_rows: int):
    """Global arrays of leading size ``num_rows`` split over ``mesh``, built from this process's rows only
    (the leaves of ``tree`` hold the rows ``process_rows(mesh, num_rows)``, in order)."""
    sharding = client_sharding(mesh)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), (num_rows,) + x.shape[1:]), tree)


def fetch(tree):
    """Numpy copies of a pytree's leaves with their global values (every process must call it): an array
    split over processes is gathered from all of them, one this process holds in full (local, replicated or
    numpy) is copied as it is."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.array(a)
    return jax.tree_util.tree_map(one, tree)


def is_primary() -> bool:
    """True in the process that writes logs, plots and summaries (process 0)."""
    return jax.process_index() == 0


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
