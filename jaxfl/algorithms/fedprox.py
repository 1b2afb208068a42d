"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term to the round's start.

    L_i(w) = CE_i(w) + mu/2 ||w - w^t||^2,   w^t = the global model the client received.

Aggregation is FedAvg's (every leaf, sample weights). mu = 0 is exactly FedAvg. FedPick's comparison uses
mu = 0.01.
"""
from __future__ import annotations

from ..engine import Algorithm
from .fedavg import keep_bn_local, masked_averaging


def fedprox(model, trainer, prox_mu: float = 0.01, local_bn: bool = False, **kw) -> Algorithm:
    """FedProx with proximal weight ``prox_mu``; ``local_bn`` keeps BatchNorm per client (FedBN-style)."""
    return masked_averaging("fedprox", model, trainer, share_param=keep_bn_local(lambda p: True, local_bn),
                            share_stats=not local_bn, prox_mu=prox_mu, **kw)
