"""FedMP (Jiang, Xu, Xu, Wang, Qiao & Zhao, ICDE 2022, "FedMP: Federated learning through adaptive model pruning
in heterogeneous edge computing"), as DapperFL's comparison runs it: magnitude-based structured pruning of the
global model at each client's ratio, then R2SP (residual recovery synchronous parallel) aggregation.

DapperFL's pruning rule without fusion and without DAR, applied to the global model before local training
(FedMP prunes at the server):
1. M_i = ``pruning_masks(W, rho_i)``: L1 filter ranking (input x output channels) for conv kernels, L2 input
   rows of the output layer, unstructured |gamma| for BatchNorm scales; stem and biases kept;
   rho_i = ``device_ratios[i mod L]`` (default 0, 0.2, 0.4, 0.6, 0.8);
2. the client trains w * M_i (start w = W * M_i) for E epochs with plain CE;
3. R2SP: pruned entries are recovered from the global model, then FedAvg (``aggregation.recovered_mean``):

    W <- W + sum_i p_i M_i (w_i - W),  p_i = n_i / sum_j n_j.

BatchNorm running statistics are averaged with p_i, unmasked (as DapperFL's released aggregation). Nothing is
kept per client; evaluation uses the global model. With ratio 0 it is FedAvg.

Deviations:
- FedMP's multi-armed-bandit choice of the ratio per round is replaced by the fixed device levels, as in
  DapperFL's comparison.
- The pruning and recovery are the machinery DapperFL's baselines share (no FedMP code could be found).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import recovered_mean, tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.masks import tree_count, tree_density
from ._common import init_variables, model_variables
from ._registry import register
from ._submodel import DEVICE_RATIOS, check_ratios, client_ratio, masked_loss, pruning_masks


@dataclasses.dataclass(frozen=True)
class FedMPOptions(Options):
    name = "fedmp"
    multilabel = True
    sharing = ("everything (global model), each client's update masked by its magnitude pruning mask; pruned "
               "entries recovered from the global model (R2SP)", "nothing (its pruning ratio follows from its id)")
    device_ratios: tuple[float, ...] = option(DEVICE_RATIOS, "pruning ratio per device level, comma-separated; "
                                              "client i gets level i mod len", lo=0.0, hi=1.0)

    def check(self) -> None:
        check_ratios("fedmp", self.device_ratios)

@register(FedMPOptions)
def fedmp(model, trainer: LocalTrainer, o: FedMPOptions, ctx: RunContext) -> Algorithm:
    """FedMP on a ``Classifier``; options: ``FedMPOptions``."""
    ratios = jnp.asarray(o.device_ratios, jnp.float32)

    def init(key, sample_x):
        return init_variables(model, trainer, key, sample_x), {}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        rho = client_ratio(ratios, info)
        mask = pruning_masks(server["params"], rho)  # pruned from the global model, before training
        params = jax.tree_util.tree_map(jnp.multiply, server["params"], mask)
        opt = trainer.tx.init(params)
        params, stats, _, metrics = trainer.run(masked_loss(model, mask), params, server["batch_stats"], opt,
                                                data, key)
        metrics = dict(metrics, ratio=rho, kept_params=tree_count(mask), kept_fraction=tree_density(mask))
        return {"params": params, "batch_stats": stats, "mask": mask}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        params = jax.tree_util.tree_map(lambda x, m, g: recovered_mean(x, weights, m, g),
                                        clients["params"], clients["mask"], server["params"])
        return {"params": params, "batch_stats": tree_weighted_mean(clients["batch_stats"], weights)}, {}

    def predict(server, client, x, client_id=None):
        return model.apply(model_variables(server), x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        params = jax.tree_util.tree_map(jnp.multiply, trained["params"], trained["mask"])
        return model.apply({"params": params, "batch_stats": trained["batch_stats"]}, x, train=False)

    return Algorithm("fedmp", init, local_update, aggregate, predict, predict_trained)
