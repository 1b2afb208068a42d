"""GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized Feature Information for
Personalized Federated Learning"): a global category embedding (GCE) and a conditional valve (CoV) split the
encoder's features into a global and a personalized part; the head is personal.

With the global encoder f, the GCE table E [C, d] and the CoV,

    CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c)),  gamma(c) = LN(ReLU(c W_g + b_g)),  beta(c) = LN(ReLU(c W_b + b_b))

client i computes f_P = CoV(z, c_p,i), f_G = CoV(z, c_g,i) for z = f(x) and trains f, its head h, E and the
CoV on

    L = mean_b CE(h(f_P), y) + mean_b -log softmax_c(cos(f_G, E_c))[y] + lam ||f_G - sg(E)[y]||_F
        + mu/2 (||E||^2 + ||CoV||^2)

(the magnitude term is the Frobenius norm over the batch's real rows, neither squared nor averaged, as the
official ``torch.norm``; mu/2 ||.||^2 is the official SGD weight decay mu on E and the CoV). The server averages
f, E and the CoV (the engine's weights). After training the client sets its conditional inputs from its trained
table E' and its class proportions p_i: c_g = mean_c E'_c, c_p = sum_c p_i,c E'_c (both 0 before its first
training). h, c_p, c_g and the BN statistics stay with the client; it predicts h(CoV(f(x), c_p)).
Defaults: lam = 0.01, mu = 0.1 (the official script's values for its CNN and MLP; 1e-4 and 0 for ResNet-18).

Reference: TsingZ0/GPFL @ ed7a7fe1 (``system/flcore/clients/clientgp.py`` ``train``, ``set_GCE``;
``servers/servergp.py`` ``GCE``, ``CoV``); PFLlib's ``clientgpfl.py`` is the same code.

Deviations:
- Class proportions count all of a client's training samples (the official count skips the loader's dropped
  last batch).
- Clients outside the cohort keep the conditional inputs of their last training (officially every client
  recomputes them from the global table it last received; identical with every client in every round).
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
from ..ops.dense import dense, dense_init, layer_norm, layer_norm_init
from ..ops.losses import class_counts, cosine_ce
from ._common import feature_dim, head_on, init_variables, num_classes
from ._registry import register


@dataclasses.dataclass(frozen=True)
class GPFLOptions(Options):
    name = "gpfl"
    client_state = True
    sharing = ("the encoder, the global category embeddings (GCE) and the conditional valve (CoV), each averaged",
               "its head, its conditional inputs c_p and c_g, BN statistics")
    lam: float = option(0.01, "weight of the magnitude-level term ||f_G - E[y]||", lo=0.0)
    mu: float = option(0.1, "weight decay of the GCE and the CoV", lo=0.0)


def valve_init(key, d: int):
    """The CoV's parameters: gamma and beta branches, each Linear(d, d) (torch init) and LayerNorm(d)."""
    kg, kb = jax.random.split(key)
    return {"gamma": {"dense": dense_init(kg, d, d), "ln": layer_norm_init(d)},
            "beta": {"dense": dense_init(kb, d, d), "ln": layer_norm_init(d)}}


def conditional_valve(cov, z, c):
    """ReLU(z * (gamma(c) + 1) + beta(c)), gamma(c) = LN(ReLU(c W_g + b_g)), beta likewise.
    z [B, d], c [d] -> [B, d]."""
    gamma = layer_norm(cov["gamma"]["ln"], jax.nn.relu(dense(cov["gamma"]["dense"], c)))
    beta = layer_norm(cov["beta"]["ln"], jax.nn.relu(dense(cov["beta"]["dense"], c)))
    return jax.nn.relu(z * (gamma + 1) + beta)


def conditional_inputs(embeddings, counts):
    """(c_p, c_g): sum_c p_c E_c with p = counts / sum(counts) (0 without samples), and mean_c E_c.
    embeddings [C, d], counts [C] -> ([d], [d])."""
    p = counts / jnp.maximum(jnp.sum(counts), 1.0)
    return p @ embeddings, jnp.mean(embeddings, 0)


