"""SCAFFOLD (Karimireddy et al., ICML 2020): FedAvg with control variates that correct client drift.

Server state: the global model x and the server control variate c; client state: its control variate c_i
(both params-sized, zero at the start). In round t client i starts from y_i = x and takes its K_i local steps on

    L_i(y) = CE_i(y) + <c - c_i, y>            (gradient g_i(y) + c - c_i: the corrected step of Alg. 1 l.10)

then updates its control variate with the paper's option II and sends dy_i = y_i - x, dc_i = c_i+ - c_i:

    c_i+ = c_i - c + (x - y_i) / (K_i lr)
    x   <- (1 - lr_g) x + lr_g sum_i p_i y_i   (= x + lr_g sum_i p_i dy_i,  p_i: the engine's weights)
    c   <- c + |S|/N mean_{i in S} dc_i        (= c + 1/N sum_{i in S} dc_i, N: all clients)

The correction enters as the linear loss term, so it goes through the optimizer as a gradient (with momentum
it is carried by the momentum buffer). K_i is the client's own number of optimizer steps this round (the
trainer's ``steps``; ragged clients each their own), lr the client learning rate. BatchNorm running statistics
are not parameters: they are averaged as FedAvg does and get no control variate. Every client predicts with the
global model. Options: ``global_lr`` lr_g = 1; ``lr``: by default the client optimizer's (``--lr``,
``LocalTrainer.optimizer``; ``_common.client_lr``); pass it for a trainer built from another optax transformation.

Deviations:
- The reference scales c by each client's relative data size r_i = n_i N / sum_j n_j (c / r_i in the loss,
  r_i dc_i on the server); we follow the paper (r_i = 1): the same for equal data, no dataset-wide counts needed.
- The reference trains a fixed number of minibatches K for every client; here clients train the engine's
  epochs and K_i is each client's real step count, which the paper's option II formula asks for.
- The reference clips gradients at norm 10 and uses weight decay 1e-3 for every method (its FedAvg too); we
  use jaxfl's client optimizer as configured, as for every other baseline here.
- The model average uses the engine's weights (``--weighting``); the paper's 1/|S| mean is uniform weighting.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import ce_loss, global_model_predictors, init_variables, model_variables
from ._common import client_lr
from ._drift import cohort_sum_over_n, control_variate
from ._registry import register


@dataclasses.dataclass(frozen=True)
class ScaffoldOptions(Options):
    name = "scaffold"
    client_state = True
    multilabel = True
    sharing = ("all parameters and BN statistics, and each round's change of its control variate",
               "its control variate c_i")
    global_lr: float = option(1.0, "server learning rate lr_g: x <- x + lr_g * mean(y_i - x)", lo=0.0, lo_open=True)
    lr: float | None = option(None, "client learning rate in c_i+ = c_i - c + (x - y_i)/(K lr) (default: the client "
                              "optimizer's)", lo=0.0, lo_open=True)


@register(ScaffoldOptions)
def scaffold(model, trainer: LocalTrainer, o: ScaffoldOptions, ctx: RunContext) -> Algorithm:
    """SCAFFOLD (option II control variates); ctx.num_clients: N, the run's client count (None: every client takes
    part in every round); options: ``ScaffoldOptions``."""
    lr, lr_g = client_lr(trainer, o.lr, "scaffold"), o.global_lr
    ce = ce_loss(model)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        zeros = optax.tree.zeros_like(variables["params"])
        return dict(variables, c=zeros), {"c": zeros}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        x = server["params"]
        correction = jax.lax.stop_gradient(jax.tree_util.tree_map(jnp.subtract, server["c"], client["c"]))  # c - c_i

        def loss_fn(p, s, xb, yb, w, k):
            loss, aux = ce(p, s, xb, yb, w, k)
            return loss + optax.tree.vdot(correction, p), aux

        y, stats, _, metrics = trainer.run(loss_fn, x, server["batch_stats"], trainer.tx.init(x), data, key)
        c_new = control_variate(client["c"], server["c"], x, y, metrics["steps"], lr)
        return {"params": y, "batch_stats": stats, "c": c_new,
                "dc": jax.tree_util.tree_map(jnp.subtract, c_new, client["c"])}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        avg = tree_weighted_mean(model_variables(clients), weights)
        params = avg["params"] if lr_g == 1.0 else jax.tree_util.tree_map(
            lambda m, x: lr_g * m + (1.0 - lr_g) * x, avg["params"], server["params"])
        dc = cohort_sum_over_n(clients["dc"], weights, ctx.num_clients)
        c = jax.tree_util.tree_map(jnp.add, server["c"], dc)
        return {"params": params, "batch_stats": avg["batch_stats"], "c": c}, {"c": clients["c"]}

    return Algorithm("scaffold", init, local_update, aggregate, *global_model_predictors(model))
