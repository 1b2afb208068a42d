"""FedPAC (Xu, Tong, Huang, ICLR 2023): feature alignment to global prototypes + classifier collaboration.

The body f (``encoder``, features z = f(x) in R^d) is shared; the classifier g (``head``) is personal. Client i:
1. Statistics (before training; eval mode, the received body): n_i samples, n_ik of class k, p_ik = n_ik/n_i,
   class means mu_ik:  v_i = (sum_k p_ik E_{y=k}||z||^2 - sum_k p_ik^2 ||mu_ik||^2) / n_i,  H_i[k] = p_ik mu_ik
   ([C, d]; ``statistics_extraction``, including its final division by the data size n_i).
2. ``head_epochs`` (1) epochs on the head only with CE, then E epochs on the body only with
   CE + lam * 1/(B d) sum_b ||z_b - c_{y_b}||^2 (mean over batch and dimension), c_k the server's global
   prototype of class k, or the client's own pre-training mean mu_ik when no client of the last round had class
   k; no alignment term in round 0.
3. Uploads its local prototypes after training (class means of z, eval mode) and class counts n_ik.
Server: body and the body's BN statistics averaged with the engine's weights; global prototypes
c_k = sum_i n_ik mu'_ik / sum_i n_ik over this round's cohort (replaced each round; a class nobody had is marked
absent); for each cohort client i, alpha_i = argmin_{alpha in simplex} alpha^T (diag(v) + D_i) alpha with
D_i[j, l] = <H_i - H_j, H_i - H_l>_F, entries below 1e-3 zeroed, g_i <- sum_j alpha_ij g_j / sum_j alpha_ij over
the cohort's trained heads. Options: ``lam`` = 1.0, ``head_epochs`` = 1, ``combine_heads`` = True, ``qp_iters``
= 1000 (ours). Per client: its head (params and any head BN statistics). Server: the body, the global
prototypes [C, d] and their class counts [C] (count 0: absent).

Deviations:
- The QP is ``simplex_qp``, a pure, vmapped FISTA solver (step 1 / (2 lambda_max), ``qp_iters`` iterations,
  Duchi et al.'s sort-based simplex projection) instead of cvxpy per client; P is PSD by construction (v_i >= 0,
  D_i a Gram matrix), so the official eigenvalue clipping and its "keep the local head" fallback are omitted.
- The official local optimiser is hard-coded (SGD momentum 0.5, weight decay 5e-4, head lr 0.1, body lr
  ``--lr``); here both phases use the configured client optimizer (fresh each phase), as FedRep here does.
- Post-training prototypes in eval mode (official: train mode; no difference for its BN-free CNN), so they do
  not move BN statistics. A head with BN has its statistics combined with the same alpha as its parameters.
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
from ..ops.qp import head_weights
from ._common import ce_loss, class_feature_sums, in_part, init_variables, model_variables, only
from ._registry import register


# -- feature statistics and prototypes ---------------------------------------------------------------------
def client_statistics(S1, S2, N):
    """(v, H, mu) of ``statistics_extraction`` from the class sums: n = sum N, p = N / n, mu_k = S1_k / N_k
    (0 for an absent class), v = (sum_k p_k S2_k / N_k - sum_k p_k^2 ||mu_k||^2) / n, H = p[:, None] mu."""
    n = jnp.maximum(jnp.sum(N), 1.0)
    p = N / n
    mu = S1 / jnp.maximum(N, 1.0)[:, None]
    v = (jnp.sum(S2) / n - jnp.sum(p * p * jnp.sum(mu * mu, -1))) / n
    return v, p[:, None] * mu, mu


def global_prototypes(protos, counts):
    """(c [C, d], total [C]): per class the count-weighted mean of the cohort's local prototypes protos [k, C, d]
    with class counts [k, C] (official ``protos_aggregation``); a class no client has gets 0 and total 0."""
    total = jnp.sum(counts, 0)
    c = jnp.einsum("ik,ikd->kd", counts, protos) / jnp.maximum(total, 1.0)[:, None]
    return c, total


def alignment_loss(model, lam: float):
    """loss_fn(params, stats, x, y, w, key, targets, gate) = CE + gate * lam * sum_b w_b ||z_b - targets[y_b]||^2
    / (d sum_b w_b): FedPAC's body objective (the MSE is torch's mean over batch and dimension)."""
    def feats_logits(module, x, train, mask):
        z = module.encoder(x, train, mask)
        return z, module.head(z, train, mask)

    def loss_fn(params, stats, x, y, w, key, targets, gate):
        (z, logits), updated = model.apply({"params": params, "batch_stats": stats}, x, True, w,
                                           method=feats_logits, mutable=["batch_stats"],
                                           rngs=None if key is None else {"dropout": key})
        sq = jnp.sum(jnp.square(z - jax.lax.stop_gradient(targets[y])), -1) / z.shape[-1]
        loss = weighted_mean_loss(cross_entropy(logits, y), w) + gate * lam * weighted_mean_loss(sq, w)
        return loss, (updated["batch_stats"], logits)
    return loss_fn


# -- the algorithm -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FedPACOptions(Options):
    name = "fedpac"
    client_state = True
    sharing = ("body (encoder), class prototypes and feature statistics; heads for the combination",
               "head (a convex combination of the cohort's heads)")
    lam: float = option(1.0, "lambda, weight of the feature-alignment MSE to the global prototypes", lo=0.0)
    head_epochs: int = option(1, "head-only CE epochs before the body epochs", minimum=0)
    combine_heads: bool = option(True, "replace each head by its QP-weighted combination of the cohort's heads")
    qp_iters: int = option(1000, "projected-gradient iterations of the simplex QP", minimum=1)


def head_part(variables):
    """The head's leaves of {"params", "batch_stats"} (a head without BN has no statistics)."""
    return {k: {p: v for p, v in variables[k].items() if p == "head"} for k in ("params", "batch_stats")}


