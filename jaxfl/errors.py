"""Errors jaxfl raises for bad input; the CLI prints them as one line."""


class JaxflError(Exception):
    """Base class: a user-facing error whose message is the whole explanation; ``exit_code`` is the process's
    exit status when it ends a command (2: bad input)."""
    exit_code = 2


class ConfigError(JaxflError, ValueError):
    """A configuration value is unknown or out of range."""


class DataError(JaxflError, ValueError):
    """Data is missing, malformed, or cannot be partitioned as asked."""


class NonFiniteError(JaxflError, FloatingPointError):
    """Training produced NaN or Inf; the message names the round and the clients."""


class RunIOError(JaxflError, OSError):
    """Writing a run's outputs failed (disk full, file-size limit, I/O error): a fault, not bad input (exit 1);
    the message names the path and the OS error and says how to continue."""
    exit_code = 1


class DeviceMemoryError(JaxflError, MemoryError):
    """A compiled round did not fit in the device's memory: a fault of the run's size, not bad input (exit 1);
    the message says which options make the calls smaller."""
    exit_code = 1


class Stopped(JaxflError):
    """The run stopped on SIGTERM/SIGINT after a complete round; the message says how to continue."""

    def __init__(self, message: str, signum: int, round_done: int | None, where: str | None = None):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
        self.round_done = round_done  # the last complete (and checkpointed, with an --out) round; None: before any
        self.where = where or message  # where it stopped, without the way to continue


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: an exception in one line."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:limit]


def check_choice(what: str, value, allowed) -> None:
    """Raise ConfigError unless ``value`` is one of ``allowed``, listing the valid ones."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}; valid: {', '.join(map(str, allowed))}")


def check_range(what: str, value, lo, hi, *, lo_open=False) -> None:
    """Raise ConfigError unless lo <= value <= hi (lo < value if lo_open)."""
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ConfigError(f"{what}={value!r} is outside {bracket}{lo}, {hi}]")