def gpfl_loss(model, lam: float, mu: float):
    """loss_fn(params, stats, x, y, w, key, c_p, c_g, frozen_gce) with params {"encoder", "head", "gce", "cov"}
    -> (CE + angle-level + lam magnitude-level + mu/2 decay, (stats, logits of h(f_P)))."""
    def loss_fn(params, stats, x, y, w, key, c_p, c_g, frozen):
        variables = {"params": {"encoder": params["encoder"], "head": params["head"]}, "batch_stats": stats}
        z, upd = model.apply(variables, x, True, w, method="features", mutable=["batch_stats"])
        f_p, f_g = conditional_valve(params["cov"], z, c_p), conditional_valve(params["cov"], z, c_g)
        logits, upd = model.apply({"params": variables["params"], "batch_stats": upd["batch_stats"]}, f_p, True, w,
                                  method=head_on, mutable=["batch_stats"])
        magnitude = jnp.sqrt(jnp.sum(w[:, None] * (f_g - jax.lax.stop_gradient(frozen)[y]) ** 2) + 1e-12)
        decay = optax.tree.norm({"gce": params["gce"], "cov": params["cov"]}, squared=True)
        angle = weighted_mean_loss(cosine_ce(f_g, params["gce"], y), w)
        loss = weighted_mean_loss(cross_entropy(logits, y), w) + angle + lam * magnitude + 0.5 * mu * decay
        return loss, (upd["batch_stats"], logits)
    return loss_fn


@register(GPFLOptions)
def gpfl(model, trainer: LocalTrainer, o: GPFLOptions, ctx: RunContext) -> Algorithm:
    """GPFL: global category embeddings and a conditional valve over a shared encoder; personal heads."""
    loss_fn = gpfl_loss(model, o.lam, o.mu)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        d = feature_dim(model, v, x)
        c = num_classes(model, v, x)
        server = {"encoder": v["params"]["encoder"], "gce": jax.random.normal(jax.random.fold_in(key, 1), (c, d)),
                  "cov": valve_init(jax.random.fold_in(key, 2), d)}
        return server, {"head": v["params"]["head"], "c_p": jnp.zeros(d), "c_g": jnp.zeros(d),
                        "batch_stats": v["batch_stats"]}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        params = {"encoder": server["encoder"], "head": client["head"], "gce": server["gce"], "cov": server["cov"]}
        def fn(p, s, x, y, w, k):
            return loss_fn(p, s, x, y, w, k, client["c_p"], client["c_g"], server["gce"])
        params, stats, _, metrics = trainer.run(fn, params, client["batch_stats"], trainer.tx.init(params), data,
                                                key)
        c_p, c_g = conditional_inputs(params["gce"], class_counts(data.y, data.count, params["gce"].shape[0]))
        return dict(params, batch_stats=stats, c_p=c_p, c_g=c_g, c_p_used=client["c_p"]), metrics

    def aggregate(server, trained, weights, info=None):
        new = {k: tree_weighted_mean(trained[k], weights) for k in ("encoder", "gce", "cov")}
        return new, {k: trained[k] for k in ("head", "c_p", "c_g", "batch_stats")}

    def personal_logits(encoder, cov, client, c_p, x):
        z = model.apply({"params": {"encoder": encoder}, "batch_stats": client["batch_stats"]}, x, False,
                        method="features")
        return model.apply({"params": {"head": client["head"]}, "batch_stats": client["batch_stats"]},
                           conditional_valve(cov, z, c_p), False, method=head_on)

    def predict(server, client, x, client_id=None):
        return personal_logits(server["encoder"], server["cov"], client, client["c_p"], x)

    def predict_trained(server, trained, x, client_id=None):  # the model as it trained (its old c_p)
        return personal_logits(trained["encoder"], trained["cov"], trained, trained["c_p_used"], x)

    return Algorithm("gpfl", init, local_update, aggregate, predict, predict_trained)
