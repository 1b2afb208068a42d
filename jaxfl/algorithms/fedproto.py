"""FedProto (Tan et al., AAAI 2022, "FedProto: Federated Prototype Learning across Heterogeneous Clients"):
clients share class prototypes, never models.

Client i keeps its whole model F_i = g_i o f_i; z = f_i(x) is the input of the last Dense layer
(``representation="penultimate"``). With the server's global prototypes P_c for the classes c in V (those some
client of the last cohort held), client i trains on

    L_i = mean_b CE(F_i(x_b), y_b) + lam * mean_b 1[y_b in V] ||z_b - sg(P_{y_b})||^2 / d

(round 0: V is empty, CE only), then uploads its local prototypes c_{i,c} = mean of z over its real samples of
class c (the trained model in evaluation mode). The server replaces the prototypes by the plain mean over the
cohort's clients that hold the class, P_c = (1/|N_c|) sum_{i in N_c} c_{i,c}. A client predicts the nearest
global prototype, logits_c = -||z - P_c||^2 / d for c in V (the head's logits while V is empty), or with
``predict="head"`` its own head.

State: the server holds only the prototypes [C, d] and their validity [C]; each client its model (params and
BN statistics). Defaults: lam = 1 (the official MNIST/FEMNIST setting; its CIFAR-10 runs use 0.1).

Reference: yuetan031/FedProto @ 97e42e27 (``lib/update.py`` ``update_weights_het``, ``lib/utils.py``
``agg_func``/``proto_aggregation``, ``test_inference_new_het_lt``); also PFLlib ``clientproto.py`` and FL-bench
``fedproto.py``.

Deviations:
- Local prototypes are computed after training, from the trained model in evaluation mode over all real
  samples; the official code averages the training-mode features of the last local epoch's batches (PFLlib and
  FL-bench: of all epochs) while the model still moves.
- Nearest-prototype prediction considers every class with a global prototype (PFLlib); the official evaluation
  also restricts it to the classes of the client's training set (knowledge of the test labels' support).
- Every client starts from the same initial model (the official code initialises each client separately).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import (REPRESENTATIONS, class_feature_sums, feature_dim, init_variables, logits_and_representation,
                      model_variables, num_classes)
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedProtoOptions(Options):
    name = "fedproto"
    client_state = True
    sharing = ("class prototypes (mean representation per class), averaged over the clients holding the class",
               "its whole model")
    lam: float = option(1.0, "weight of the prototype regulariser ||z - P_y||^2 / d", lo=0.0)
    representation: str = option("penultimate", "z: the input of the last Dense layer (penultimate) or the "
                                                 "encoder output (features)", choices=REPRESENTATIONS)
    predict: str = option("proto", "prediction: the nearest global prototype (proto) or the client's head",
                          choices=("proto", "head"))


def prototype_regulariser(z, y, prototypes, valid):
    """Per sample 1[y_b in V] ||z_b - P_{y_b}||^2 / d (the official MSELoss(proto, z) summed per sample).
    z [B, d], y [B], prototypes [C, d], valid [C] -> [B]."""
    sq = jnp.sum((z - jnp.take(prototypes, y, axis=0)) ** 2, -1) / z.shape[-1]
    return jnp.where(jnp.take(valid, y), sq, 0.0)


def prototype_logits(z, prototypes, valid):
    """-||z - P_c||^2 / d for the valid classes, a very negative number for the others: the nearest prototype
    has the largest logit. z [B, d], prototypes [C, d], valid [C] -> [B, C]."""
    sq = jnp.sum((z[:, None, :] - prototypes[None]) ** 2, -1) / z.shape[-1]
    return jnp.where(valid[None], -sq, -1e9)


def mean_prototypes(protos, present):
    """P_c = mean of protos[i, c] over the clients i with present[i, c], and V = {c: some client has c}.
    protos [k, C, d], present [k, C] bool -> ([C, d], [C] bool)."""
    p = present.astype(protos.dtype)
    n = jnp.sum(p, 0)
    return jnp.einsum("kc,kcd->cd", p, protos) / jnp.maximum(n, 1.0)[:, None], n > 0


def fedproto_loss(model, lam: float, representation: str):
    """loss_fn(params, stats, x, y, w, key, prototypes, valid) -> (mean_w CE + lam mean_w regulariser,
    (new_stats, logits)), the LocalTrainer contract; the prototypes are held fixed."""
    forward = logits_and_representation(representation)

    def loss_fn(params, stats, x, y, w, key, prototypes, valid):
        (logits, z), updated = model.apply({"params": params, "batch_stats": stats}, x, True, w, method=forward,
                                           mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        reg = prototype_regulariser(z, y, jax.lax.stop_gradient(prototypes), valid)
        loss = weighted_mean_loss(cross_entropy(logits, y), w) + lam * weighted_mean_loss(reg, w)
        return loss, (updated.get("batch_stats", {}), logits)
    return loss_fn


@register(FedProtoOptions)
def fedproto(model, trainer: LocalTrainer, o: FedProtoOptions, ctx: RunContext) -> Algorithm:
    """FedProto: personal models regularised toward global class prototypes; prototypes are all that is shared."""
    loss_fn = fedproto_loss(model, o.lam, o.representation)
    forward = logits_and_representation(o.representation)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        d = feature_dim(model, v, x, o.representation)
        c = num_classes(model, v, x)
        return {"prototypes": jnp.zeros((c, d)), "valid": jnp.zeros(c, bool)}, v

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, server["prototypes"], server["valid"])
        params, stats, _, metrics = trainer.run(fn, client["params"], client["batch_stats"],
                                                trainer.tx.init(client["params"]), data, key)
        trained = {"params": params, "batch_stats": stats}
        s1, _, n = class_feature_sums(model, trained, data, server["valid"].shape[0], trainer.batch_size,
                                      trainer.preprocess, o.representation)
        return dict(trained, protos=s1 / jnp.maximum(n, 1.0)[:, None], counts=n), metrics

    def aggregate(server, trained, weights, info=None):
        present = (trained["counts"] > 0) & (weights > 0)[:, None]  # a padded cohort row holds no class
        prototypes, valid = mean_prototypes(trained["protos"], present)
        return {"prototypes": prototypes, "valid": valid}, model_variables(trained)

    def personal_logits(server, variables, x):
        logits, z = model.apply(variables, x, False, None, method=forward)
        if o.predict == "head":
            return logits
        return jnp.where(jnp.any(server["valid"]), prototype_logits(z, server["prototypes"], server["valid"]),
                         logits)

    def predict(server, client, x, client_id=None):
        return personal_logits(server, client, x)

    def predict_trained(server, trained, x, client_id=None):
        return personal_logits(server, model_variables(trained), x)

    return Algorithm("fedproto", init, local_update, aggregate, predict, predict_trained)
