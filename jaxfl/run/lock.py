"""One writer per run directory: an exclusive ``flock`` on ``DIR/.jaxfl.lock``, held for the whole run.

The OS releases a ``flock`` when its process dies (crash, SIGKILL, power loss of a local disk), so a lock
left by a dead run never blocks; the file itself stays behind and only records the last holder's pid.
Standard library only (no jax import), so it can be taken before any expensive work.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import ConfigError

LOCK_NAME = ".jaxfl.lock"


def _in_use(out: Path, pid: str) -> ConfigError:
    holder = f" (pid {pid})" if pid else ""
    return ConfigError(f"--out {str(out)!r} is in use by another jaxfl run{holder}; wait for it to finish or "
                       f"choose another folder")


def holder(out: str | Path) -> str | None:
    """The pid (as written by the holder; '' if unknown) of a live run holding ``out``'s lock, else None.
    Only reads: nothing is created."""
    path = Path(out) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it exclusively (a dead run's file)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)  # also drops the shared lock just taken


def check_free(out: str | Path) -> None:
    """ConfigError naming the holder if a live run holds ``out``; writes nothing."""
    pid = holder(out)
    if pid is not None:
        raise _in_use(Path(out), pid)


class RunLock:
    """``RunLock(out)`` creates ``out`` if needed and takes its lock (ConfigError if a live run holds it);
    ``release()`` (or leaving a ``with`` block, or the process ending) gives it back."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(self.fd, 32, 0).decode(errors="replace").strip()
            os.close(self.fd)
            raise _in_use(self.out, pid) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
