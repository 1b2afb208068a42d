"""FedDC (Gao et al., CVPR 2022): federated learning with local drift decoupling and correction.

Client i keeps a local drift h_i and a gradient-correction variate G_i; the server keeps the cloud model theta,
the global variate G and hbar = 1/N sum_i h_i (all params-sized, zero at the start). In a round client i starts
from w = theta and takes its K_i local steps on (drift penalty pulling w + h_i toward theta, SCAFFOLD's
correction as the linear term)

    L_i(w) = CE_i(w) + alpha/2 ||w + h_i - theta||^2 + <G - G_i, w>

    h_i  <- h_i + (w_i - theta)
    G_i+ =  G_i - G + (theta - w_i) / (K_i lr)          (SCAFFOLD's option II variate)
    G    <- G + 1/N sum_{i in S} (G_i+ - G_i)
    hbar <- hbar + 1/N sum_{i in S} (w_i - theta)       (the mean drift over all N clients)
    theta <- sum_{i in S} p_i w_i + hbar                (p_i: the engine's weights)

With full participation theta = mean_i (w_i + h_i), the paper's aggregation of the drift-corrected models. K_i
is the client's own number of optimizer steps this round; lr the client learning rate (option ``lr``: by default
the client optimizer's, ``--lr``: ``LocalTrainer.optimizer``, ``_common.client_lr``); ``alpha`` =
0.01. In its first round (h_i = 0, G = G_i = 0) a client trains exactly FedProx's objective with mu = alpha, but
the server adds the drift: alpha = 0 is not FedAvg (its first cloud model is 2 mean(w_i) - theta^0). BatchNorm
running statistics are averaged as FedAvg does. Every client predicts with the cloud model theta.

Deviations:
- The reference scales by each client's relative data size r_i = n_i N / sum_j n_j (alpha / r_i, G / r_i in the
  loss, r_i (G_i+ - G_i) on the server); we use r_i = 1, as SCAFFOLD and FedDyn here (the same for equal data).
- The reference uses one K for every client (epochs times the mean client's batches); here K_i is per client.
- The reference clips gradients at norm 10 and uses weight decay 1e-3 for every method (its FedAvg too); we use
  jaxfl's client optimizer as configured, as for every other baseline.
- The model mean uses the engine's weights (``--weighting``; uniform is the reference's mean).
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


def dc_term(params, anchor, drift, correction, alpha: float):
    """FedDC's extra loss alpha/2 ||w + h_i - theta||^2 + <G - G_i, w> (``correction`` = G - G_i)."""
    gap = jax.tree_util.tree_map(lambda w, h, t: w + h - t, params, drift, anchor)
    return 0.5 * alpha * optax.tree.vdot(gap, gap) + optax.tree.vdot(correction, params)


@dataclasses.dataclass(frozen=True)
class FedDCOptions(Options):
    name = "feddc"
    client_state = True
    multilabel = True
    sharing = ("all parameters and BN statistics (the server adds the clients' mean drift), and each round's "
               "change of its gradient-correction variate", "its local drift h_i and its variate G_i")
    alpha: float = option(0.01, "alpha, weight of the drift penalty alpha/2 ||w + h_i - theta||^2", lo=0.0)
    lr: float | None = option(None, "client learning rate in G_i+ = G_i - G + (theta - w_i)/(K lr) (default: the "
                              "client optimizer's)", lo=0.0, lo_open=True)


@register(FedDCOptions)
def feddc(model, trainer: LocalTrainer, o: FedDCOptions, ctx: RunContext) -> Algorithm:
    """FedDC with drift penalty ``alpha``; ctx.num_clients: N, the run's client count (None: every client takes part
    in every round); options: ``FedDCOptions``."""
    alpha, lr = o.alpha, client_lr(trainer, o.lr, "feddc")
    ce = ce_loss(model)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        zeros = optax.tree.zeros_like(variables["params"])
        return dict(variables, drift_mean=zeros, g=zeros), {"drift": zeros, "g": zeros}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        theta = server["params"]
        anchor, drift = jax.lax.stop_gradient(theta), jax.lax.stop_gradient(client["drift"])
        correction = jax.lax.stop_gradient(jax.tree_util.tree_map(jnp.subtract, server["g"], client["g"]))  # G - G_i

        def loss_fn(p, s, xb, yb, w, k):
            loss, aux = ce(p, s, xb, yb, w, k)
            return loss + dc_term(p, anchor, drift, correction, alpha), aux

        params, stats, _, metrics = trainer.run(loss_fn, theta, server["batch_stats"], trainer.tx.init(theta),
                                                data, key)
        delta = jax.tree_util.tree_map(jnp.subtract, params, theta)
        g_new = control_variate(client["g"], server["g"], theta, params, metrics["steps"], lr)
        return {"params": params, "batch_stats": stats, "delta": delta,
                "drift": jax.tree_util.tree_map(jnp.add, client["drift"], delta), "g": g_new,
                "dg": jax.tree_util.tree_map(jnp.subtract, g_new, client["g"])}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        avg = tree_weighted_mean(model_variables(clients), weights)
        drift_mean = jax.tree_util.tree_map(jnp.add, server["drift_mean"],
                                            cohort_sum_over_n(clients["delta"], weights, ctx.num_clients))
        g = jax.tree_util.tree_map(jnp.add, server["g"], cohort_sum_over_n(clients["dg"], weights, ctx.num_clients))
        params = jax.tree_util.tree_map(jnp.add, avg["params"], drift_mean)
        return ({"params": params, "batch_stats": avg["batch_stats"], "drift_mean": drift_mean, "g": g},
                {"drift": clients["drift"], "g": clients["g"]})

    return Algorithm("feddc", init, local_update, aggregate, *global_model_predictors(model))
