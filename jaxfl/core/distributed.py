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


def check_launch(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """ConfigError unless the three launch options describe a run: num_processes >= 1, process_id in
    [0, num_processes), and with more than one process a "host:port" coordinator; with one process (or none
    given) a process id other than 0 or a coordinator is refused, not ignored (the host that forgot
    ``--num-processes`` would otherwise train the whole run alone). Cheap: no jax."""
    n = 1 if num_processes is None else num_processes
    if n < 1:
        raise ConfigError(f"num_processes={n} must be >= 1")
    if n == 1:
        if process_id not in (None, 0) or coordinator_address:
            given = "--process-id" if process_id not in (None, 0) else "--coordinator-address"
            raise ConfigError(f"{given} is for a run of several processes; add --num-processes N (N > 1), the same "
                              f"for every process")
        return
    if process_id is None or not 0 <= process_id < n:
        raise ConfigError(f"process_id={process_id} must be in [0, {n})")
    if not coordinator_address or ":" not in coordinator_address:
        raise ConfigError(f"coordinator_address={coordinator_address!r} must be 'host:port' of process 0")


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join a run of ``num_processes`` processes (``jax.distributed.initialize``); call before any jax work.

    ``coordinator_address`` is "host:port" of process 0, the same for every process; ``process_id`` in
    [0, num_processes). On CPU, cross-process collectives use gloo. ``num_processes == 1`` does nothing.
    """
    if num_processes == 1 and process_id == 0:
        return  # nothing to join (the CLI refuses a coordinator given with one process: check_launch)
    check_launch(coordinator_address, num_processes, process_id)
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
    numpy) is copied as it is. The copies of the local leaves all start before the first is waited for (one
    device-to-host latency for the tree, not one a leaf)."""
    for a in jax.tree_util.tree_leaves(tree):
        if isinstance(a, jax.Array) and a.is_fully_addressable:
            a.copy_to_host_async()

    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.array(a)
    return jax.tree_util.tree_map(one, tree)


def check_same_everywhere(values: dict) -> None:
    """ConfigError in every process unless every process passed the same ``values`` (a JSON-able dict: the run's
    resolved options), naming the fields where this process differs from process 0. Every process must call
    it; one process returns at once."""
    if jax.process_count() == 1:
        return
    import json

    from jax.experimental import multihost_utils
    mine = json.dumps(values, sort_keys=True, default=str).encode()
    longest = int(np.max(multihost_utils.process_allgather(np.array([len(mine)], np.int32))))
    padded = np.zeros(longest, np.uint8)
    padded[:len(mine)] = np.frombuffer(mine, np.uint8)
    first = bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))).rstrip(b"\0")
    theirs = json.loads(first.decode())
    ours = json.loads(mine.decode())
    diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    differs = multihost_utils.process_allgather(np.array([len(diff) > 0], np.int32))
    if diff:
        shown = ", ".join(f"{k} ({ours.get(k)!r} here, {theirs.get(k)!r} in process 0)" for k in diff[:4])
        raise ConfigError(f"process {jax.process_index()} was started with other options than process 0: {shown}"
                          f"{' ...' if len(diff) > 4 else ''}; start every process with the same options")
    if np.any(differs):
        bad = ", ".join(str(i) for i in np.flatnonzero(np.asarray(differs).reshape(-1)))
        raise ConfigError(f"process(es) {bad} were started with other options than this one (see their error "
                          f"line); start every process with the same options")


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
