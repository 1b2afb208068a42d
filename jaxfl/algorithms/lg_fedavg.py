"""LG-FedAvg (Liang et al. 2020): personal local representations (body), a shared global head.

Every leaf under ``encoder`` stays on its client; every leaf under ``head`` is averaged with sample
weights. The first ``warmup_rounds`` rounds average everything (full FedAvg), as FedPick's comparison does
on Office and DomainNet (20 rounds); each client then continues from the averaged encoder.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

from ..core.options import option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._averaging import LocalBNOption, keep_bn_local, masked_averaging
from ._common import in_part
from ._registry import register


@dataclasses.dataclass(frozen=True)
class LGFedAvgOptions(LocalBNOption):
    name = "lg_fedavg"
    client_state = True
    multilabel = True
    sample_dp = True
    server_optimizer = True
    sharing = ("head (after warmup_rounds of full averaging)", "encoder (body)")
    warmup_rounds: int = option(0, "rounds of full averaging before the body goes personal", minimum=0)


@register(LGFedAvgOptions)
def lg_fedavg(model, trainer: LocalTrainer, o: LGFedAvgOptions, ctx: RunContext) -> Algorithm:
    """LG-FedAvg: share ``head``, keep ``encoder`` personal, after ``warmup_rounds`` of full averaging."""
    share = keep_bn_local(in_part("head"), o.local_bn)
    return masked_averaging("lg_fedavg", model, trainer, share_param=share, share_stats=share,
                            warmup_rounds=o.warmup_rounds)
