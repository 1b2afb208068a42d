"""LG-FedAvg (Liang et al. 2020): personal local representations (body), a shared global head.

Every leaf under ``encoder`` stays on its client; every leaf under ``head`` is averaged with sample
weights. The first ``warmup_rounds`` rounds average everything (full FedAvg), as FedPick's comparison does
on Office and DomainNet (20 rounds).
"""
from __future__ import annotations

from ..engine import Algorithm
from .fedavg import in_part, keep_bn_local, masked_averaging


def lg_fedavg(model, trainer, warmup_rounds: int = 0, local_bn: bool = False, **kw) -> Algorithm:
    """LG-FedAvg: share ``head``, keep ``encoder`` personal, after ``warmup_rounds`` of full averaging."""
    share = keep_bn_local(in_part("head"), local_bn)
    return masked_averaging("lg_fedavg", model, trainer, share_param=share, share_stats=share,
                            warmup_rounds=warmup_rounds, **kw)
