"""FPL, Federated Prototype Learning (Huang, Ye, Du et al., CVPR 2023, "Rethinking Federated Learning with Domain
Shift: A Prototype View"): FedAvg whose local objective pulls features toward clustered class prototypes.

Client i receives the global model and, once the server has prototypes, trains on batches with

    L = CE(g(z), y) + mean_b l_b,      l_b = InfoNCE over cluster prototypes + MSE to the unbiased prototype
                                       (``losses.prototype_contrastive_loss``, temperature tau),

z = f(x) the encoder's output, positives the cluster prototypes of the sample's class, negatives those of every
other class, and l_b = 0 for a sample whose class has no prototype (the mean divides by the batch size, those
samples included). After training it uploads its local prototypes, the mean z of each class it holds. The
server averages the model (FedAvg, the engine's sample weights) and, per class, clusters the cohort's local
prototypes with FINCH (cosine, its last partition: ``aggregation.finch_partition``), keeps each cluster's mean
as a cluster prototype and their plain mean as the class's unbiased prototype
(``aggregation.cluster_prototypes``). Round 0 has no prototypes: CE only.

State: the server holds the model and the prototypes of the last round ([C, max_clusters, D] with validity
masks, and [C, D]); a client keeps nothing (only this round's cohort's prototypes are clustered). Defaults:
tau = 0.02; max_clusters = 32 slots per class: FINCH's last partition has at most K/2 clusters for a cohort of
K >= 2 clients, so cohorts of up to 64 clients never lose a cluster; beyond, the most populous are kept.

Deviations:
- The official local prototypes are the means of the training-mode features of the last local epoch's batches,
  taken while the model still moves; here the trained model's evaluation-mode features over the client's real
  samples (``fedpac.class_feature_sums``): independent of batch order, and they do not move BN statistics.
- FINCH runs in JAX (fixed shapes), not with sklearn/scipy on the host.
- The official optimizer (SGD, momentum 0.9, weight decay 1e-5) is the run's client optimizer here.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.clustering import cluster_prototypes
from ..ops.losses import prototype_contrastive_loss
from ._common import (class_feature_sums, feature_dim, global_model_predictors, init_variables,
                      logits_and_representation, model_variables, num_classes)
from ._registry import register


PROTOTYPE_KEYS = ("cluster", "cluster_valid", "unbiased", "class_valid")


@dataclasses.dataclass(frozen=True)
class FPLOptions(Options):
    name = "fpl"
    sharing = ("all parameters and BN statistics (FedAvg); class prototypes, clustered per class by FINCH",
               "nothing")
    tau: float = option(0.02, "temperature of the cluster-prototype InfoNCE", lo=0.0, lo_open=True)
    max_clusters: int = option(32, "cluster prototypes kept per class (FINCH leaves <= cohort/2)", minimum=1)


def fpl_loss(model, tau: float):
    """loss_fn(params, stats, x, y, w, key, protos) -> (loss, (stats, logits)): mean_w CE + mean_w l_b, with
    protos {"cluster", "cluster_valid", "unbiased", "class_valid"} (the server's, held fixed)."""
    forward = logits_and_representation("features")

    def loss_fn(params, stats, x, y, w, key, protos):
        (logits, z), updated = model.apply({"params": params, "batch_stats": stats}, x, True, w, method=forward,
                                           mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        p = jax.lax.stop_gradient(protos)
        proto = prototype_contrastive_loss(z, y, p["cluster"], p["cluster_valid"], p["unbiased"],
                                           p["class_valid"], tau)
        loss = weighted_mean_loss(cross_entropy(logits, y), w) + weighted_mean_loss(proto, w)
        return loss, (updated.get("batch_stats", {}), logits)
    return loss_fn


@register(FPLOptions)
def fpl(model, trainer: LocalTrainer, o: FPLOptions, ctx: RunContext) -> Algorithm:
    """FPL: FedAvg + InfoNCE to FINCH-clustered class prototypes + MSE to their mean."""
    loss_fn = fpl_loss(model, o.tau)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        d = feature_dim(model, v, x)
        c = num_classes(model, v, x)
        protos = {"cluster": jnp.zeros((c, o.max_clusters, d)), "cluster_valid": jnp.zeros((c, o.max_clusters), bool),
                  "unbiased": jnp.zeros((c, d)), "class_valid": jnp.zeros(c, bool)}
        return dict(v, **protos), {}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        protos = {k: server[k] for k in PROTOTYPE_KEYS}
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, protos)
        params, stats, _, metrics = trainer.run(fn, server["params"], server["batch_stats"],
                                                trainer.tx.init(server["params"]), data, key)
        trained = {"params": params, "batch_stats": stats}
        c = server["unbiased"].shape[0]
        s1, _, n = class_feature_sums(model, trained, data, c, trainer.batch_size, trainer.preprocess)
        return dict(trained, protos=s1 / jnp.maximum(n, 1.0)[:, None], counts=n), metrics

    def aggregate(server, trained, weights, info=None):
        new = tree_weighted_mean(model_variables(trained), weights)
        present = (trained["counts"] > 0) & (weights > 0)[:, None]  # a padded cohort row holds no class
        cluster, cluster_valid, unbiased, class_valid = cluster_prototypes(trained["protos"], present,
                                                                           o.max_clusters)
        return dict(new, cluster=cluster, cluster_valid=cluster_valid, unbiased=unbiased,
                    class_valid=class_valid), {}

    return Algorithm("fpl", init, local_update, aggregate, *global_model_predictors(model))
