"""FedAvg+FT: FedAvg, each client evaluated with the global model fine-tuned on its own data.

A baseline of FedSelect's comparison (Table 1; fedselect spec section 5 and note 17: "FedAvg+FT fine-tunes
for E epochs before evaluation"). Training is FedAvg unchanged (``fedavg.fedavg``): client i starts round t from
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
from typing import Callable

from ..engine import Algorithm, ClientData, LocalTrainer
from ..options import Options, option
from .fedavg import ce_loss, fedavg, in_part, model_variables
from .fedrep import only


def with_fine_tuning(base: Algorithm, model, trainer: LocalTrainer, ft_epochs: int, *, start: Callable,
                     parts: tuple[str, ...] | None = None, reuse_trained: bool = False,
                     name: str | None = None) -> Algorithm:
    """``base`` whose clients are evaluated with a model fine-tuned from the global model they received.

    start(server, base_client) -> {"params", "batch_stats"}: the model a client fine-tunes from (its round's
        starting model). parts: the parameter groups fine-tuned ("encoder", "head"; None: all).
    reuse_trained: the base's trained row *is* the fine-tune (same start, loss, epochs, key): keep it.
    Client state: {"base": the base's client state, "tuned": the fine-tuned model}; the base's server unchanged.
    The fine-tuning run uses the client's round key (so for FedAvg with ft_epochs = E it equals the training).
    """
    name = name or base.name
    if ft_epochs == 0:
        return base._replace(name=name)
    tx = trainer.tx if parts is None else only(trainer.tx, in_part(*parts))
    ft = dataclasses.replace(trainer, tx=tx, epochs=ft_epochs)
    loss = ce_loss(model)

    def init(key, sample_x):
        server, client = base.init(key, sample_x)
        return server, {"base": client, "tuned": start(server, client)}

    def local_update(server, client, data: ClientData, key, info):
        trained, metrics = base.local_update(server, client["base"], data, key, info)
        if reuse_trained:
            tuned = model_variables(trained)
        else:
            v = start(server, client["base"])
            p, s, _, ft_metrics = ft.run(loss, v["params"], v["batch_stats"], tx.init(v["params"]), data, key)
            tuned = {"params": p, "batch_stats": s}
            metrics = dict(metrics, ft_loss=ft_metrics["loss"])
        return {"base": trained, "tuned": tuned}, metrics

    def aggregate(server, trained, weights, info):
        server, clients = base.aggregate(server, trained["base"], weights, info)
        return server, {"base": clients, "tuned": trained["tuned"]}

    def predict(server, client, x, client_id=None):
        return model.apply(client["tuned"], x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(trained["tuned"], x, train=False)

    return Algorithm(name, init, local_update, aggregate, predict, predict_trained)


@dataclasses.dataclass(frozen=True)
class FedAvgFTOptions(Options):
    name = "fedavg_ft"
    sharing = ("all parameters and BN statistics (FedAvg)",
               "the global model it received, fine-tuned ft_epochs on its data (evaluated)")
    ft_epochs: int | None = option(None, "fine-tuning epochs before evaluation (default: --local-epochs; "
                                         "0: plain FedAvg)", minimum=0)


def fedavg_ft(model, trainer: LocalTrainer, **options) -> Algorithm:
    """FedAvg+FT: FedAvg, each client evaluated with w^t fine-tuned ``ft_epochs`` epochs (None: E)."""
    o = FedAvgFTOptions(**options).validate()
    epochs = trainer.epochs if o.ft_epochs is None else o.ft_epochs
    # FedAvg's clients keep nothing: the model each starts from (and fine-tunes) is the server's
    start = lambda server, client: model_variables(server)
    return with_fine_tuning(fedavg(model, trainer), model, trainer, epochs, start=start,
                            reuse_trained=epochs == trainer.epochs, name="fedavg_ft")
