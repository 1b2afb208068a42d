"""``NAME[:key=value,...]`` option values (``--aggregator``, ``--attack``, ``--compression``): one parser for the
rule tables of ``robust_aggregation``, ``attacks`` and ``compression``."""
from __future__ import annotations

from typing import Callable

from ..errors import ConfigError

# a parameter's check: (conversion, test, what is allowed)
Check = tuple[Callable, Callable, str]


def parse_spec(spec: str, option: str, table: dict[str, dict], checks: dict[str, Check]) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:key=value,key=value"`` -> (name, its parameters: ``table[name]``'s defaults with
    the given ones converted and checked by ``checks[key]``). ConfigError naming ``option``, the bad name, key or
    value and what is allowed."""
    name, _, rest = str(spec).partition(":")
    if name not in table:
        raise ConfigError(f"{option}={spec!r}: {name!r} is not one of {', '.join(table)}")
    params = dict(table[name])
    for item in filter(None, (t.strip() for t in rest.split(","))):
        key, eq, value = (t.strip() for t in item.partition("="))
        if not eq or key not in params:
            raise ConfigError(f"{option}={spec!r}: {item!r} is not a parameter of {name} (its parameters: "
                              f"{', '.join(params) or 'none'}; give NAME:key=value,...)")
        convert, ok, allowed = checks[key]
        try:
            v = convert(value)
        except (ValueError, OverflowError):  # (int("1.5"), int(float("inf")))
            v = None
        if v is None or not ok(v):
            raise ConfigError(f"{option}={spec!r}: {key}={value} must be {allowed}")
        params[key] = v
    return name, params
