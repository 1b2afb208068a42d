"""FedLC (Zhang et al., ICML 2022, "Federated Learning with Label Distribution Skew via Logits Calibration"):
FedAvg whose clients train on logits lowered by how rare each class is on the client.

Client i, with n_{i,c} real training samples of class c, trains the global model w^t on

    L_i = mean_b CE(z_b - delta_i, y_b),   delta_{i,c} = tau * max(n_{i,c}, 1e-8)^(-1/4)

(``losses.logit_calibration``; z the model's logits), and the server averages as FedAvg (every parameter and
BN statistic, the engine's weights). Clients keep nothing; every client predicts with the global model's plain
logits. tau = 0 is FedAvg.

Reference: no official code is published; read against FL-bench (KarhouTam/FL-bench @ 06e658bc,
``src/client/fedlc.py``) and PFLlib (TsingZ0/PFLlib @ d832e76f, ``clientlc.py``).

Deviations:
- The paper's loss leaves the target class out of the softmax's denominator; that loss is unbounded below
  (FL-bench issue #5: training collapses). Here, as in FL-bench and PFLlib, the denominator is the ordinary
  softmax's.
- Counts are the client's own (paper, FL-bench), not PFLlib's counts summed over all clients; an absent
  class counts as 1e-8 (FL-bench), so its offset is 100 tau, finite.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, batch_of
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.losses import class_counts, logit_calibration
from ._common import global_model_predictors, init_variables, model_variables, num_classes
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedLCOptions(Options):
    name = "fedlc"
    server_optimizer = True
    user_dp = True
    sharing = ("all parameters and BN statistics (FedAvg)", "nothing")
    tau: float = option(1.0, "calibration strength: logits are lowered by tau * n_c^(-1/4) in training", lo=0.0)


def calibrated_ce_loss(model):
    """loss_fn(params, stats, x, y, w, key, offsets) -> (mean_w CE(z - offsets, y), (new_stats, z)): the
    LocalTrainer contract, with the plain logits z returned (the training accuracy is the plain one).
    offsets [C] (``losses.logit_calibration``)."""
    def loss_fn(params, stats, x, y, w, key, offsets):
        logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                      mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        loss = weighted_mean_loss(cross_entropy(logits - offsets, y), w)
        return loss, (updated["batch_stats"], logits)
    return loss_fn


@register(FedLCOptions)
def fedlc(model, trainer: LocalTrainer, o: FedLCOptions, ctx: RunContext) -> Algorithm:
    """FedLC: FedAvg with logits calibrated by the client's label counts during local training."""
    loss_fn = calibrated_ce_loss(model)

    def init(key, sample_x):
        return init_variables(model, trainer, key, sample_x), {}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        x0 = trainer.preprocess(batch_of(data, jnp.zeros(1, jnp.int32))[0])  # one row (shapes only)
        c = num_classes(model, model_variables(server), x0)
        offsets = logit_calibration(class_counts(data.y, data.count, c), o.tau)
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, offsets)
        params, stats, _, metrics = trainer.run(fn, server["params"], server["batch_stats"],
                                                trainer.tx.init(server["params"]), data, key)
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, trained, weights, info=None):
        return tree_weighted_mean(model_variables(trained), weights), {}

    return Algorithm("fedlc", init, local_update, aggregate, *global_model_predictors(model))
