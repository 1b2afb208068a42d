"""FedBABU (Oh, Kim, Yun, ICLR 2022): federated body training under a random frozen head, then fine-tuning.

Training: the head (the ``head`` parameter group) keeps its random initialisation h^0 for the whole run; each
client trains only the body from the global model with CE (the head's learning rate is 0: ``fedrep.only`` gives
it zero updates), and the server averages the bodies with the engine's weights:

    w_i^t = SGD_E(body of w^t, head h^0 frozen; D_i),   body^{t+1} = sum_i p_i body(w_i^t),   head = h^0.

BatchNorm statistics are averaged too, those of a head with BN (jaxfl's ``MLPHead`` with hidden layers)
included, whose parameters stay frozen. The server keeps h^0 itself (never an average of copies), so it stays
bit-exact.

Evaluation: each client fine-tunes the global model it received for ``ft_epochs`` (5) epochs with CE and the
client optimizer, all parameters (``ft_part="full"``, default) or the head only (``ft_part="head"``, the
fedselect spec's note 17 reading), and is evaluated with the result. This is FedAvg+FT's ``with_fine_tuning``
(``fedavg_ft.py``): the fine-tune of the last global model the client received, w^t after round t.
Per client: the fine-tuned model (evaluated). Server: the global body and the frozen head h^0.

Deviations:
- Fine-tuning uses the client optimizer as configured (same lr as training); the official fine-tuning lr is
  1e-3 while training runs 0.1 decayed x0.1 at T/2 and 3T/4, i.e. fine-tuning at the final training lr.
- The server uses the engine's weights; the official aggregation is an unweighted mean (uniform weighting).
- FedBABU+ (server data) is not implemented.
"""
from __future__ import annotations

import dataclasses

from ..core.aggregation import tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..data.clients import ClientData
from ._common import ce_loss, in_part, init_variables, only, with_fine_tuning
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedBABUOptions(Options):
    name = "fedbabu"
    client_state = True
    multilabel = True
    sharing = ("body (encoder) and BN statistics; the head stays at its random init",
               "the global model fine-tuned ft_epochs on its data (evaluated)")
    ft_epochs: int = option(5, "fine-tuning epochs before evaluation (official: 5); 0: evaluate the global "
                               "model", minimum=0)
    ft_part: str = option("full", "what fine-tuning trains: full (official) or head", choices=("full", "head"))


def fedbabu_body(model, trainer: LocalTrainer) -> Algorithm:
    """FedBABU's federated training alone: body-only local training, body averaging, head frozen at init."""
    tx = only(trainer.tx, in_part("encoder"))
    body_trainer = dataclasses.replace(trainer, tx=tx)
    loss = ce_loss(model)

    def init(key, sample_x):
        return init_variables(model, trainer, key, sample_x), {}

    def local_update(server, client, data: ClientData, key, info=None):
        params, stats, _, metrics = body_trainer.run(loss, server["params"], server["batch_stats"],
                                                     tx.init(server["params"]), data, key)
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, trained, weights, info=None):
        params = {**server["params"], "encoder": tree_weighted_mean(trained["params"]["encoder"], weights)}
        return {"params": params, "batch_stats": tree_weighted_mean(trained["batch_stats"], weights)}, {}

    def predict(server, client, x, client_id=None):
        return model.apply(server, x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(trained, x, train=False)

    return Algorithm("fedbabu", init, local_update, aggregate, predict, predict_trained)


@register(FedBABUOptions)
def fedbabu(model, trainer: LocalTrainer, o: FedBABUOptions, ctx: RunContext) -> Algorithm:
    """FedBABU: body-only federated training under a frozen random head; evaluation after ``ft_epochs`` of
    fine-tuning (``ft_part``: "full" or "head") from the global model."""
    start = lambda server, client: server
    return with_fine_tuning(fedbabu_body(model, trainer), model, trainer, o.ft_epochs, start=start,
                            parts=None if o.ft_part == "full" else ("head",), name="fedbabu")

