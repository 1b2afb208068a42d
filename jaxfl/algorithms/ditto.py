"""Ditto (Li et al., ICML 2021): a global FedAvg model plus a personal model pulled toward it.

Per round, client i
1. trains the global model w from the server's w^t with CE (FedAvg's local update), and
2. trains its personal model v_i on  CE_i(v) + lambda/2 ||v - w^t||^2  (w^t: the global model it received).
The server averages the global copies (every parameter and BN statistic, sample weights); v_i never leaves
its client and is what the client predicts with. lambda = 0 gives purely local personal models; large
lambda ties them to the global model.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

import jax

from ..core.aggregation import tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..data.clients import ClientData
from ._common import ce_loss, init_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class DittoOptions(Options):
    name = "ditto"
    client_state = True
    multilabel = True
    sharing = ("a global FedAvg model", "a personal model trained toward it (lambda/2 ||v - w||^2)")
    lam: float = option(0.1, "lambda, the weight of lambda/2 ||v - w_global||^2 on the personal model", lo=0.0)


@register(DittoOptions)
def ditto(model, trainer: LocalTrainer, o: DittoOptions, ctx: RunContext) -> Algorithm:
    """Ditto with personal regularisation ``lam`` (lambda)."""
    global_loss, personal_loss = ce_loss(model), ce_loss(model, prox_mu=o.lam)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        # Clients store only their personal model: the global model's rows exist within a round only.
        return variables, {"personal": variables}

    def local_update(server, client, data: ClientData, key, info=None):
        anchor = jax.lax.stop_gradient(server["params"])
        # Personal model first, on the client's own key stream, so lambda = 0 is exactly local training.
        pv = client["personal"]
        p_params, p_stats, _, metrics = trainer.run(
            lambda p, s, x, y, w, k: personal_loss(p, s, x, y, w, k, anchor),
            pv["params"], pv["batch_stats"], trainer.tx.init(pv["params"]), data, key)
        g_params, g_stats, _, _ = trainer.run(
            global_loss, server["params"], server["batch_stats"], trainer.tx.init(server["params"]), data,
            jax.random.fold_in(key, 1))
        return {"params": g_params, "batch_stats": g_stats,
                "personal": {"params": p_params, "batch_stats": p_stats}}, metrics

    def aggregate(server, clients, weights, info=None):
        return tree_weighted_mean({k: clients[k] for k in server}, weights), {"personal": clients["personal"]}

    def predict(server, client, x, client_id=None):
        return model.apply(client["personal"], x, train=False)

    return Algorithm("ditto", init, local_update, aggregate, predict, predict)  # the trained row has "personal"
