"""The algorithms: one file each, registered by its options class (``_registry.register``).

Importing this package imports every algorithm module below, which registers it in ``REGISTRY`` (name ->
(factory, options class)); adding an algorithm is its file plus one line here. Shared pieces live in the
underscore modules: ``_common`` (losses, predictors, parameter groups), ``_averaging`` (the masked-averaging
family), ``_submodel`` (sub-model methods and device levels), ``_drift`` (SCAFFOLD/FedDyn/FedDC variates).
"""
from __future__ import annotations

from . import (apfl, dapperfl, ditto, fedala, fedamp, fedavg, fedavg_ft, fedbabu, fedbn, fedcp,  # noqa: F401
               feddbe, feddc, feddrop, feddyn, fedfomo, fedlc, fedmp, fednova, fedpac, fedper,
               fedphp, fedpick, fedproto, fedprox, fedrep, fedrod, fedselect, fedsr, fedtp, fpl,
               gpfl, heterofl, lg_fedavg, local, moon, nefl, perfedavg, pfedgp, pfedhn, pfedme,
               rfeddis, scaffold)
from ._registry import REGISTRY, Registered, algorithm_options, build_algorithm, options_class, register


__all__ = ["REGISTRY", "Registered", "algorithm_options", "build_algorithm", "options_class", "register"]
