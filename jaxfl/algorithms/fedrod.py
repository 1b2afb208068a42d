"""FedRoD (Chen & Chao, ICLR 2022), linear version: a shared body + generic head trained with the balanced
softmax, and a personal linear head trained on top of the generic predictor.

On every batch of client i, with r = the body's representation of x (training mode), g = the generic head's
logits on r, p = P_i r + b_i the personal head's logits and n_{i,c} the number of the client's training samples
of class c (counted inside jit from ``data.y`` and ``data.count``: padded rows never count):

    L_G(body, head) = CE(g + log n_i, y)             balanced softmax (BSM): logits shifted by the log of the
                                                     client's class prior (log 0 = -inf)
    L_P(P_i, b_i)   = CE(stopgrad(g) + P_i stopgrad(r) + b_i, y)
    predict(x)      = g(x) + p(x)                    (evaluation mode; no prior shift)

Both losses are batch means over the real samples. L_P sends no gradient into the body or the generic head:
the two updates of a step use the same forward pass (body's optimizer on L_G, then the personal head's on L_P
with r and g detached). Body + generic head take the run's client optimizer; the personal head plain SGD with
``head_lr`` (0.01; no momentum, no weight decay). The server averages the body, the generic head and every
BatchNorm statistic with sample weights; the personal head (``{"phead": {"kernel", "bias"}}``) never leaves its
client. Every client's personal head starts from the same PyTorch-default (uniform) init, drawn from
fold_in(init key, 1). Representation r (``representation="penultimate"``, default): the input of the head's
last Dense (the last hidden ReLU of an ``MLPHead`` with hidden layers; the encoder output z for a linear head,
e.g. the ViTs and ResNets, where it equals ``"features"``: z = ``model.apply(v, x, method="features")``).

Deviations:
- The paper's hypernetwork personal head is not implemented (the linear version, as FedTP's code runs it).
- BSM's exponent gamma on the counts is 1 (as in FedTP's code).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..models import Dense
from ..ops.losses import balanced_softmax_ce, class_log_prior
from ._common import REPRESENTATIONS, init_variables, logits_and_representation, model_variables
from ._registry import register


def real_mean(per_sample, w):
    """``weighted_mean_loss`` that ignores the value of padded rows (an absent class's -inf gives CE = inf there)."""
    return weighted_mean_loss(jnp.where(w > 0, per_sample, 0.0), w)


def linear_head(params, r):
    """The personal head's logits r P + b (``models.Dense``'s layer): params {"kernel" [D, C], "bias" [C]}."""
    return r @ params["kernel"] + params["bias"]


def fedrod_loss(model, representation: str = "penultimate"):
    """loss_fn(params, stats, x, y, w, key, log_prior) -> (L_G + L_P, (new_stats, g + p)).

    params = {"model": the network's params, "phead": the personal head's}; L_P sees stopgrad(r), stopgrad(g).
    """
    forward = logits_and_representation(representation)

    def loss_fn(params, stats, x, y, w, key, log_prior):
        (g, r), updated = model.apply({"params": params["model"], "batch_stats": stats}, x, True, w,
                                      method=forward, mutable=["batch_stats"],
                                      rngs=None if key is None else {"dropout": key})
        generic = real_mean(balanced_softmax_ce(g, y, log_prior), w)
        logits = jax.lax.stop_gradient(g) + linear_head(params["phead"], jax.lax.stop_gradient(r))
        personal = weighted_mean_loss(cross_entropy(logits, y), w)
        return generic + personal, (updated.get("batch_stats", {}), logits)
    return loss_fn


@dataclasses.dataclass(frozen=True)
class FedRoDOptions(Options):
    name = "fedrod"
    client_state = True
    sharing = ("body + generic head (balanced-softmax loss) and BN statistics", "a linear personal head")
    head_lr: float = option(0.01, "SGD learning rate of the personal head (no momentum, no weight decay)", lo=0.0)
    representation: str = option("penultimate", "the personal head's input: penultimate (input of the generic "
                                 "head's last layer) | features (encoder output z)", choices=REPRESENTATIONS)


@register(FedRoDOptions)
def fedrod(model, trainer: LocalTrainer, o: FedRoDOptions, ctx: RunContext) -> Algorithm:
    """FedRoD (linear personal head) on any ``Classifier``; options: ``FedRoDOptions``."""
    tx = optax.multi_transform({"model": trainer.tx, "phead": optax.sgd(o.head_lr)},
                               lambda p: {k: jax.tree_util.tree_map(lambda _: k, v) for k, v in p.items()})
    local_trainer = dataclasses.replace(trainer, tx=tx)
    forward = logits_and_representation(o.representation)
    loss_fn = fedrod_loss(model, o.representation)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        logits, r = model.apply(variables, trainer.preprocess(sample_x[:1]), False, None, method=forward)
        phead = Dense(logits.shape[-1]).init(jax.random.fold_in(key, 1), r)["params"]["linear"]
        return variables, {"phead": phead}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        log_prior = class_log_prior(data.y, data.count, client["phead"]["bias"].shape[-1])
        params = {"model": server["params"], "phead": client["phead"]}
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, log_prior)
        params, stats, _, metrics = local_trainer.run(fn, params, server["batch_stats"], tx.init(params), data, key)
        return {"params": params["model"], "batch_stats": stats, "phead": params["phead"]}, metrics

    def aggregate(server, trained, weights, info=None):
        shared = tree_weighted_mean(model_variables(trained), weights)
        return shared, {"phead": trained["phead"]}

    def personalized(variables, phead, x):
        g, r = model.apply(variables, x, False, None, method=forward)
        return g + linear_head(phead, r)

    def predict(server, client, x, client_id=None):
        return personalized(server, client["phead"], x)

    def predict_trained(server, trained, x, client_id=None):
        return personalized(model_variables(trained), trained["phead"], x)

    return Algorithm("fedrod", init, local_update, aggregate, predict, predict_trained)
