"""FedTP (Li et al., TNNLS): a ViT whose self-attention projections W_qkv are personal; everything else is FedAvg.

Shared xi: every ViT parameter but the W_qkv of each block (patch embedding, CLS, positions, LayerNorms,
attention output projections, feed-forward, head), averaged over the round's clients with sample weights.
Personal W = {W_qkv^l} [depth, D, 3 heads dim_head]:

- ``variant="hypernet"`` (learn-to-personalize): the server holds a hypernetwork h(phi; z) and a client
  embedding table Z [N, E]. Client i receives W_i^0 = h(phi; Z[i]) and trains (xi, W) locally; the server
  then takes one optimizer step on (phi, Z) along

      g_phi, g_Z = VJP of (phi, Z) -> [h(phi; Z[i])]_{i in cohort} with cotangent p_i (W_i^0 - W_i^K)

  (``ops.hypernet.hypernet_grads``; the official code's sign, i.e. gradient descent on
  0.5 sum_i p_i ||h(phi; z_i) - W_i^K||^2). Rows of Z of unsampled clients get zero gradient (weight decay and
  momentum still act on the whole table, as the code's optimizer does). The hypernetwork exists once, on the
  server.
- ``variant="vanilla"``: each client keeps its own W (its state row) and trains it locally;
  ``personalize=False`` averages W too, which is FedAvg on the same ViT.

The server state holds xi as "params". A client's row of Z is its id (``RoundInfo.client_id``); clients keep
nothing between rounds, except their W under ``vanilla``.

Deviations: none known.
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
from ..errors import ConfigError
from ..ops.hypernet import generate, hypernet_grads, hypernetwork, init_embeddings, require_table_size
from ._registry import register


VARIANTS = ("hypernet", "vanilla")


def split_qkv(params, depth: int):
    """(xi, W): the ViT params without any ``attn<l>/qkv`` leaf, and those leaves stacked [depth, D, 3I]."""
    enc = dict(params["encoder"])
    w = jnp.stack([enc[f"attn{l}"]["qkv"] for l in range(depth)])
    for l in range(depth):
        enc[f"attn{l}"] = {k: v for k, v in enc[f"attn{l}"].items() if k != "qkv"}
    return dict(params, encoder=enc), w


def qkv_hypernetwork(model, embed_dim: int, hidden: int, layers: int):
    """(hnet, stack): the hypernetwork with one head per ViT block ({"qkv<l>": [D, 3I]}) and the function that
    stacks its output into W [..., depth, D, 3I]."""
    depth, shape = model.encoder.depth, model.encoder.qkv_shape()
    hnet = hypernetwork({f"qkv{l}": shape[1:] for l in range(depth)}, embed_dim, hidden, layers)
    return hnet, lambda out: jnp.stack([out[f"qkv{l}"] for l in range(depth)], -3)


@dataclasses.dataclass(frozen=True)
class FedTPOptions(Options):
    name = "fedtp"
    server_client_rows = True  # (the server's table, one row per training client)
    models = ("vit_small", "vit_tiny")  # personalized attention needs a ViT
    # the official run scripts (scripts/cifar10_run.sh: --lr=0.01 --batch-size=64 --rho=0.9; main.py --reg 1e-5)
    train_preset = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 64}
    sharing = ("every ViT parameter but the attention Q/K/V projections; a server hypernetwork generates those",
               "its Q/K/V projections (vanilla) or its embedding row on the server (hypernet)")
    variant: str = option("hypernet", "hypernet (server hypernetwork generates Q/K/V) | vanilla (each client "
                          "keeps its own)", choices=VARIANTS)
    personalize: bool = option(True, "vanilla: --no-personalize averages Q/K/V too (FedAvg on the ViT)")
    embed_dim: int = option(128, "client embedding size", minimum=1)
    hyper_hidden: int = option(150, "hypernetwork trunk width", minimum=1)
    hyper_layers: int = option(3, "hidden layers of the hypernetwork trunk after the first", minimum=0)
    hyper_lr: float = option(0.01, "hypernetwork SGD learning rate", lo=0.0, lo_open=True)
    hyper_momentum: float = option(0.9, "hypernetwork SGD momentum", lo=0.0, hi=1.0)
    hyper_decay: float = option(1e-3, "hypernetwork weight decay", lo=0.0)

    def keeps_client_state(self) -> bool:
        """vanilla keeps each client's Q/K/V (unless averaged: ``personalize=False``); hypernet keeps nothing on
        the client (its embedding row is on the server)."""
        return self.variant == "vanilla" and self.personalize


@register(FedTPOptions)
def fedtp(model, trainer: LocalTrainer, o: FedTPOptions, ctx: RunContext) -> Algorithm:
    """FedTP on a ViT ``Classifier`` (``models.vit_small``); options: ``FedTPOptions``. ctx.num_clients: N, the size
    of the embedding table (the run's client count; required by the hypernetwork variant, whose client ids index
    it). Hypernetwork: trunk of 1 + ``hyper_layers``
    Linear(``hyper_hidden``) layers, one head per block; optimizer SGD(``hyper_lr``, momentum) with weight decay
    ``hyper_decay`` (official code)."""
    variant, personalize, embed_dim = o.variant, o.personalize, o.embed_dim
    hyper_hidden, hyper_layers, hyper_lr, hyper_momentum, hyper_decay = (
        o.hyper_hidden, o.hyper_layers, o.hyper_lr, o.hyper_momentum, o.hyper_decay)
    if not hasattr(model.encoder, "qkv_shape"):
        raise ConfigError(f"fedtp needs a ViT (--model vit_small or vit_tiny), got a {type(model.encoder).__name__} "
                          f"encoder")
    if variant == "hypernet":
        require_table_size("fedtp", ctx.num_clients)
    depth = model.encoder.depth
    hnet, stack = qkv_hypernetwork(model, embed_dim, hyper_hidden, hyper_layers)
    hyper_tx = optax.chain(optax.add_decayed_weights(hyper_decay), optax.sgd(hyper_lr, momentum=hyper_momentum))

    def client_qkv(server, client, client_id):
        if variant == "vanilla":
            return client["qkv"] if personalize else server["qkv"]
        return stack(hnet.apply(server["hnet"], server["embeddings"][client_id]))

    def loss_fn(params, stats, x, y, w, key):
        logits = model.apply({"params": params["xi"]}, x, train=True, qkv=params["qkv"],
                             rngs=None if key is None else {"dropout": key})
        return weighted_mean_loss(cross_entropy(logits, y), w), (stats, logits)

    def init(key, sample_x):
        # the ViT from ``key`` itself, as FedAvg initialises it (so FedAvg-T and FedTP start from the same xi)
        k_hnet, k_emb = jax.random.split(jax.random.fold_in(key, 1))
        x = trainer.preprocess(sample_x[:1])
        xi, w = split_qkv(model.init(key, x, train=False)["params"], depth)
        server = {"params": xi}
        client = {}
        if variant == "hypernet":
            hp = hnet.init(k_hnet)
            z = init_embeddings(k_emb, ctx.num_clients, embed_dim)
            server.update(hnet=hp, embeddings=z, hyper_opt=hyper_tx.init((hp, z)))
        elif personalize:
            client["qkv"] = w
        else:
            server["qkv"] = w
        return server, client

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        params = {"xi": server["params"], "qkv": client_qkv(server, client, info.client_id)}
        params, _, _, metrics = trainer.run(loss_fn, params, {}, trainer.tx.init(params), data, key)
        return dict(client, xi=params["xi"], trained_qkv=params["qkv"]), metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        new = dict(server, params=tree_weighted_mean(clients["xi"], weights))
        kept = {k: v for k, v in clients.items() if k == "qkv"}
        if variant == "vanilla":
            if personalize:
                kept["qkv"] = clients["trained_qkv"]
            else:
                new["qkv"] = tree_weighted_mean(clients["trained_qkv"], weights)
            return new, kept
        ids = info.client_id
        sent = generate(hnet.apply, server["hnet"], server["embeddings"], ids)
        trained = {f"qkv{l}": clients["trained_qkv"][:, l] for l in range(depth)}
        grads = hypernet_grads(hnet.apply, server["hnet"], server["embeddings"], ids, sent, trained, weights)
        updates, new["hyper_opt"] = hyper_tx.update(grads, server["hyper_opt"], (server["hnet"], server["embeddings"]))
        new["hnet"], new["embeddings"] = optax.apply_updates((server["hnet"], server["embeddings"]), updates)
        return new, kept

    def predict(server, client, x, client_id):
        return model.apply({"params": server["params"]}, x, train=False, qkv=client_qkv(server, client, client_id))

    def predict_trained(server, trained, x, client_id):  # the client's trained xi and Q/K/V
        return model.apply({"params": trained["xi"]}, x, train=False, qkv=trained["trained_qkv"])

    name = f"fedtp_{variant}" if personalize else "fedtp_shared"
    return Algorithm(name, init, local_update, aggregate, predict, predict_trained)


def adapt_new_client(alg_model, trainer: LocalTrainer, server, data: ClientData, key, embed_dim: int = 128,
                     hyper_hidden: int = 150, hyper_layers: int = 3):
    """Held-out client: learn only an embedding z for an unseen client (xi and the hypernetwork frozen) by
    ``trainer`` on its data; returns (z, metrics). The hypernetwork options must be those of the run."""
    hnet, stack = qkv_hypernetwork(alg_model, embed_dim, hyper_hidden, hyper_layers)

    def loss_fn(params, stats, x, y, w, k):
        qkv = stack(hnet.apply(server["hnet"], params["z"]))
        logits = alg_model.apply({"params": server["params"]}, x, train=True, qkv=qkv, rngs={"dropout": k})
        return weighted_mean_loss(cross_entropy(logits, y), w), (stats, logits)

    z0 = {"z": jnp.mean(server["embeddings"], 0)}  # start from the mean embedding of the known clients
    params, _, _, metrics = trainer.run(loss_fn, z0, {}, trainer.tx.init(z0), data, key)
    return params["z"], metrics
