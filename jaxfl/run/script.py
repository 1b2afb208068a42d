"""What the scripts under ``experiments/`` and ``benchmarks/`` share with the CLI: bad input in one line
(``script: error: ...``, exit 2) before any work, a stop or a failed write in one line, never a traceback."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from ..errors import ConfigError, JaxflError, Stopped


def run_script(main, argv=None) -> int:
    """Run a script's ``main(argv)`` as the CLI runs a command: a stop signal (``Stopped``, after a complete,
    checkpointed round) and a ``JaxflError`` (bad input, a failed write) end in one line on stderr and the
    CLI's exit code (130/143, 2, 1) instead of a traceback; rerunning the same command resumes."""
    name = Path(sys.argv[0]).name
    try:
        main(argv)
    except Stopped as e:
        print(f"{name}: stopped at round {e.round_done}; rerun the same command to continue", file=sys.stderr)
        return e.exit_code
    except JaxflError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def parse_list(text: str, flag: str, kind=str, choices=None) -> list:
    """A comma-separated flag's items as ``kind``, each one of ``choices`` if given; ConfigError naming the flag."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated {kind.__name__} values") from None
    bad = [v for v in values if choices is not None and v not in choices]
    if not values or bad:
        raise ConfigError(f"{flag} {text!r}: give comma-separated values"
                          + (f" from {', '.join(map(str, choices))}" if choices is not None else ""))
    return values


def check_at_least(flag: str, value, lo, strict: bool = False) -> None:
    """ConfigError unless ``value`` (a number, or each of a list; None passes) is finite and >= lo (> lo if
    ``strict``)."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and not (math.isfinite(v) and (v > lo if strict else v >= lo)):
            raise ConfigError(f"{flag} {v!r}: give a number {'>' if strict else '>='} {lo:g}")


def check_output_file(path, flag: str) -> None:
    """ConfigError unless ``path`` can be written as a file: not a folder, in an existing writable folder."""
    if path is None:
        return
    parent = Path(path).absolute().parent
    if Path(path).is_dir() or not parent.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: give a file in an existing folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {str(path)!r}: the folder {str(parent)!r} is not writable")
