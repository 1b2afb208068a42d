"""FedRep (Collins et al., ICML 2021): shared representation, personal head, trained in alternation.

Each round a client first trains only its head for ``head_epochs`` epochs (body frozen), then only the body
for the trainer's ``epochs`` (head frozen); the body (``encoder``) is averaged with sample weights, the head
never leaves the client. FedPick's comparison: 4 head epochs + 1 body epoch. BatchNorm statistics are
updated by every forward pass in training mode, as in PyTorch.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

import jax

from ..core.options import option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._averaging import LocalBNOption, keep_bn_local, masked_averaging
from ._common import in_part, only
from ._registry import register


def head_then_body(head_epochs: int):
    """A ``train`` hook for ``masked_averaging``: head_epochs on ``head`` only, then the trainer's epochs on
    ``encoder`` only, each phase with a fresh optimizer and its own key stream (fold_in(key, phase))."""
    def train(trainer: LocalTrainer, loss_fn, params, stats, opt_state, data, key):
        metrics = None
        for phase, (part, epochs) in enumerate((("head", head_epochs), ("encoder", trainer.epochs))):
            if epochs == 0:
                continue
            tx = only(trainer.tx, in_part(part))
            t = dataclasses.replace(trainer, tx=tx, epochs=epochs)
            params, stats, _, metrics = t.run(loss_fn, params, stats, tx.init(params), data,
                                              jax.random.fold_in(key, phase))
        return params, stats, opt_state, metrics  # opt_state: reset every round, returned unchanged
    return train


@dataclasses.dataclass(frozen=True)
class FedRepOptions(LocalBNOption):
    name = "fedrep"
    client_state = True
    multilabel = True
    server_optimizer = True
    user_dp = True
    sharing = ("encoder (body), trained after head_epochs of head-only training", "head")
    head_epochs: int = option(4, "head-only epochs before the body epochs (--local-epochs)", minimum=0)


@register(FedRepOptions)
def fedrep(model, trainer: LocalTrainer, o: FedRepOptions, ctx: RunContext) -> Algorithm:
    """FedRep: share ``encoder``, personal ``head``; ``head_epochs`` head-only epochs, then body-only epochs."""
    share = keep_bn_local(in_part("encoder"), o.local_bn)
    return masked_averaging("fedrep", model, trainer, share_param=share, share_stats=share,
                            train=head_then_body(o.head_epochs))
