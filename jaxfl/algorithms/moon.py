"""MOON (Li, He, Song, CVPR 2021): FedAvg whose local objective adds a model-contrastive term.

Client i receives the global model w^t and trains w on batches of its data with

    L = CE(w; x, y) + mu * l_con * [round > 0],
    l_con = -log( exp(s_glob) / (exp(s_glob) + exp(s_prev)) ) = logaddexp(s_glob, s_prev) - s_glob,
    s_. = sim(z, z_.) / tau,

z = R_w(x) the representation of the model being trained (training mode), z_glob = R_{w^t}(x) of the received
global model, z_prev = R_{w_i^{t-1}}(x) of the client's own previous local model (both frozen: stop-gradient,
evaluation mode), sim the cosine similarity (``x / max(||x||, 1e-8)``). Both terms are means over the real
samples of a batch: padded samples (w = 0) enter neither the CE, nor l_con, nor a BatchNorm statistic. In round
0 the pool of previous models is empty, so l_con = 0. The previous model is the one the client trained the last
time it took part (never trained: the initial network), kept as its persistent state ``{"prev": variables}``
(params + BatchNorm statistics). The server averages every parameter and BatchNorm statistic with sample
weights (FedAvg); ``predict`` uses the global model, ``predict_trained`` the client's local model.
R_w (``representation``): ``"penultimate"`` (default; the paper's "network before the output layer") is the
input of the head's last Dense (the last hidden ReLU of an MLP head; the encoder output z for a linear head,
e.g. every ResNet/ViT/FedAvg-CNN model here); ``"features"`` the encoder output z = ``model.apply(v, x,
method="features")``. Defaults: mu = 1, tau = 0.5; preset ``cifar10``: mu = 5 (the MOON paper's CIFAR-10 value).

Deviations:
- No projection head of our own (the models are shared with the other baselines); with an MLP head its hidden
  layers play that role (the official ``ModelFedCon`` has a Linear-ReLU-Linear projection head).
- Every client starts from the same initial global state (the official code gives each party its own random
  init).
- Pool size 1 only (the official default; larger FIFO pools add negatives).
- The official optimizer (SGD momentum 0.9, weight decay 1e-5) is the run's client optimizer here.
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
from ..ops.losses import model_contrastive_loss
from ._common import REPRESENTATIONS, global_model_predictors, init_variables, logits_and_representation
from ._registry import register


def moon_loss(model, mu: float, tau: float, representation: str = "penultimate"):
    """loss_fn(params, stats, x, y, w, key, glob, prev, active) -> (loss, (new_stats, logits)).

    loss = mean_w CE + mu * active * mean_w l_con; glob / prev: the frozen global and previous models'
    variables (evaluated in evaluation mode); active: 1.0 when the client has a previous model (round > 0).
    """
    forward = logits_and_representation(representation)

    def frozen_rep(variables, x):
        _, z = model.apply(jax.lax.stop_gradient(variables), x, False, None, method=forward)
        return z

    def loss_fn(params, stats, x, y, w, key, glob, prev, active):
        (logits, z), updated = model.apply({"params": params, "batch_stats": stats}, x, True, w, method=forward,
                                           mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        loss = weighted_mean_loss(cross_entropy(logits, y), w)
        if mu:
            con = model_contrastive_loss(z, frozen_rep(glob, x), frozen_rep(prev, x), tau)
            loss = loss + mu * active * weighted_mean_loss(con, w)
        return loss, (updated.get("batch_stats", {}), logits)
    return loss_fn


@dataclasses.dataclass(frozen=True)
class MOONOptions(Options):
    name = "moon"
    client_state = True
    presets = {"default": {"mu": 1.0}, "cifar10": {"mu": 5.0}, "tfds:cifar10": {"mu": 5.0}}
    preset_default = "default"
    sharing = ("all parameters and BN statistics (FedAvg); local loss + mu * model-contrastive term",
               "its previous local model (the contrastive negative)")
    mu: float | None = option(None, "weight of the model-contrastive term (default 1; 5 on cifar10)", lo=0.0)
    tau: float = option(0.5, "temperature of the model-contrastive term", lo=0.0, lo_open=True)
    representation: str = option("penultimate", "penultimate (input of the head's last layer, the paper's R_w) | "
                                 "features (encoder output z)", choices=REPRESENTATIONS)


@register(MOONOptions)
def moon(model, trainer: LocalTrainer, o: MOONOptions, ctx: RunContext) -> Algorithm:
    """MOON with contrastive weight ``mu`` and temperature ``tau`` on any ``Classifier``."""
    loss_fn = moon_loss(model, o.mu, o.tau, o.representation)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        return variables, {"prev": variables}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        active = (info.round > 0).astype(jnp.float32)  # official: the pool of previous models is empty in round 0
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, server, client["prev"], active)
        params, stats, _, metrics = trainer.run(fn, server["params"], server["batch_stats"],
                                                trainer.tx.init(server["params"]), data, key)
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, trained, weights, info=None):
        # FedAvg over every parameter and statistic; each client keeps the model it just trained
        return tree_weighted_mean(trained, weights), {"prev": trained}

    return Algorithm("moon", init, local_update, aggregate, *global_model_predictors(model))
