"""MOON (Li, He, Song, CVPR 2021): FedAvg whose local objective adds a model-contrastive term.

Client i receives the global model w^t and trains w on batches of its data with

    L = CE(w; x, y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
          = logaddexp(s_glob, s_prev) - s_glob,      s_. = sim(z, z_.) / tau,

where z = R_w(x) is the representation of the model being trained (training mode), z_glob = R_{w^t}(x) of the
received global model and z_prev = R_{w_i^{t-1}}(x) of the client's own previous local model (both frozen:
stop-gradient, evaluation mode, as the official code calls ``.eval()`` on them and sets requires_grad=False),
sim the cosine similarity (``x / max(||x||, 1e-8)``, PyTorch's CosineSimilarity eps). Both terms are means over
the real samples of a batch: padded samples (w = 0) enter neither the CE, nor l_con, nor a BatchNorm statistic.
The server averages every parameter and BatchNorm statistic with sample weights (FedAvg); the global model is
what MOON predicts with (``predict``; ``predict_trained``: the client's local model).

Representation R_w (``representation``): the official model (``ModelFedCon``) is base encoder -> projection
head (Linear-ReLU-Linear) -> output layer ``l3``, and the contrastive term uses the projection output, i.e. the
input of the output layer; the paper defines R_w as "the network before the output layer". Our models are
``Classifier``s whose head is an ``MLPHead``; ``"penultimate"`` (default) matches the paper/official choice:
the input of the head's last Dense (the last hidden ReLU of an MLP head, the encoder output z for a linear
head: every ResNet/ViT/FedAvg-CNN model here, where both choices coincide). ``"features"`` uses the encoder
output z = ``model.apply(v, x, method="features")``. We add no projection head of our own (the models are
shared with the other baselines); with an MLP head its hidden layers play that role.

Previous model and the first round (official ``main.py``): the pool of previous models (``model_buffer_size``,
default 1) is empty during round 0 (the ``load_first_net`` branch builds copies but never appends them), so the
contrastive logits have the positive column only and l_con = 0 exactly: here l_con is multiplied by
[round > 0]. After every round the pool is refilled with every client's current local network, i.e. the model
it trained the last time it took part (a client that has never trained: its initial network). We keep that
model (params + BatchNorm statistics) as the client's persistent state ``{"prev": variables}``; every client
starts from the initial global model (the official code gives each party its own random init, jaxfl starts all
clients from the same state). Pool size 1 only (the official default; larger FIFO pools add negatives).

Defaults: mu = 1, tau = 0.5 (official ``main.py`` argparse defaults; DapperFL's Table 4 uses the same), preset
``cifar10``: mu = 5 (the MOON paper's CIFAR-10 value, the official README's example command). DapperFL's code
``best_args.py`` uses mu = 5 (pass ``--moon.mu 5``). The official optimizer (SGD momentum 0.9, weight decay
1e-5) is the run's client optimizer here, as in the seed papers' comparisons.

Official code read: github.com/QinbinLi/MOON @ 8fcba3c4efc9a47eb24687a91ba94cfb2005103f, ``main.py``
(``train_net_fedcon``, the ``moon`` branch of the round loop), ``model.py`` (``ModelFedCon``).
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
