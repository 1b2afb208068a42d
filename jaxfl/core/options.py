"""Typed algorithm options: each algorithm owns a frozen dataclass of its options in its own file.

An option is a dataclass field made with ``option(default, help, ...)``, which records its help text and the
values it allows; ``Options.validate`` checks them all and names the first bad one as ``algorithm.field``.
A subclass may set ``presets`` (dataset -> values for the fields left None: the paper's per-dataset
hyperparameters) and ``sharing`` (what the method shares with the server, what it keeps per client).

    @dataclasses.dataclass(frozen=True)
    class FedProxOptions(LocalBNOption):
        name = "fedprox"
        mu: float = option(0.01, "weight of the proximal term mu/2 ||w - w_global||^2", lo=0.0)

The CLI addresses them by algorithm (``--fedprox.mu 0.1``), config files by table (``[fedprox]``).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar

from ..errors import ConfigError


def option(default, help: str = "", *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           choices: tuple | None = None, minimum: int | None = None, hint: str = ""):
    """A dataclass field with its help text and allowed values: a number in [lo, hi] (``lo_open``: (lo, hi]),
    an integer >= ``minimum`` (``hint``: what its low values mean, for the message), or one of ``choices``; tuples
    are checked entry by entry. Algorithm options (``Options``) and run options (``jaxfl.run.config``) alike."""
    meta = {"help": help, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "minimum": minimum,
            "hint": hint}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of every algorithm's options (``name``: the algorithm's registry name)."""
    name: ClassVar[str] = ""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    preset_default: ClassVar[str | None] = None  # the preset for datasets not in ``presets``
    sharing: ClassVar[tuple[str, str]] = ("", "")
    models: ClassVar[tuple[str, ...] | None] = None  # the models the method can use (None: any Classifier)
    # the paper's client-training values for RunConfig fields a config leaves None (e.g. weight_decay)
    train_preset: ClassVar[dict[str, Any]] = {}
    # the aggregate is a (masked) weighted mean of the shared parameters: a server optimizer (``--server-opt``,
    # ``jaxfl.core.server_opt``) may take its step from it
    server_optimizer: ClassVar[bool] = False
    # the aggregate is an equal-weight mean over the cohort of a fixed set of parameter leaves (``share_mask``) of
    # the trained rows' "params", from nothing else the clients computed from their data, and clients keep only
    # what they trained themselves: DP-FedAvg's clipping and noise (``--dp-clip``, ``jaxfl.core.privacy``) apply
    user_dp: ClassVar[bool] = False
    # the client's only work on its data is one ``LocalTrainer.run`` of the run's epochs on a loss that is a mean
    # of per-sample terms (plus terms of the parameters alone), nothing else it computes from its data leaves
    # it but the trained model and its metrics: DP-SGD (``--dp-level sample``, ``jaxfl.core.dpsgd``) applies
    sample_dp: ClassVar[bool] = False
    # the aggregate treats a cohort row of weight 0 as absent (its server state and the other rows' kept states
    # as without it), so Poisson sampling (``--cohort-sampling poisson``) may pad the cohort with such rows;
    # checked for every algorithm that claims it (tests/test_baselines.py)
    poisson_sampling: ClassVar[bool] = True
    # a CPU run may split the cohort over several CPU devices (one per core) of one process; False where the
    # client update's batched LAPACK calls would run on two devices at once, which deadlocks in jaxlib's CPU
    # kernels (they share one intra-op pool and block on it: ``jaxfl.ops.gp._lower_solve``)
    cpu_device_split: ClassVar[bool] = True
    # the server state holds a row per client id of the population (a table of models or embeddings that predict
    # and aggregate read by ``client_id``): a client held out of training (``--new-clients``) has none; checked
    # for every algorithm (tests/test_evaluation.py: the server state's shapes follow N exactly when it is set)
    server_client_rows: ClassVar[bool] = False
    # what a straggler (``--stragglers``) runs only part of: the run's local epochs, or the name of an option that
    # counts the method's own local work (FedSelect: la_epochs; pFedHN, pFedGP: inner_steps; 0 there: the local epochs)
    local_work: ClassVar[str] = "local_epochs"
    # the local training draws its minibatches in a loop of its own, not ``LocalTrainer.run``'s, so training-time
    # augmentation (``--augment``, ``LocalTrainer.augment``) would not reach it: refused for these
    own_minibatches: ClassVar[bool] = False
    # the method reads labels only through ``core.metrics``' loss and score (``cross_entropy``, ``correct_count``),
    # so the multi-hot labels of a multi-label dataset (``--dataset tff_stackoverflow_tags:``) and the float
    # targets of a reconstruction task (``--dataset tff_emnist_ae:``) work; any other method is refused there
    # (tests/test_multilabel.py runs every method that sets it on multi-hot labels)
    multilabel: ClassVar[bool] = False
    # clients keep state between rounds on a model without BatchNorm (``Algorithm.init``'s client state has
    # leaves); ``keeps_client_state`` reads it, and a method whose options decide it overrides that. DP-SGD's
    # noise for --dp-epsilon depends on it (a fixed-size cohort's draw amplifies a round only where clients keep
    # nothing) and is set before the algorithm is built on the DP trainer; checked against ``init`` for every
    # algorithm and every choice of its options (tests/test_dpsgd.py), and against the built algorithm in a run
    client_state: ClassVar[bool] = False

    def keeps_client_state(self) -> bool:
        """Whether this method's clients keep state between rounds on a model without BatchNorm
        (``client_state``; overridden where an option decides it)."""
        return self.client_state

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def from_dict(cls, values: dict, dataset: str | None = None) -> "Options":
        """Options from plain values (a config table), unknown names refused; fields left None take the
        ``dataset``'s preset; then validated."""
        known = {f.name: f for f in cls.fields()}
        bad = sorted(set(values) - set(known))
        if bad:
            valid = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"unknown {cls.name} option(s) {', '.join(bad)}; {cls.name} takes: {valid}")
        typed = {k: coerce(f"{cls.name}.{k}", field_type(cls, known[k]), v) for k, v in values.items()}
        return cls(**typed).with_preset(dataset).validate()

    def with_preset(self, dataset: str | None) -> "Options":
        """Fields left None filled from the preset of ``dataset`` (None: "default", jaxfl's embedded dataset),
        or of ``preset_default`` for a dataset without one."""
        preset = self.presets.get(dataset or "default", self.presets.get(self.preset_default or "", {}))
        fill = {k: v for k, v in preset.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **fill) if fill else self

    def to_dict(self) -> dict:
        """Plain JSON values (tuples as lists)."""
        return {f.name: plain(getattr(self, f.name)) for f in self.fields()}

    # -- checks ------------------------------------------------------------------------------------------
    def validate(self) -> "Options":
        """Raise ConfigError naming ``algorithm.field=value`` and what is allowed; return self. Every field
        is checked against its ``option(...)`` limits, then the class's own ``check``."""
        for f in self.fields():
            value = getattr(self, f.name)
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                if v is not None:
                    _check(f"{self.name}.{f.name}", v, f.metadata)
        self.check()
        return self

    def check(self) -> None:
        """Checks across fields or beyond per-field limits (ConfigError); a subclass overrides it."""


