"""FedAMP (Huang et al., AAAI 2021, "Personalized Cross-Silo Federated Learning on Non-IID Data"): attentive
message passing between personal models.

The server holds every client's latest personal model w_j (the paper's server needs them all). For client i it
builds a personalized cloud model from the models of the clients that have uploaded one,

    u_i = xi_ii w_i + sum_{j != i} xi_ij w_j,   xi_ii = 1 - sum_{j != i} xi_ij,
    xi_ij = alpha A'(||w_i - w_j||^2) = (alpha / sigma) exp(-||w_i - w_j||^2 / sigma)

(A(x) = 1 - exp(-x / sigma); ``heuristic``: HeurFedAMP, xi_ii = ``self_weight`` and the rest split by a softmax
of sigma cos(w_i, w_j)), and client i trains its own model w_i on CE + lam / (2 alpha) ||w - u_i||^2, then
uploads it into the server's table. Distances, cosines and u_i are over the parameters; BatchNorm statistics
stay with the client. A client predicts with its own w_i.

Defaults: alpha = lam = 1 (PFLlib), sigma = 1e4: PFLlib's sigma = 1 makes exp(-d^2 / sigma) ~ 0 for the
squared distances of trained nets (d^2 ~ 1e2-1e4), which reduces FedAMP to local training (PFLlib issues #36,
#95); sigma must be on the scale of the squared model distances of the task.

Reference: no official code was found. Read against PFLlib (TsingZ0/PFLlib @ d832e76f, ``serveramp.py``
``send_models``, ``clientamp.py``), FLGo (WwZzz/easyFL @ ea07f1d0, ``fedamp.py``) and fluke (makgyver/fluke @
a0bd26ab, ``fedamp.py``).

Deviations:
- Attention is over every client with a model in the server's table (the paper's all j); PFLlib uses last
  round's uploaders, fluke this round's cohort.
- The proximal term is squared (paper, FLGo, fluke); PFLlib's is the unsquared norm.
- Local training starts from the client's own w_i (PFLlib, fluke); FLGo starts from u_i.
- sigma's default (above) is not a reference's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import write_rows
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.hypernet import require_table_size
from ._common import ce_loss, init_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedAMPOptions(Options):
    name = "fedamp"
    multilabel = True
    server_client_rows = True  # (the server's table, one row per training client)
    sharing = ("its trained model, kept in the server's table of all N personal models; it receives u_i, an "
               "attention-weighted combination of them", "its BN statistics")
    alpha: float = option(1.0, "alpha: the attention step (xi_ij = alpha/sigma exp(-d^2/sigma)) and lam/alpha's",
                          lo=0.0, lo_open=True)
    lam: float = option(1.0, "lambda: the proximal weight lam / (2 alpha) ||w - u_i||^2", lo=0.0)
    sigma: float = option(1e4, "sigma: the attention kernel's scale (of squared model distances; heuristic: "
                               "the softmax temperature of the cosines)", lo=0.0, lo_open=True)
    heuristic: bool = option(False, "HeurFedAMP: xi_ii = self_weight, the rest by a softmax of sigma cos(w_i, w_j)")
    self_weight: float = option(0.1, "HeurFedAMP's xi_ii", lo=0.0, hi=1.0)


def table_distances(table, row):
    """||row - table_j||^2, <row, table_j>, ||table_j||^2 and ||row||^2 summed over the leaves, by Gram terms (no
    [N, ...] difference is built). table: leaves [N, ...]; row: leaves [...] -> ([N], [N], [N], [])."""
    def terms(t, r):
        flat = t.reshape(t.shape[0], -1)
        return flat @ r.reshape(-1), jnp.sum(flat * flat, -1)
    dots, sq = zip(*(terms(t, r) for t, r in zip(jax.tree_util.tree_leaves(table), jax.tree_util.tree_leaves(row))))
    dot, sq_t = sum(dots), sum(sq)
    sq_r = sum(jnp.sum(r * r) for r in jax.tree_util.tree_leaves(row))
    return jnp.maximum(sq_r + sq_t - 2 * dot, 0.0), dot, sq_t, sq_r


def attention_weights(dist2, dot, sq_t, sq_r, others, alpha: float, sigma: float, heuristic: bool,
                      self_weight: float):
    """xi over the table's rows for one client (its own row's entry is 0) and xi_ii.

    FedAMP: xi_j = alpha / sigma exp(-dist2_j / sigma) for the rows in ``others``, xi_ii = 1 - sum_j xi_j.
    Heuristic: xi_j = (1 - self_weight) softmax_{others}(sigma cos_j), xi_ii = self_weight (1 without others).
    dist2, dot, sq_t, others [N] (bool); sq_r [] -> ([N], [])."""
    if heuristic:
        cos = dot / jnp.maximum(jnp.sqrt(sq_t * sq_r), 1e-12)
        logits = jnp.where(others, sigma * cos, -jnp.inf)
        any_other = jnp.any(others)
        soft = jax.nn.softmax(jnp.where(any_other, logits, 0.0))
        xi = jnp.where(others & any_other, (1 - self_weight) * soft, 0.0)
        return xi, jnp.where(any_other, self_weight, 1.0)
    xi = jnp.where(others, alpha / sigma * jnp.exp(-dist2 / sigma), 0.0)
    return xi, 1.0 - jnp.sum(xi)


def combine(table, xi, row, xi_self):
    """u = xi_self row + sum_j xi_j table_j, leaf by leaf. table [N, ...], xi [N], row [...]."""
    return jax.tree_util.tree_map(lambda t, r: xi_self * r + jnp.tensordot(xi, t, axes=1), table, row)


@register(FedAMPOptions)
def fedamp(model, trainer: LocalTrainer, o: FedAMPOptions, ctx: RunContext) -> Algorithm:
    """FedAMP (or HeurFedAMP): personal models, each pulled toward an attention-weighted mix of the others."""
    require_table_size("fedamp", ctx.num_clients)
    n = ctx.num_clients
    loss_fn = ce_loss(model, prox_mu=o.lam / o.alpha)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        table = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), v["params"])
        return {"models": table, "uploaded": jnp.zeros(n, bool)}, {"batch_stats": v["batch_stats"]}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        i = info.client_id
        table = server["models"]
        own = jax.tree_util.tree_map(lambda t: t[i], table)
        dist2, dot, sq_t, sq_r = table_distances(table, own)
        others = server["uploaded"] & (jnp.arange(n) != i)
        xi, xi_self = attention_weights(dist2, dot, sq_t, sq_r, others, o.alpha, o.sigma, o.heuristic,
                                        o.self_weight)
        u = jax.lax.stop_gradient(combine(table, xi, own, xi_self))
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, u)
        params, stats, _, metrics = trainer.run(fn, own, client["batch_stats"], trainer.tx.init(own), data, key)
        return {"params": params, "batch_stats": stats}, dict(metrics, self_attention=xi_self)

    def aggregate(server, trained, weights, info: RoundInfo):
        table = write_rows(server["models"], info.client_id, weights, trained["params"])
        uploaded = write_rows(server["uploaded"], info.client_id, weights, jnp.ones(weights.shape, bool))
        return {"models": table, "uploaded": uploaded}, {"batch_stats": trained["batch_stats"]}

    def predict(server, client, x, client_id):
        params = jax.tree_util.tree_map(lambda t: t[client_id], server["models"])
        return model.apply({"params": params, "batch_stats": client["batch_stats"]}, x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(trained, x, train=False)

    return Algorithm("fedamp", init, local_update, aggregate, predict, predict_trained)
