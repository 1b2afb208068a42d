"""FedALA (Zhang et al., AAAI 2023, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning"):
FedAvg whose clients start each round from a learned, element-wise blend of their local model and the global one.

The parameters split into lower layers (taken from the global model theta_g) and the higher layers H
(``layers``: the head's last Dense, the official p = 2; the whole head; or every layer, p = 0). Client i keeps its
higher layers theta_i^H from its last training and element-wise weights W_i in [0, 1] (initially 1). Adaptive
local aggregation (ALA) at the start of a round:

    theta^H(W) = theta_i^H + (theta_g^H - theta_i^H) * W
    on each batch of a contiguous random window of rand_percent% of its samples (stored order, batch B):
        W <- clip(W - eta * dL/dtheta^H * (theta_g^H - theta_i^H), 0, 1)      (L: CE of [theta_g^lower; theta^H(W)])

one pass over the window, except the first time ALA runs (the client's second participation: in its first,
local and global agree): then passes repeat until more than ``num_pre_loss`` have run and the population std of
the last ``num_pre_loss`` passes' final losses is below ``threshold`` (at most ``max_start_epochs``). The client
then trains [theta_g^lower; theta^H(W)] as FedAvg does and uploads it; the server averages the parameters (the
engine's weights). BatchNorm statistics stay with the client (the official code sends parameters only). A client
predicts with the ALA initialisation from the current global model and its W (without a further weight-learning
pass). Defaults: eta = 1, rand_percent = 80, threshold = 0.1, num_pre_loss = 10 (the official code's).

Reference: TsingZ0/FedALA @ a7a9b213 (``system/utils/ALA.py`` ``adaptive_local_aggregation``,
``flcore/clients/clientALA.py``); PFLlib's ``ALA.py`` is the same code.

Deviations:
- ALA runs for the cohort's clients only (officially every client receives the model and runs ALA every round;
  identical with every client in every round).
- The first ALA's convergence loop stops after ``max_start_epochs`` passes (the official loop has no cap).
- Prediction skips the weight-learning pass the official evaluation runs after receiving the global model.
- Local training shuffles and keeps the last partial batch (the run's trainer); the official loader does not
  shuffle and drops it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, batch_of
from ..core.trees import fill, path_mask, prune
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import aux_key, ce_loss, head_dense_names, init_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedALAOptions(Options):
    name = "fedala"
    client_state = True
    server_optimizer = True
    user_dp = True
    sharing = ("all parameters (FedAvg)",
               "its higher layers, their element-wise aggregation weights W and its BN statistics")
    layers: str = option("head_last", "the higher layers ALA blends: the head's last Dense (official p = 2), "
                                      "the whole head, or every layer (p = 0)", choices=("head_last", "head", "all"))
    eta: float = option(1.0, "step size of the aggregation weights W", lo=0.0, lo_open=True)
    rand_percent: float = option(80.0, "percent of a client's samples in ALA's window", lo=0.0, hi=100.0,
                                 lo_open=True)
    threshold: float = option(0.1, "the first ALA stops when the std of its last passes' losses is below it",
                              lo=0.0, lo_open=True)
    num_pre_loss: int = option(10, "passes whose losses the first ALA's stopping rule looks at", minimum=2)
    max_start_epochs: int = option(200, "cap on the first ALA's passes", minimum=1)


def higher_layers(params, layers: str):
    """Python-bool tree: True for the leaves ALA blends. "head_last": the head's last Dense (the ``fc<k>`` of
    largest k; the whole head if it has none), "head": every head leaf, "all": every leaf."""
    if layers == "all":
        return path_mask(params, lambda p: True)
    fcs = head_dense_names(params["head"])
    last = fcs[-1] if fcs else None
    if layers == "head" or last is None:
        return path_mask(params, lambda p: p[0] == "head")
    return path_mask(params, lambda p: p[0] == "head" and p[1] == last)


def blend(local, glob, weights):
    """theta_local + (theta_global - theta_local) * W, leaf by leaf."""
    return jax.tree_util.tree_map(lambda a, g, w: a + (g - a) * w, local, glob, weights)


def weight_step(weights, grads, local, glob, eta: float):
    """W <- clip(W - eta * grad * (theta_global - theta_local), 0, 1), leaf by leaf (dL/dW by the chain rule)."""
    return jax.tree_util.tree_map(lambda w, g, a, b: jnp.clip(w - eta * g * (b - a), 0.0, 1.0),
                                  weights, grads, local, glob)


def converged(losses, count, num_pre_loss: int, threshold: float):
    """The first ALA's stopping rule: more than ``num_pre_loss`` passes and the population std of the last
    ``num_pre_loss`` pass losses below ``threshold``. losses [num_pre_loss] (a ring buffer), count [] (passes)."""
    return (count > num_pre_loss) & (jnp.std(losses) < threshold)


@register(FedALAOptions)
def fedala(model, trainer: LocalTrainer, o: FedALAOptions, ctx: RunContext) -> Algorithm:
    """FedALA: FedAvg with adaptive local aggregation of the higher layers at each client."""
    b = trainer.batch_size
    train_loss = ce_loss(model)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        top = prune(v["params"], higher_layers(v["params"], o.layers))
        return ({"params": v["params"]},
                {"top": top, "W": jax.tree_util.tree_map(jnp.ones_like, top), "first_ala": jnp.array(True),
                 "trained": jnp.array(False), "batch_stats": v["batch_stats"]})

    def ala(glob, client, data, key):
        """(W, the blended higher layers, passes run) after adaptive local aggregation on the client's window."""
        mask = higher_layers(glob, o.layers)
        g_top, top, stats = prune(glob, mask), client["top"], client["batch_stats"]
        n = data.count
        r = jnp.floor(o.rand_percent / 100.0 * n).astype(n.dtype)
        start = jax.random.randint(key, (), 0, n - r + 1)
        batches = (r + b - 1) // b

        def window_loss(h, t):
            pos = start + t * b + jnp.arange(b)
            w = (pos < start + r).astype(jnp.float32)
            x, y = batch_of(data, jnp.minimum(pos, data.count - 1))
            logits, _ = model.apply({"params": fill(glob, h), "batch_stats": stats}, trainer.preprocess(x),
                                    train=True, mask=w, mutable=["batch_stats"])
            return weighted_mean_loss(cross_entropy(logits, y), w)

        def one_pass(weights):
            def step(t, carry):
                weights, _ = carry
                loss, grads = jax.value_and_grad(window_loss)(blend(top, g_top, weights), t)
                return weight_step(weights, grads, top, g_top, o.eta), loss
            return jax.lax.fori_loop(0, batches, step, (weights, jnp.float32(0.0)))

        def body(carry):
            weights, losses, count = carry
            weights, last = one_pass(weights)
            return weights, losses.at[count % o.num_pre_loss].set(last), count + 1

        def cond(carry):
            _, losses, count = carry
            done = converged(losses, count, o.num_pre_loss, o.threshold) | (count >= o.max_start_epochs)
            return jnp.where(client["first_ala"], ~done, count < 1)

        weights, _, count = jax.lax.while_loop(cond, body, (client["W"], jnp.zeros(o.num_pre_loss), 0))
        return weights, blend(top, g_top, weights), count

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        glob = server["params"]
        weights, top, passes = ala(glob, client, data, aux_key(key))
        run = client["trained"]  # in a client's first participation its model is the global one: no ALA
        weights = jax.tree_util.tree_map(lambda w, w0: jnp.where(run, w, w0), weights, client["W"])
        start = jax.tree_util.tree_map(lambda a, g: jnp.where(run, a, g), fill(glob, top), glob)
        params, stats, _, metrics = trainer.run(train_loss, start, client["batch_stats"], trainer.tx.init(start),
                                                data, key)
        mask = higher_layers(glob, o.layers)
        return ({"params": params, "batch_stats": stats, "W": weights, "top": prune(params, mask),
                 "first_ala": client["first_ala"] & ~run, "trained": jnp.ones_like(run)},
                dict(metrics, ala_passes=jnp.where(run, passes, 0).astype(jnp.float32)))

    def aggregate(server, trained, weights, info=None):
        kept = {k: trained[k] for k in ("top", "W", "first_ala", "trained", "batch_stats")}
        return {"params": tree_weighted_mean(trained["params"], weights)}, kept

    def predict(server, client, x, client_id=None):
        glob = server["params"]
        top = blend(client["top"], prune(glob, higher_layers(glob, o.layers)), client["W"])
        return model.apply({"params": fill(glob, top), "batch_stats": client["batch_stats"]}, x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply({"params": trained["params"], "batch_stats": trained["batch_stats"]}, x, train=False)

    return Algorithm("fedala", init, local_update, aggregate, predict, predict_trained)
