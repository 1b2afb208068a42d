"""FedAvg+FT: FedAvg, each client evaluated with the global model fine-tuned on its own data.

A baseline of FedSelect's comparison (Table 1; fedselect spec section 5 and note 17: "FedAvg+FT fine-tunes
for E epochs before evaluation"). Training is FedAvg unchanged (``fedavg``): client i starts round t from
the global model w^t, runs the trainer's E epochs of weighted CE, the server averages every parameter and BN
statistic with the engine's weights, w^{t+1} = sum_i p_i w_i^t. Fine-tuning never reaches the server.

Evaluation after fine-tuning (``with_fine_tuning``, shared with FedBABU). The engine evaluates a client's
persistent state with ``predict`` (or, with ``eval_point="local"``, the row its local update returned with
``predict_trained``) and has no hook that runs after aggregation with the client's data. So in round t client i
also fine-tunes the model it received, w^t, for ``ft_epochs`` epochs with the client optimizer (fresh state) and
CE on its training data:

    v_i^t = FT_{ft_epochs}(w^t; D_i),

keeps v_i^t as its personal state and predicts with it. The model evaluated after round t is therefore the
fine-tune of the last global model that reached the client (w^t, not the w^{t+1} aggregated at the round's
end); under FedSelect's protocol (spec note 10: the last round is not aggregated, evaluation follows the local
work) that is exactly "the final global model fine-tuned before evaluation". ``eval_point="aggregated"`` and
``"local"`` evaluate the same v_i^t. A client not sampled in a round keeps its older v_i.

The fine-tuning run uses the client's own round key, the one its FedAvg training uses: for ft_epochs = E (the
default) it is the very run FedAvg's local update makes, so the trained model is kept and nothing is computed
twice (v_i^t = FedAvg's local model w_i^t); for ft_epochs != E it is a separate run of ``LocalTrainer`` from
w^t, whose first min(ft_epochs, E) epochs see the same batches as the training run.

Options: ``ft_epochs`` (None: the run's local epochs E, spec note 17; 0: plain FedAvg, evaluated with the
global model w^{t+1}). Per client: v_i (a whole model: params and BN statistics). Server: FedAvg's model.
No official code: FedSelect's authors' baseline code is not public; the fine-tuning follows FedBABU's
(jhoon-oh/FedBABU, analysis.ipynb, commit e34c15b: SGD on all parameters from the global model, CE).
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
