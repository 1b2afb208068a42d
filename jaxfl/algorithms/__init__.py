"""Algorithm registry: name -> factory(model, trainer, **options) -> Algorithm.

Options are keyword arguments of the factory; ``algorithm_options`` picks them from a RunConfig by name.
"""
from __future__ import annotations

import inspect

from ..errors import check_choice
from .dapperfl import dapperfl, dapperfl_masks
from .ditto import ditto
from .fedavg import fedavg, fedbn, in_part, is_batchnorm, local, masked_averaging, path_mask
from .fedper import fedper
from .fedpick import fedpick, fedpick_defaults
from .fedprox import fedprox
from .fedrep import fedrep
from .fedselect import fedselect
from .fedtp import fedtp
from .lg_fedavg import lg_fedavg
from .rfeddis import rfeddis

ALGORITHMS = {"local": local, "fedavg": fedavg, "fedbn": fedbn, "fedprox": fedprox, "fedper": fedper,
              "fedrep": fedrep, "lg_fedavg": lg_fedavg, "ditto": ditto, "fedpick": fedpick,
              "rfeddis": rfeddis, "fedselect": fedselect,
              "fedtp": fedtp, "dapperfl": dapperfl}

# What each algorithm shares with the server and keeps on the client (README's table is built from this).
SHARING = {
    "local": ("nothing", "everything"),
    "fedavg": ("all parameters and BN statistics", "nothing"),
    "fedbn": ("all but BatchNorm", "BatchNorm scale/bias and statistics"),
    "fedprox": ("as FedAvg; local loss + mu/2 ||w - w_global||^2", "nothing"),
    "fedper": ("encoder (body)", "head"),
    "fedrep": ("encoder (body), trained after head_epochs of head-only training", "head"),
    "lg_fedavg": ("head (after warmup_rounds of full averaging)", "encoder (body)"),
    "ditto": ("a global FedAvg model", "a personal model trained toward it (lambda/2 ||v - w||^2)"),
    "fedpick": ("encoder and global head, without BatchNorm", "BatchNorm, the PFSM (mask net, personal and irrelevant heads)"),
    "fedselect": ("each entry while it is global for the client (unweighted per-entry mean)",
                  "entries grown into the personal mask by update size; BN statistics"),
    "dapperfl": ("everything (global model), each client's update masked by its pruning mask; pruned entries "
                 "keep the previous global value", "its pruning ratio (device level) and mask"),
    "fedtp": ("every ViT parameter but the attention Q/K/V projections; a server hypernetwork generates those",
              "its Q/K/V projections (vanilla) or its embedding row on the server (hypernet)"),
    "rfeddis": ("encoder and global evidential head, without BatchNorm", "BatchNorm, the local evidential head"),
}


# Per-dataset defaults of options a config leaves as None (FedPick's table, fedpick spec section 3).
DATASET_DEFAULTS = {"fedpick": fedpick_defaults}


def algorithm_options(name: str, config, dataset: str | None = None, num_clients: int | None = None) -> dict:
    """The factory's keyword options that ``config`` (any object with attributes) provides, by name; options
    left as None take the algorithm's default for ``dataset`` (or the factory's default). ``num_clients``
    (the dataset's real client count) fills a factory's ``num_clients`` option."""
    params = inspect.signature(ALGORITHMS[name]).parameters
    given = {k: getattr(config, k) for k, p in params.items() if p.default is not p.empty and hasattr(config, k)}
    if num_clients is not None and "num_clients" in params:
        given["num_clients"] = num_clients
    defaults = DATASET_DEFAULTS[name](dataset) if name in DATASET_DEFAULTS else {}
    return {k: (defaults.get(k) if v is None else v) for k, v in given.items()
            if v is not None or defaults.get(k) is not None}


def build_algorithm(name: str, model, trainer, **options):
    """Look up an algorithm by name; unknown names list the valid ones."""
    check_choice("algorithm", name, ALGORITHMS)
    return ALGORITHMS[name](model, trainer, **options)


__all__ = ["ALGORITHMS", "SHARING", "algorithm_options", "build_algorithm", "dapperfl", "dapperfl_masks", "ditto", "fedavg", "fedbn",
           "fedper", "fedpick", "fedselect", "fedtp", "fedprox", "fedrep", "in_part", "is_batchnorm", "lg_fedavg", "local",
           "masked_averaging", "path_mask", "rfeddis"]
