"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020): FedAvg whose clients' updates are normalised by how many steps they took.

Client i trains as in FedAvg from w^t (tau_i optimizer steps: E epochs of ceil(n_i / B) minibatches) and
reports its cumulative change and the l1 norm of its normalizing vector a_i:

    d_i = w^t - w_i,   ||a_i||_1 = sum_{s=1..tau_i} (1 - rho^s) / (1 - rho)
                              = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)

(rho: the client SGD momentum; rho = 0 gives tau_i). The server, with p_i = n_i / sum_j n_j over the cohort,

    tau_eff = sum_i p_i ||a_i||_1,   w^{t+1} = w^t - sum_i p_i (tau_eff / ||a_i||_1) d_i.

With equal step counts this is FedAvg. BatchNorm statistics are averaged as FedAvg does. Clients keep nothing.
The official code's server momentum ``gmf`` is ``--server-opt sgd --server-momentum gmf`` (FedNova composes
with the server optimizers: its aggregate is a weighted combination of the cohort's models).

Under heavy stragglers (a client running 1 of 20 epochs beside clients running all 20) tau_eff / ||a_i||_1
extrapolates a straggler's first steps up to ~18-fold and accuracy swings between rounds; FedRepo's port of the
official optimizer does the same on jaxfl's inputs (``experiments/official/fedrepo.md``, stragglers section).

Deviations:
- BatchNorm running statistics are averaged (FedAvg); the official optimizer averages only parameters.
- The FedProx variant (``mu`` > 0, which changes a_i) is not offered; ``--algorithm fedprox`` has no normalization.
- a_i assumes the client optimizer is SGD (with momentum rho = the run's ``--momentum``); under ``--optimizer
  adam`` rho is taken as 0 (a_i = tau_i), which the paper does not define.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.options import Options
from ..core.types import Algorithm, RunContext
from ._registry import register
from .fedavg import FedAvgOptions, fedavg


def normalizing_norm(steps, rho: float):
    """||a||_1 of tau local SGD steps with momentum rho: sum_{s=1..tau} (1 - rho^s) / (1 - rho) (= tau at
    rho = 0), as the official optimizer accumulates it step by step. steps: int array [...] -> float [...]."""
    tau = jnp.asarray(steps, jnp.float32)
    if rho == 0:
        return tau
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def normalized_average(params, trained, weights, a_norm):
    """w - sum_i p_i (tau_eff / ||a_i||_1) (w - w_i) with p_i = weights_i / sum_j weights_j and
    tau_eff = sum_i p_i ||a_i||_1. params: leaves [...]; trained: leaves [k, ...]; weights, a_norm: [k]."""
    p = weights / jnp.sum(weights)
    tau_eff = jnp.sum(p * a_norm)
    coef = jnp.where(a_norm > 0, p * tau_eff / jnp.where(a_norm > 0, a_norm, 1.0), 0.0)

    def one(w, wi):
        c = coef.astype(w.dtype).reshape((-1,) + (1,) * w.ndim)
        return w - jnp.sum(c * (w[None] - wi), axis=0)
    return jax.tree_util.tree_map(one, params, trained)


@dataclasses.dataclass(frozen=True)
class FedNovaOptions(Options):
    """FedNova has no options of its own (its a_i follow the client optimizer's momentum)."""
    name = "fednova"
    multilabel = True
    server_optimizer = True
    sharing = ("all parameters (normalized by local steps) and BN statistics", "nothing")


@register(FedNovaOptions)
def fednova(model, trainer, opts: FedNovaOptions, ctx: RunContext) -> Algorithm:
    """FedNova: FedAvg's local training; the server averages updates normalised by ||a_i||_1."""
    base = fedavg(model, trainer, FedAvgOptions(), ctx)
    rho = trainer.optimizer.sgd_momentum if trainer.optimizer is not None else 0.0

    def local_update(server, client, data, key, info):
        trained, metrics = base.local_update(server, client, data, key, info)
        return {**trained, "a_norm": normalizing_norm(metrics["steps"], rho)}, metrics

    def aggregate(server, trained, weights, info):
        models = {k: v for k, v in trained.items() if k != "a_norm"}
        averaged, kept = base.aggregate(server, models, weights, info)  # BN statistics; what clients keep
        params = normalized_average(server["params"], models["params"], weights.astype(jnp.float32),
                                    trained["a_norm"])
        return {**averaged, "params": params}, kept

    def predict_trained(server, trained, x, client_id=None):
        return base.predict_trained(server, {k: v for k, v in trained.items() if k != "a_norm"}, x, client_id)

    return base._replace(name="fednova", local_update=local_update, aggregate=aggregate,
                         predict_trained=predict_trained)
