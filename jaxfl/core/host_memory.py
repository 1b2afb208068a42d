"""Host memory that XLA:CPU frees stays mapped for its next allocation (glibc's malloc settings).

XLA:CPU allocates an execution's temporary buffers afresh each time it runs a program: a round's activations
and the cohort's trained models stacked for aggregation, hundreds of MB. glibc's malloc maps every block above
its mmap threshold (at most 32 MiB) anew and unmaps it on free, and allocations of a thread other than the main
one come from arenas that map their own heaps, so every page of those buffers faults on its first touch in
every round: ~95,000 faults and 0.15-0.25 s of kernel time a round for 50 FedAvg-CNN clients on one core,
7-10 % of the round (``benchmarks/RESULTS.md``). One arena, no mmap'd blocks and no trimming below 2 GiB keep
the freed blocks in the heap, where the next round's allocations find them already mapped.

The cost: memory freed in the middle of the heap stays resident until reused (the process's resident size
stays near its peak), and every thread allocates from one arena (XLA allocates per program execution, not per
operation).
"""
from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 2 ** 31 - 1  # (an int: the largest a top block may grow before it is returned)


def own_malloc_settings(environ=None) -> bool:
    """Whether the process's environment sets glibc's malloc itself (``GLIBC_TUNABLES`` naming a
    ``glibc.malloc`` tunable, or a ``MALLOC_*`` variable such as ``MALLOC_ARENA_MAX``): those are kept and
    ``keep_freed_memory`` changes nothing."""
    env = os.environ if environ is None else environ
    return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in env)


def glibc():
    """The process's C library if it is glibc (it has ``gnu_get_libc_version``), else None (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory mapped for reuse: one arena, no mmap'd blocks, no trimming of
    the heap's top below 2 GiB (see the module docstring). Call it before jax starts its CPU backend (before the
    first array or computation): a thread that has allocated already keeps its own arena. Returns whether the
    settings were made; False, changing nothing, off glibc or where the environment sets malloc itself
    (``own_malloc_settings``)."""
    libc = None if own_malloc_settings() else glibc()
    if libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
