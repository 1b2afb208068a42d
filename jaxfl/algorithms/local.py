"""Local training (SingleSet): every client trains its own model on its own data; nothing is shared.

    w_i^{t+1} = SGD_E(w_i^t; D_i)   for every client i; the server aggregates nothing.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

from ..core.options import Options
from ..core.types import Algorithm, RunContext
from ._averaging import masked_averaging
from ._registry import register


@dataclasses.dataclass(frozen=True)
class LocalOptions(Options):
    """Local training has no options."""
    name = "local"
    client_state = True
    multilabel = True
    sample_dp = True
    sharing = ("nothing", "everything")


@register(LocalOptions)
def local(model, trainer, opts: LocalOptions, ctx: RunContext) -> Algorithm:
    """SingleSet / local training: nothing is shared."""
    return masked_averaging("local", model, trainer, share_param=lambda p: False, share_stats=False)
