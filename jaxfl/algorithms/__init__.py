"""Algorithm registry: name -> factory(model, trainer, **options) -> Algorithm."""
from __future__ import annotations

from ..errors import check_choice
from .fedavg import fedavg, fedbn, is_batchnorm, local, masked_averaging, path_mask

ALGORITHMS = {"local": local, "fedavg": fedavg, "fedbn": fedbn}


def build_algorithm(name: str, model, trainer, **options):
    """Look up an algorithm by name; unknown names list the valid ones."""
    check_choice("algorithm", name, ALGORITHMS)
    return ALGORITHMS[name](model, trainer, **options)


__all__ = ["ALGORITHMS", "build_algorithm", "fedavg", "fedbn", "local", "masked_averaging", "path_mask",
           "is_batchnorm"]
