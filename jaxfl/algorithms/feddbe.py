"""FedDBE (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias for Federated Learning in Representation
Space"): FedAvg with a personal representation bias (PRBM) and a mean regulariser (MR).

Client i keeps a vector zbar_i [d] added to its representation before the head, logits = h(f(x) + zbar_i); the
encoder f and head h are global (FedAvg). Within a round a running mean r of the batch means of z = f(x) is
kept (r = 0 at the round's start, r <- (1 - m) sg(r) + m mean_b z_b on each batch), and the loss is

    L = mean_b CE(h(z_b + zbar_i), y_b) + kappa * mean_d (r_d - gbar_d)^2 / 2

with gbar [d] the global mean of the representations. gbar is measured once: round 0 is the official
"initialisation period": clients train plainly (no PRBM, no MR) while tracking r, the server sets
gbar = sum_i p_i r_i over that cohort (p_i the engine's weights) and discards the round's models. From round 1
on, the server averages f and h (the engine's weights); zbar_i and the BN statistics never leave the client
(the official code sends parameters only). A client predicts h(f(x) + zbar_i) with the global f, h.

The official models' heads are one linear layer; in a head whose first layer feeds a BatchNorm, training-mode
normalisation subtracts the batch mean and with it the bias (its gradient is zero there).

Defaults: kappa = 50, m = 1 (the official run script ``run_me.sh``; its ``main.py`` defaults, kappa = 0 and
m = 0.1, switch MR off).

Reference: TsingZ0/DBE @ 193f4355 (``system/flcore/clients/clientDBE.py``, ``servers/serverDBE.py``); PFLlib's
``clientdbe.py`` is the same code.

Deviations:
- The initialisation period is round 0 of the run (one counted round that trains nothing the server keeps; run
  T + 1 rounds for the official init + T), and only round 0's cohort measures gbar (officially: every client).
- The PRBM takes the run's client optimizer (the official code: a second plain SGD at the same lr, identical
  under plain SGD).
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
from ._common import feature_dim, init_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedDBEOptions(Options):
    name = "feddbe"
    client_state = True
    server_optimizer = True
    sharing = ("encoder and head parameters (FedAvg); once, the representations' mean (round 0)",
               "its representation bias (PRBM) and BN statistics")
    kappa: float = option(50.0, "weight of the mean regulariser (MR) mean_d (r - gbar)^2 / 2", lo=0.0)
    mean_momentum: float = option(1.0, "m of the running representation mean r <- (1 - m) r + m batch mean",
                                  lo=0.0, hi=1.0, lo_open=True)


def biased_forward(module, x, bias, train: bool = False, mask=None):
    """A ``Classifier`` method: (head(z + bias), z) with z = encoder(x); bias [d] (the PRBM)."""
    z = module.encoder(x, train, mask)
    return module.head(z + bias, train, mask), z


def running_mean_step(r, z, w, m: float):
    """r <- (1 - m) sg(r) + m mean of the real rows of z (w: 1 for real). r [d], z [B, d], w [B] -> [d]."""
    batch_mean = jnp.sum(w[:, None] * z, 0) / jnp.maximum(jnp.sum(w), 1.0)
    return (1 - m) * jax.lax.stop_gradient(r) + m * batch_mean


def mean_regulariser(r, gbar):
    """MR: mean_d (r_d - gbar_d)^2 / 2. r, gbar [d] -> []."""
    return 0.5 * jnp.mean((r - gbar) ** 2)


def feddbe_loss(model, kappa: float, m: float):
    """loss_fn(params, state, x, y, w, key, gbar, active) with params {"model", "prbm"}, state {"bn", "r"}:
    CE(h(z + prbm)) + kappa MR, both switched off (plain CE, r still tracked) when ``active`` is False."""
    def loss_fn(params, state, x, y, w, key, gbar, active):
        bias = jnp.where(active, params["prbm"], 0.0)
        (logits, z), updated = model.apply({"params": params["model"], "batch_stats": state["bn"]}, x, bias, True,
                                           w, method=biased_forward, mutable=["batch_stats"],
                                           rngs=None if key is None else {"dropout": key})
        r = running_mean_step(state["r"], z, w, m)
        mr = jnp.where(active, kappa, 0.0) * mean_regulariser(r, gbar)
        loss = weighted_mean_loss(cross_entropy(logits, y), w) + mr
        return loss, ({"bn": updated.get("batch_stats", {}), "r": jax.lax.stop_gradient(r)}, logits)
    return loss_fn


@register(FedDBEOptions)
def feddbe(model, trainer: LocalTrainer, o: FedDBEOptions, ctx: RunContext) -> Algorithm:
    """FedDBE: FedAvg + a personal representation bias + a regulariser toward the global representation mean."""
    loss_fn = feddbe_loss(model, o.kappa, o.mean_momentum)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        d = feature_dim(model, v, x)
        server = {"params": v["params"], "global_mean": jnp.zeros(d), "measured": jnp.array(False)}
        return server, {"prbm": jnp.zeros(d), "batch_stats": v["batch_stats"]}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        active = server["measured"]
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, server["global_mean"], active)
        params = {"model": server["params"], "prbm": client["prbm"]}
        state = {"bn": client["batch_stats"], "r": jnp.zeros_like(client["prbm"])}
        params, state, _, metrics = trainer.run(fn, params, state, trainer.tx.init(params), data, key)
        return {"params": params["model"], "prbm": params["prbm"], "batch_stats": state["bn"],
                "r": state["r"]}, metrics

    def aggregate(server, trained, weights, info=None):
        measured = server["measured"]
        params = tree_weighted_mean(trained["params"], weights)
        gbar = jnp.sum((weights / jnp.sum(weights))[:, None] * trained["r"], 0)
        # round 0 (the initialisation period) only measures gbar; its models are discarded
        new = {"params": jax.tree_util.tree_map(lambda a, b: jnp.where(measured, a, b), params, server["params"]),
               "global_mean": jnp.where(measured, server["global_mean"], gbar), "measured": jnp.array(True)}
        return new, {"prbm": trained["prbm"], "batch_stats": trained["batch_stats"]}

    def predict(server, client, x, client_id=None):
        return model.apply({"params": server["params"], "batch_stats": client["batch_stats"]}, x, client["prbm"],
                           False, method=biased_forward)[0]

    def predict_trained(server, trained, x, client_id=None):
        return model.apply({"params": trained["params"], "batch_stats": trained["batch_stats"]}, x, trained["prbm"],
                           False, method=biased_forward)[0]

    return Algorithm("feddbe", init, local_update, aggregate, predict, predict_trained)