@register(FedPACOptions)
def fedpac(model, trainer: LocalTrainer, o: FedPACOptions, ctx: RunContext) -> Algorithm:
    """FedPAC: shared body aligned to global class prototypes, personal heads combined by a simplex QP."""
    head_tx, body_tx = only(trainer.tx, in_part("head")), only(trainer.tx, in_part("encoder"))
    head_trainer = dataclasses.replace(trainer, tx=head_tx, epochs=o.head_epochs)
    body_trainer = dataclasses.replace(trainer, tx=body_tx)
    ce, align = ce_loss(model), alignment_loss(model, o.lam)

    def merged(server, client):
        return {k: {**server[k], **client[k]} for k in ("params", "batch_stats")}

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        z = jax.eval_shape(lambda: model.apply(v, x, train=False, method="features"))
        c = jax.eval_shape(lambda: model.apply(v, x, train=False)).shape[-1]
        server = dict(v, protos=jnp.zeros((c, z.shape[-1])), proto_count=jnp.zeros(c))
        return server, head_part(v)

    def stats(variables, data, c):
        return class_feature_sums(model, variables, data, c, trainer.batch_size, trainer.preprocess)

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        c = server["protos"].shape[0]
        v = merged(server, client)
        s1, s2, n = stats(v, data, c)
        var, h, mu = client_statistics(s1, s2, n)
        targets = jnp.where((server["proto_count"] > 0)[:, None], server["protos"], mu)
        gate = (info.round > 0).astype(jnp.float32)
        params, bstats, metrics = v["params"], v["batch_stats"], None
        if o.head_epochs:
            params, bstats, _, metrics = head_trainer.run(ce, params, bstats, head_tx.init(params), data,
                                                          jax.random.fold_in(key, 0))
        if trainer.epochs:
            fn = lambda p, s, x, y, w, k: align(p, s, x, y, w, k, targets, gate)
            params, bstats, _, metrics = body_trainer.run(fn, params, bstats, body_tx.init(params), data,
                                                          jax.random.fold_in(key, 1))
        trained = {"params": params, "batch_stats": bstats}
        s1_after, _, n_after = stats(trained, data, c)
        protos = s1_after / jnp.maximum(n_after, 1.0)[:, None]
        return dict(trained, v=var, h=h, protos=protos, counts=n), metrics

    def aggregate(server, trained, weights, info=None):
        body = lambda t: {k: {p: x for p, x in t[k].items() if p != "head"} for k in ("params", "batch_stats")}
        mean = tree_weighted_mean(body(trained), weights)
        protos, count = global_prototypes(trained["protos"], trained["counts"])
        new_server = {k: {**server[k], **mean[k]} for k in ("params", "batch_stats")}
        new_server.update(protos=protos, proto_count=count)
        heads = head_part(trained)
        if o.combine_heads:
            A = head_weights(trained["v"], trained["h"], o.qp_iters, weights > 0)  # (padding rows: no weight)
            heads = jax.tree_util.tree_map(
                lambda x: (A.astype(x.dtype) @ x.reshape(x.shape[0], -1)).reshape(x.shape), heads)
        return new_server, heads

    def predict(server, client, x, client_id=None):
        return model.apply(merged(server, client), x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(model_variables(trained), x, train=False)

    return Algorithm("fedpac", init, local_update, aggregate, predict, predict_trained)
