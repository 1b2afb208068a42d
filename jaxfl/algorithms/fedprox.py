"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term to the round's start.

    L_i(w) = CE_i(w) + mu/2 ||w - w^t||^2,   w^t = the global model the client received.

Aggregation is FedAvg's (every leaf, sample weights). mu = 0 is exactly FedAvg. The default mu = 0.01 is
FedPick's comparison's. The paper's stragglers (systems heterogeneity: a client runs 1..E-1 of its E epochs
and still reports) are the engine's ``--stragglers`` (``core.cohort.straggler_work``), for every algorithm.

Deviations: with ``--stragglers s`` each client straggles with chance s on its own stream; the paper's code
makes exactly round(s K) of the K clients of a round stragglers.
"""
from __future__ import annotations

import dataclasses

from ..core.options import option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._averaging import LocalBNOption, keep_bn_local, masked_averaging
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedProxOptions(LocalBNOption):
    name = "fedprox"
    multilabel = True
    sample_dp = True
    server_optimizer = True
    user_dp = True
    sharing = ("as FedAvg; local loss + mu/2 ||w - w_global||^2", "nothing")
    mu: float = option(0.01, "weight of the proximal term mu/2 ||w - w_global||^2", lo=0.0)


@register(FedProxOptions)
def fedprox(model, trainer: LocalTrainer, o: FedProxOptions, ctx: RunContext) -> Algorithm:
    """FedProx with proximal weight ``mu``; ``local_bn`` keeps BatchNorm per client (FedBN-style)."""
    return masked_averaging("fedprox", model, trainer, share_param=keep_bn_local(lambda p: True, o.local_bn),
                            share_stats=not o.local_bn, prox_mu=o.mu)
