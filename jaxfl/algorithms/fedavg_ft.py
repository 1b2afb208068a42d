"""FedAvg+FT: FedAvg, each client evaluated with the global model fine-tuned on its own data (FedSelect's baseline).

Training is FedAvg unchanged (``fedavg``): client i starts round t from the global model w^t, runs the trainer's
E epochs of weighted CE, the server averages every parameter and BN statistic with the engine's weights,
w^{t+1} = sum_i p_i w_i^t. Fine-tuning never reaches the server. In round t client i also fine-tunes the model
it received for ``ft_epochs`` epochs with the client optimizer (fresh state) and CE on its training data
(``with_fine_tuning``, shared with FedBABU):

    v_i^t = FT_{ft_epochs}(w^t; D_i),

keeps v_i^t as its personal state (a whole model: params and BN statistics) and predicts with it; a client
not sampled in a round keeps its older v_i. ``eval_point="aggregated"`` and ``"local"`` evaluate the same v_i^t.
The fine-tuning uses the client's own round key, the one its FedAvg training uses: for ft_epochs = E (the
default, ``ft_epochs=None``: the run's local epochs) it is the very run of FedAvg's local update, kept and not
computed twice (v_i^t = w_i^t); otherwise a separate ``LocalTrainer`` run from w^t whose first
min(ft_epochs, E) epochs see the same batches as the training run. ``ft_epochs=0``: plain FedAvg, evaluated
with the global model w^{t+1}. Per client: v_i. Server: FedAvg's model.

Deviations:
- The model evaluated after round t is the fine-tune of w^t, the last global model that reached the client,
  not of the w^{t+1} aggregated at the round's end: the engine evaluates a client's persistent state (or, with
  ``eval_point="local"``, the row its local update returned) and has no hook that runs after aggregation with
  the client's data. Under FedSelect's protocol (the last round is not aggregated, evaluation follows the local
  work) that is exactly "the final global model fine-tuned before evaluation".
"""
from __future__ import annotations

import dataclasses

from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._common import model_variables, with_fine_tuning
from ._registry import register
from .fedavg import FedAvgOptions, fedavg


@dataclasses.dataclass(frozen=True)
class FedAvgFTOptions(Options):
    name = "fedavg_ft"
    client_state = True
    multilabel = True
    server_optimizer = True
    sharing = ("all parameters and BN statistics (FedAvg)",
               "the global model it received, fine-tuned ft_epochs on its data (evaluated)")
    ft_epochs: int | None = option(None, "fine-tuning epochs before evaluation (default: --local-epochs; "
                                         "0: plain FedAvg)", minimum=0)


@register(FedAvgFTOptions)
def fedavg_ft(model, trainer: LocalTrainer, o: FedAvgFTOptions, ctx: RunContext) -> Algorithm:
    """FedAvg+FT: FedAvg, each client evaluated with w^t fine-tuned ``ft_epochs`` epochs (None: E)."""
    epochs = trainer.epochs if o.ft_epochs is None else o.ft_epochs
    # FedAvg's clients keep nothing: the model each starts from (and fine-tunes) is the server's
    start = lambda server, client: model_variables(server)
    return with_fine_tuning(fedavg(model, trainer, FedAvgOptions(), ctx), model, trainer, epochs, start=start,
                            reuse_trained=epochs == trainer.epochs, name="fedavg_ft")
