"""XLA's persistent compilation cache for ``jaxfl run``: a run whose programs were compiled before (the same
model, batch size, bucket shapes and devices: another seed, learning rate or algorithm option of a sweep) reads
them from disk instead of compiling them again.

jax keys each entry by the program, the compile options, the devices and the jax version, so a cached executable
is the program a fresh compilation would build: a run logs the same numbers with or without the cache (tested).
The cache holds at most ``MAX_BYTES``, least recently used entries evicted first (jax's own LRU, which needs the
``filelock`` package). An entry jax cannot read or write (a file truncated by a full disk or a kill) only costs
its program's compilation: the run says so in one line (``cache_warnings``). Deleting the folder is safe.

The path is checked (``check_compile_cache``) before any work; jax is configured only in ``use_compile_cache``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from pathlib import Path

from ..errors import ConfigError
from .config import nearest_existing, writable

MAX_BYTES = 1 << 30  # 1 GiB: CPU entries are ~10 KB, an accelerator's a few MB
ENV = "JAXFL_COMPILE_CACHE"


def default_compile_cache() -> str:
    """``$JAXFL_COMPILE_CACHE`` if set, else ``$XDG_CACHE_HOME/jaxfl/xla`` (default ``~/.cache/jaxfl/xla``)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxfl", "xla")


def check_compile_cache(path: str, what: str = "--compile-cache") -> Path | None:
    """The cache folder ``path`` names (None for ``none``), checked without writing anything: an existing
    folder, or a new one whose nearest existing parent is a writable folder. Raises ConfigError otherwise."""
    if path.strip().lower() in ("none", "off", ""):
        return None
    folder = Path(path).expanduser()
    parent = nearest_existing(folder)
    if parent is None or not parent.is_dir():
        raise ConfigError(f"{what} {path!r}: {str(parent)!r} is not a folder; give a folder, or none to compile "
                          f"every program anew")
    if not writable(parent):
        raise ConfigError(f"{what} {path!r}: {str(parent)!r} is not writable; give a writable folder, or none "
                          f"to compile every program anew")
    return folder


def resolve_compile_cache(flag: str | None) -> tuple[Path | None, bool, str | None]:
    """(folder or None, whether the user named it, a note): ``--compile-cache FLAG``, else
    ``$JAXFL_COMPILE_CACHE``, both checked (ConfigError if unusable: the user asked for them); else the default
    folder, or None and a one-line note if it cannot be used (a read-only home must not stop a run)."""
    if flag is not None:
        return check_compile_cache(flag), True, None
    path, named = default_compile_cache(), bool(os.environ.get(ENV))
    if named:
        return check_compile_cache(path, f"${ENV}"), True, None
    try:
        return check_compile_cache(path, "the compile cache"), False, None
    except ConfigError as e:
        return None, False, f"compiling without a cache: {e}"


def use_compile_cache(folder: Path | None, explicit: bool) -> str | None:
    """Turn on jax's persistent compilation cache in ``folder`` for this process (before its first compilation)
    and return the folder in use. A cache jax already has (``JAX_COMPILATION_CACHE_DIR``, or set in code) is
    kept unless ``explicit`` (the user named a folder: ``--compile-cache`` or ``$JAXFL_COMPILE_CACHE``);
    ``folder`` None turns it off."""
    import jax
    current = jax.config.jax_compilation_cache_dir
    if current and not explicit:
        return current
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # cache every program: a run's many small ones (one per bucket shape, evaluation, init) add up
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if importlib.util.find_spec("filelock") is not None:  # jax's eviction locks the folder with it
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(folder)


@contextlib.contextmanager
def cache_warnings(folder: str | None, say):
    """Within the block, jax's warnings about cache entries it cannot read or write (one per program, each with
    a traceback-like source line) become one line through ``say`` (the first), naming the folder and the fix."""
    previous = warnings.showwarning
    told = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "persistent compilation cache entry" not in str(message):
            return previous(message, category, filename, lineno, file, line)
        if not told:
            told.append(message)
            say(f"warning: the compile cache {folder} has entries jax cannot read or write ({message}); their "
                f"programs are compiled anew, with the same numbers; delete the folder to clear it, or run with "
                f"--compile-cache none")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous
