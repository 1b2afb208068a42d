"""Algorithm registry: name -> (factory, options class).

Each algorithm's file holds its factory ``factory(model, trainer, **options) -> Algorithm`` and its typed,
frozen options dataclass (``jaxfl.options.Options``: defaults, per-dataset presets, checks, help text and what
it shares). ``algorithm_options`` builds an algorithm's options from a config table.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ..errors import check_choice
from ..options import Options
from .dapperfl import DapperFLOptions, dapperfl, dapperfl_masks
from .ditto import DittoOptions, ditto
from .fedavg import (FedAvgOptions, FedBNOptions, LocalOptions, fedavg, fedbn, in_part, is_batchnorm, local,
                     masked_averaging, path_mask)
from .fedavg_ft import FedAvgFTOptions, fedavg_ft
from .fedbabu import FedBABUOptions, fedbabu
from .feddc import FedDCOptions, feddc
from .feddrop import FedDropOptions, feddrop
from .feddyn import FedDynOptions, feddyn
from .fedmp import FedMPOptions, fedmp
from .fedpac import FedPACOptions, fedpac
from .fedper import FedPerOptions, fedper
from .fedpick import FedPickOptions, fedpick
from .fedprox import FedProxOptions, fedprox
from .fedrep import FedRepOptions, fedrep
from .fedrod import FedRoDOptions, fedrod
from .fedselect import FedSelectOptions, fedselect
from .fedsr import FedSROptions, fedsr
from .fedtp import FedTPOptions, fedtp
from .heterofl import HeteroFLOptions, heterofl
from .fpl import FPLOptions, fpl
from .lg_fedavg import LGFedAvgOptions, lg_fedavg
from .moon import MOONOptions, moon
from .nefl import NeFLOptions, nefl
from .pfedgp import PFedGPOptions, pfedgp
from .pfedhn import PFedHNOptions, pfedhn
from .pfedme import PFedMeOptions, pfedme
from .rfeddis import RFedDisOptions, rfeddis
from .scaffold import ScaffoldOptions, scaffold


class Registered(NamedTuple):
    factory: Callable
    options: type[Options]


REGISTRY: dict[str, Registered] = {o.name: Registered(f, o) for f, o in (
    (local, LocalOptions), (fedavg, FedAvgOptions), (fedbn, FedBNOptions), (fedprox, FedProxOptions),
    (fedper, FedPerOptions), (fedrep, FedRepOptions), (lg_fedavg, LGFedAvgOptions), (ditto, DittoOptions),
    # the five seed methods
    (fedpick, FedPickOptions), (rfeddis, RFedDisOptions), (fedselect, FedSelectOptions), (fedtp, FedTPOptions),
    (dapperfl, DapperFLOptions),
    # the baselines of their papers' tables: RFedDis, FedTP, FedSelect, DapperFL
    (scaffold, ScaffoldOptions), (feddyn, FedDynOptions), (feddc, FedDCOptions), (moon, MOONOptions),
    (fedrod, FedRoDOptions), (pfedme, PFedMeOptions), (pfedhn, PFedHNOptions),
    (fedavg_ft, FedAvgFTOptions), (fedbabu, FedBABUOptions), (fedpac, FedPACOptions),
    (feddrop, FedDropOptions), (fedmp, FedMPOptions), (heterofl, HeteroFLOptions), (nefl, NeFLOptions),
    (fedsr, FedSROptions), (fpl, FPLOptions), (pfedgp, PFedGPOptions))}
ALGORITHMS = {name: r.factory for name, r in REGISTRY.items()}
# What each algorithm shares with the server and keeps on the client (README's table is built from this).
SHARING = {name: r.options.sharing for name, r in REGISTRY.items()}
# Factories that take the dataset's client count N: the size of a per-client table on the server (FedTP,
# pFedHN), or the 1/N of a server update over all clients (SCAFFOLD, FedDyn, FedDC).
TAKES_NUM_CLIENTS = ("fedtp", "pfedhn", "scaffold", "feddyn", "feddc")


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


def build_algorithm(name: str, model, trainer, options: Options | dict | None = None, *,
                    num_clients: int | None = None, **kw):
    """Algorithm ``name`` on ``model``: options as an Options object or a dict of plain values, or keyword
    options (``build_algorithm("fedprox", model, trainer, mu=0.1)``); ``num_clients``: the dataset's client
    count, for the algorithms that keep a per-client table on the server."""
    check_choice("algorithm", name, REGISTRY)
    opts = options if isinstance(options, Options) else algorithm_options(name, dict(options or {}, **kw))
    extra = {"num_clients": num_clients} if name in TAKES_NUM_CLIENTS and num_clients is not None else {}
    return REGISTRY[name].factory(model, trainer, **opts.kwargs(), **extra)


__all__ = ["ALGORITHMS", "REGISTRY", "SHARING", "algorithm_options", "build_algorithm", "dapperfl",
           "dapperfl_masks", "ditto", "fedavg", "fedavg_ft", "fedbabu", "fedbn", "feddc", "feddrop", "feddyn",
           "fedmp", "fedpac", "fedper", "fedpick", "fedprox", "fedrep", "fedrod", "fedselect", "fedsr", "fedtp",
           "fpl", "heterofl", "in_part", "is_batchnorm", "lg_fedavg", "local", "masked_averaging", "moon", "nefl",
           "options_class", "path_mask", "pfedgp", "pfedhn", "pfedme", "rfeddis", "scaffold"]
