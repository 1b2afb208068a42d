"""Errors jaxfl raises for bad input; the CLI prints them as one line."""


class JaxflError(Exception):
    """Base class: a user-facing error whose message is the whole explanation."""


class ConfigError(JaxflError, ValueError):
    """A configuration value is unknown or out of range."""


class DataError(JaxflError, ValueError):
    """Data is missing, malformed, or cannot be partitioned as asked."""


class NonFiniteError(JaxflError, FloatingPointError):
    """Training produced NaN or Inf; the message names the round and the clients."""


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
