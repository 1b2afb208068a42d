"""FedBN (Li et al., ICLR 2021): FedAvg except that BatchNorm layers stay on their client.

Every parameter but the BatchNorm scales and biases is averaged as FedAvg does; each client keeps its BatchNorm
scale, bias and running statistics (the only state it keeps between rounds).

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

from ..core.options import Options
from ..core.types import Algorithm, RunContext
from ._averaging import masked_averaging
from ._common import is_batchnorm
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedBNOptions(Options):
    """FedBN has no options of its own."""
    name = "fedbn"
    multilabel = True
    server_optimizer = True
    user_dp = True
    sharing = ("all but BatchNorm", "BatchNorm scale/bias and statistics")


@register(FedBNOptions)
def fedbn(model, trainer, opts: FedBNOptions, ctx: RunContext) -> Algorithm:
    """FedBN: average everything except BatchNorm layers, which stay per client."""
    return masked_averaging("fedbn", model, trainer, share_param=lambda p: not is_batchnorm(p), share_stats=False)
