"""Stop signals and fail points: how a run and a sweep end on SIGTERM/SIGINT, and where a test delivers them.

A stop signal never interrupts a write: the handler only records it, and the run checks the record at the
places where stopping loses nothing (after a round's checkpoint, before the first round, between a sweep's
seeds). ``stop_signals`` is re-entrant, so the CLI can hold it over a whole sweep (data loading, compilation,
rounds, evaluation, summary, plot, the gaps between seeds) while ``runner.train`` holds it over one run.

Fail points (``failpoint(name)``) are named places in a run where the fault-injection tests deliver a signal
to the process, the way FoundationDB's and TiKV's fail points do: with ``JAXFL_FAILPOINT=NAME:SIGNAL[:N]``
(e.g. ``summary:TERM``, ``round:KILL:3``) the N-th time (default 1) the run reaches NAME it sends itself
SIGNAL. Unset (always, outside tests), a fail point is one dictionary lookup.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

FAILPOINT_ENV = "JAXFL_FAILPOINT"
# every place a run can be stopped, in the order a sweep reaches them; the fault-injection tests cover each
FAILPOINTS = ("load", "start", "round", "evaluate", "checkpoint", "summary", "plot", "seed")
_active: list[list[int]] = []  # the records of the stop_signals contexts entered (the outermost first)
_reached: dict[str, int] = {}


@contextlib.contextmanager
def stop_signals():
    """A list that gets the signal number when SIGTERM or SIGINT arrives; the caller stops where it checks it.
    A second signal of the same kind acts as it would have without the handler (kills / KeyboardInterrupt).
    Nested uses share the outermost one's list. Handlers are installed only in the main thread, and the
    previous ones restored on exit."""
    if _active:
        yield _active[0]
        return
    stop: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handle(signum, frame):
        stop.append(signum)
        signal.signal(signum, previous[signum])

    for s in previous:
        signal.signal(s, handle)
    _active.append(stop)
    try:
        yield stop
    finally:
        _active.remove(stop)
        for s, h in previous.items():
            signal.signal(s, h)


def signal_name(signum: int) -> str:
    """15 -> "SIGTERM"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failpoint(name: str) -> None:
    """Send this process the signal ``JAXFL_FAILPOINT`` names when the run reaches ``name`` for the N-th time
    (module docstring); nothing when it is unset or names another place."""
    spec = os.environ.get(FAILPOINT_ENV)
    if not spec:
        return
    where, sig, *count = spec.split(":")
    if where not in FAILPOINTS:
        raise ValueError(f"{FAILPOINT_ENV}={spec!r}: the fail points are {', '.join(FAILPOINTS)}")
    if where != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == (int(count[0]) if count else 1):
        # to the main thread, where Python runs signal handlers: a signal sent to the process may land on another
        # thread (jax's), and two such signals arriving before the main thread looks are handled as one
        signal.pthread_kill(threading.main_thread().ident, getattr(signal, "SIG" + sig))