def plain(value):
    """A config value as JSON holds it: tuples as lists (so a saved config compares equal after loading)."""
    return list(value) if isinstance(value, tuple) else value


MAX_INT = 2 ** 31 - 1  # counts, steps and seeds end up in int32 arrays or C longs


def check_int_size(label: str, v) -> None:
    """ConfigError for an integer (or each integer of a list) beyond ``MAX_INT`` in size."""
    for x in (v if isinstance(v, (list, tuple)) else [v]):
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_INT:
            raise ConfigError(f"{label}={x} is too large (at most {MAX_INT})")


def _check(label: str, v, meta) -> None:
    if meta.get("choices") is not None and v not in meta["choices"]:
        raise ConfigError(f"{label}={v!r} is not one of: {', '.join(map(str, meta['choices']))}")
    if isinstance(v, float) and not math.isfinite(v):  # a rate, weight or size of inf/nan is never meant
        raise ConfigError(f"{label}={v} must be a finite number")
    check_int_size(label, v)
    lo, hi, lo_open, minimum = meta.get("lo"), meta.get("hi"), meta.get("lo_open"), meta.get("minimum")
    if minimum is not None and v < minimum:
        raise ConfigError(f"{label}={v} must be at least {minimum}")
    if lo is not None or hi is not None:
        lo_ok = lo is None or (v > lo if lo_open else v >= lo)
        if not (lo_ok and (hi is None or v <= hi)):
            left = "(" if lo_open else "["
            right = f"{hi}]" if hi is not None else "inf)"
            raise ConfigError(f"{label}={v} must be a finite number in {left}{lo if lo is not None else '-inf'}, "
                              f"{right}")


def field_type(cls: type, f: dataclasses.Field) -> type:
    """The plain type of a field (``float | None`` -> float; ``tuple[float, ...]`` -> tuple)."""
    tp = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and args:
        tp = args[0]
    return typing.get_origin(tp) or tp


def accepts_none(cls: type, f: dataclasses.Field) -> bool:
    """Whether the field's type admits None (``float | None``: None means a default chosen later)."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[f.name])


def coerce(label: str, tp: type, v):
    """A config value as type ``tp`` (ints as floats, lists as tuples); a wrong type is a ConfigError naming
    ``label``."""
    if v is None:
        return None
    if tp is tuple:
        if isinstance(v, str):
            v = [x for x in v.split(",") if x.strip()]
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{label}={v!r} must be a list of numbers")
        return tuple(_number(label, x) for x in v)
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise ConfigError(f"{label}={v!r} must be true or false")
    if tp is float:
        return _number(label, v)
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{label}={v!r} must be an integer")
        return v
    if tp is str and not isinstance(v, str):
        raise ConfigError(f"{label}={v!r} must be a string")
    return v


def _number(label: str, v) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{label}={v!r} must be a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}={v!r} must be a number") from None
