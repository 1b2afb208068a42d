"""FedDyn (Acar et al., ICLR 2021): federated learning with a dynamic regulariser that aligns the clients'
stationary points with the global one.

Paper (Alg. 1), server model theta^t, client i's gradient term grad_i (zero at the start), N all clients:

    theta_i = argmin CE_i(w) - <grad_i, w> + alpha/2 ||w - theta^t||^2
    grad_i <- grad_i - alpha (theta_i - theta^t);     h <- h - alpha/N sum_{i in S} (theta_i - theta^t)
    theta^{t+1} = mean_{i in S} theta_i - h / alpha

Implemented with the drift h_i = -grad_i / alpha = sum over i's rounds of (theta_i - theta^t) per client and
hbar = -h / alpha = 1/N sum_i h_i on the server, i.e. the paper's algorithm with no division by alpha:

    local loss   CE_i(w) + alpha <h_i, w> + alpha/2 ||w - theta^t||^2
    h_i   <- h_i + (theta_i - theta^t);     hbar <- hbar + 1/N sum_{i in S} (theta_i - theta^t)
    theta^{t+1} = sum_{i in S} p_i theta_i + hbar               (p_i: the engine's aggregation weights)

``alpha`` = 0.01. alpha = 0 is its alpha -> 0 limit: clients train plain CE (FedAvg's local update) but the
server still adds the mean accumulated drift hbar, so FedDyn with alpha = 0 is NOT FedAvg (its first server
model is 2 mean(theta_i) - theta^0). In its first round (h_i = 0) a client trains exactly FedProx's objective
with mu = alpha. BatchNorm running statistics are averaged as FedAvg does (they are not parameters). Every
client predicts with the server model theta.

Deviations:
- The reference divides alpha by each client's relative data size r_i = n_i N / sum_j n_j ("adaptive alpha");
  we follow the paper (one alpha), the same when clients hold equal data (the RFedDis datasets).
- The reference clips gradients at norm 10 and uses weight decay 1e-3 for every method (its FedAvg too); we
  use jaxfl's client optimizer as configured, as for every other baseline.
- The model mean uses the engine's weights (``--weighting``; uniform is the reference's mean); the drift mean
  hbar is over all N clients, uniform, as in the paper and the code.
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
from ._drift import cohort_sum_over_n
from ._registry import register


def dyn_term(params, anchor, drift, alpha: float):
    """FedDyn's extra loss alpha <h_i, w> + alpha/2 ||w - theta||^2 (= -<grad_i, w> + alpha/2 ||w - theta||^2)."""
    sq_distance = optax.tree.norm(optax.tree.sub(params, anchor), squared=True)
    return alpha * optax.tree.vdot(drift, params) + 0.5 * alpha * sq_distance


@dataclasses.dataclass(frozen=True)
class FedDynOptions(Options):
    name = "feddyn"
    client_state = True
    multilabel = True
    sharing = ("all parameters and BN statistics (the server adds the clients' mean drift)",
               "its gradient term grad_i = -alpha h_i (h_i: its accumulated drift)")
    alpha: float = option(0.01, "alpha, weight of the dynamic regulariser -<grad_i, w> + alpha/2 ||w - theta||^2",
                          lo=0.0)


@register(FedDynOptions)
def feddyn(model, trainer: LocalTrainer, o: FedDynOptions, ctx: RunContext) -> Algorithm:
    """FedDyn with regulariser weight ``alpha``; ctx.num_clients: N, the run's client count (None: every client
    takes part in every round); options: ``FedDynOptions``."""
    alpha = o.alpha
    ce = ce_loss(model)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        zeros = optax.tree.zeros_like(variables["params"])
        return dict(variables, drift_mean=zeros), {"drift": zeros}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        theta = server["params"]
        anchor, drift = jax.lax.stop_gradient(theta), jax.lax.stop_gradient(client["drift"])

        def loss_fn(p, s, xb, yb, w, k):
            loss, aux = ce(p, s, xb, yb, w, k)
            return (loss + dyn_term(p, anchor, drift, alpha) if alpha else loss), aux

        params, stats, _, metrics = trainer.run(loss_fn, theta, server["batch_stats"], trainer.tx.init(theta),
                                                data, key)
        delta = jax.tree_util.tree_map(jnp.subtract, params, theta)
        return {"params": params, "batch_stats": stats, "delta": delta,
                "drift": jax.tree_util.tree_map(jnp.add, client["drift"], delta)}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        avg = tree_weighted_mean(model_variables(clients), weights)
        drift_mean = jax.tree_util.tree_map(jnp.add, server["drift_mean"],
                                            cohort_sum_over_n(clients["delta"], weights, ctx.num_clients))
        params = jax.tree_util.tree_map(jnp.add, avg["params"], drift_mean)
        return ({"params": params, "batch_stats": avg["batch_stats"], "drift_mean": drift_mean},
                {"drift": clients["drift"]})

    return Algorithm("feddyn", init, local_update, aggregate, *global_model_predictors(model))
