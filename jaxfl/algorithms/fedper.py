"""FedPer (Arivazhagan et al. 2019): a shared body and a personal head.

The encoder (the body: every leaf under ``encoder``, BatchNorm included unless ``local_bn``) is averaged
with sample weights; the head (every leaf under ``head``) never leaves its client. Local training updates
both, jointly, with CE.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._averaging import LocalBNOption, keep_bn_local, masked_averaging
from ._common import in_part
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedPerOptions(LocalBNOption):
    name = "fedper"
    client_state = True
    multilabel = True
    sample_dp = True
    server_optimizer = True
    user_dp = True
    sharing = ("encoder (body)", "head")


@register(FedPerOptions)
def fedper(model, trainer: LocalTrainer, o: FedPerOptions, ctx: RunContext) -> Algorithm:
    """FedPer: share ``encoder``, keep ``head`` personal; ``local_bn`` also keeps BatchNorm personal."""
    share = keep_bn_local(in_part("encoder"), o.local_bn)
    return masked_averaging("fedper", model, trainer, share_param=share, share_stats=share)
