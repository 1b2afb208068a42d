"""FedAvg (McMahan et al., AISTATS 2017): every client trains the whole model; the server averages everything.

    w^{t+1} = sum_{i in S_t} p_i w_i^t,   p_i = n_i / sum_{j in S_t} n_j  (sample weighting; or 1/|S_t|, uniform)

over every parameter and BatchNorm statistic. Clients keep nothing between rounds and start each round from
w^t with a fresh optimizer.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

from ..core.options import Options
from ..core.types import Algorithm, RunContext
from ._averaging import masked_averaging
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedAvgOptions(Options):
    """FedAvg has no options of its own."""
    name = "fedavg"
    multilabel = True
    sample_dp = True
    server_optimizer = True
    user_dp = True
    sharing = ("all parameters and BN statistics", "nothing")


@register(FedAvgOptions)
def fedavg(model, trainer, opts: FedAvgOptions, ctx: RunContext) -> Algorithm:
    """FedAvg: average every parameter and BN statistic."""
    return masked_averaging("fedavg", model, trainer, share_param=lambda p: True, share_stats=True)
