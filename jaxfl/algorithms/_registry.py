"""The algorithm registry: an algorithm's typed options class is its identity.

An algorithm is one file holding its ``Options`` subclass (``name``, defaults, presets, checks, help, what it
shares) and its factory ``factory(model, trainer, opts, ctx) -> Algorithm``, registered together:

    @register(FedProxOptions)
    def fedprox(model, trainer, opts: FedProxOptions, ctx: RunContext) -> Algorithm: ...

Adding an algorithm is that file plus one import line in ``jaxfl/algorithms/__init__.py``; the CLI's
``--algorithm`` choices, its ``--NAME.OPTION`` flags and config tables all come from ``REGISTRY``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ..core.options import Options
from ..core.types import Algorithm, RunContext
from ..errors import check_choice


class Registered(NamedTuple):
    factory: Callable[..., Algorithm]
    options: type[Options]


REGISTRY: dict[str, Registered] = {}


def register(options: type[Options]) -> Callable:
    """Decorator: register ``factory(model, trainer, opts, ctx)`` under ``options.name``."""
    def add(factory):
        if not options.name or options.name in REGISTRY:
            raise ValueError(f"cannot register {options.__name__}: name {options.name!r} is empty or taken")
        REGISTRY[options.name] = Registered(factory, options)
        return factory
    return add


def options_class(name: str) -> type[Options]:
    """The options dataclass of algorithm ``name`` (unknown names list the valid ones)."""
    check_choice("algorithm", name, REGISTRY)
    return REGISTRY[name].options


def algorithm_options(name: str, values: dict | Options | None = None, dataset: str | None = None) -> Options:
    """Algorithm ``name``'s typed options from ``values`` (a config table of plain values, or Options), fields
    left None filled from the ``dataset``'s preset, checked (ConfigError names ``name.field``)."""
    cls = options_class(name)
    values = values.to_dict() if isinstance(values, Options) else dict(values or {})
    return cls.from_dict(values, dataset)


def build_algorithm(spec: str | Options, model, trainer, ctx: RunContext | None = None, **values) -> Algorithm:
    """The algorithm ``spec`` on ``model``: an Options object (its class names the algorithm; fields left None
    take ``ctx.dataset``'s preset), or a name with its options as keywords of plain values
    (``build_algorithm("fedprox", model, trainer, mu=0.1)``). ctx: what the run tells factories (client count,
    rounds, dataset, base lr)."""
    ctx = ctx or RunContext()
    if isinstance(spec, Options):
        if values:
            raise TypeError("give the options as an Options object or as keywords, not both")
        opts = spec.with_preset(ctx.dataset).validate()
    else:
        opts = algorithm_options(spec, values, ctx.dataset)
    return REGISTRY[opts.name].factory(model, trainer, opts, ctx)
