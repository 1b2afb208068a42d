"""DapperFL (Jia et al., NeurIPS 2024): model fusion pruning, domain-adaptive regularisation, heterogeneous
aggregation with recovery.

Client i (``RoundInfo.client_id``) has a pruning ratio rho_i, its device level ``ratios[i % len(ratios)]``.
In round t (0-based r = t - 1) it loads the global model W (params and BN statistics) and:
1. trains one dense epoch with L = CE + gamma R(z), R(z) = ||z||_2 of the penultimate feature (``dar_norm``
   "l2") or ||z||_2^2 ("sq_l2");
2. fuses w = a_t W + (1 - a_t) w_hat, a_t = max((1 - eps)^r alpha0, alpha_min), skipped when r = 0 (W is then
   the random init) or when ``use_fusion`` is off;
3. builds its mask M_i from the fused weights at ratio rho_i (``pruning_masks``: the spec's per-layer rules);
4. trains E - 1 more epochs of the masked model (the forward pass always uses w * M; momentum carries over).
The server recovers and averages in one masked reduction (``core.aggregation.recovered_mean``):

    W <- W + sum_i p_i M_i (w_i - W),  p_i = n_i / sum_j n_j            (``recover_mode="global"``, Eq. 6-7)

or averages the pruned entries as zeros: W <- sum_i p_i M_i w_i (``recover_mode="zero"``). BN running
statistics (``bn_stats="follow"``, default) follow the same rule channel by channel, with the mask of the conv
output channel that feeds the BN (``bn_channel_masks``); ``bn_stats="unmasked"`` averages them with p_i over all
clients. Everything is evaluated with the global model. A straggler (``--stragglers``) runs e of the E local
epochs: the dense one, then e - 1 masked.

Deviations:
- R(z) defaults to the released code's ||z||_2 (``dar_norm="l2"``); the paper's ||z||_2^2 is ``"sq_l2"``.
- The defaults follow the paper (fusion, recovery); the released code never fuses and averages pruned entries
  as zeros: its preset is ``use_fusion=False, recover_mode="zero", bn_stats="unmasked"``.
- BN statistics follow the masks by default (the released code averages them unmasked): a client that pruned
  a channel measured statistics of an all-zero input, which under recovery would be paired with the
  recovered, non-zero weights.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import recovered_mean, tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, client_epochs
from ..core.trees import leaf_paths, map_with_paths
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.losses import feature_norm
from ..ops.masks import tree_count, tree_density
from ._common import global_model_predictors, init_variables
from ._registry import register
from ._submodel import DEVICE_RATIOS, check_ratios, client_ratio, pruning_masks


RECOVER_MODES = ("global", "zero")
BN_STATS = ("follow", "unmasked")
def fusion_coefficient(round_idx, alpha0: float = 0.9, alpha_min: float = 0.1, eps: float = 0.2):
    """a = max((1 - eps)^r alpha0, alpha_min) for the 0-based round r (0.9, 0.72, 0.576, ... then 0.1)."""
    return jnp.maximum((1.0 - eps) ** jnp.asarray(round_idx, jnp.float32) * alpha0, alpha_min)


def bn_channel_masks(mask, batch_stats):
    """Per BN statistics leaf, 1.0 for the channels whose input the client computed: the BN ``.../bnX/{mean,
    var}`` follows the conv ``.../convX/kernel`` of the same parent, and channel c is live when that kernel's
    mask keeps any entry of output channel c. A BN with no such conv (the stem's, or a Dense's) is all ones.
    Shapes: mask: params' structure, conv kernels [kh, kw, in, out]; batch_stats leaves [C] -> leaves [C].
    """
    masks = dict(zip(leaf_paths(mask), jax.tree_util.tree_leaves(mask)))

    def rule(path, leaf):
        bn = path[-2]
        kernel = masks.get(path[:-2] + ("conv" + bn[2:], "kernel")) if bn.startswith("bn") else None
        if kernel is None or kernel.ndim < 2 or kernel.shape[-1] != leaf.shape[-1]:
            return jnp.ones_like(leaf)
        return jnp.any(kernel != 0, axis=tuple(range(kernel.ndim - 1))).astype(leaf.dtype)

    return map_with_paths(rule, batch_stats)


@dataclasses.dataclass(frozen=True)
class DapperFLOptions(Options):
    name = "dapperfl"
    sharing = ("everything (global model), each client's update masked by its pruning mask; pruned entries "
               "keep the previous global value", "nothing (its pruning ratio follows from its id)")
    # the released code (dapperfl.py: optim.SGD(lr=local_lr, momentum=0.9, weight_decay=1e-5); best_args.py:
    # local_lr 0.01, local_batch_size 64)
    train_preset = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 64}
    device_ratios: tuple[float, ...] = option(DEVICE_RATIOS, "pruning ratio per device level, comma-separated; "
                                              "client i gets level i mod len", lo=0.0, hi=1.0)
    gamma: float = option(0.01, "weight of the DAR term ||z||", lo=0.0)
    use_fusion: bool = option(True, "fuse local and global weights before pruning (--no-...: released code)")
    recover_mode: str = option("global", "global (pruned entries keep W, paper) | zero (averaged as zeros, "
                               "released code)", choices=RECOVER_MODES)
    bn_stats: str = option("follow", "follow (each BN channel's statistics aggregated by recover_mode, masked "
                           "by the feeding conv's output channel) | unmasked (plain mean, released code)",
                           choices=BN_STATS)
    dar_norm: str = option("l2", "l2 (||z||, code) | sq_l2 (||z||^2, paper)", choices=("l2", "sq_l2"))
    alpha0: float = option(0.9, "initial fusion weight of the global model", lo=0.0, hi=1.0)
    alpha_min: float = option(0.1, "floor of the fusion weight", lo=0.0, hi=1.0)
    fusion_eps: float = option(0.2, "decay of the fusion weight per round", lo=0.0, hi=1.0)

    def check(self) -> None:
        check_ratios("dapperfl", self.device_ratios, below_one=False)

@register(DapperFLOptions)
def dapperfl(model, trainer: LocalTrainer, o: DapperFLOptions, ctx: RunContext) -> Algorithm:
    """DapperFL on a ``Classifier`` (encoder features z = the DAR input); options: ``DapperFLOptions``.
    ``trainer.epochs`` = E: 1 dense epoch, then E - 1 masked ones. ``device_ratios``: rho per capability
    level, client i gets level i mod len."""
    device_ratios, gamma, use_fusion, recover_mode, dar_norm = (o.device_ratios, o.gamma, o.use_fusion,
                                                                o.recover_mode, o.dar_norm)
    alpha0, alpha_min, fusion_eps, bn_stats = o.alpha0, o.alpha_min, o.fusion_eps, o.bn_stats
    ratios = jnp.asarray(device_ratios, jnp.float32)

    def forward(module, x, train, mask):
        z = module.encoder(x, train, mask)
        return module.head(z, train, mask), z

    def loss_with(mask):
        def loss(params, stats, x, y, w, key):
            eff = jax.tree_util.tree_map(jnp.multiply, params, mask)  # the pruned model w * M
            (logits, z), upd = model.apply({"params": eff, "batch_stats": stats}, x, True, w, method=forward,
                                           mutable=["batch_stats"])
            reg = feature_norm(z, squared=dar_norm == "sq_l2")
            return weighted_mean_loss(cross_entropy(logits, y) + gamma * reg, w), (upd["batch_stats"], logits)
        return loss

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        return v, {}  # a client keeps nothing: its device level follows from its id

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        rho = client_ratio(ratios, info)
        ones = jax.tree_util.tree_map(jnp.ones_like, server["params"])
        opt = trainer.tx.init(server["params"])
        params, stats, opt, m_dense = trainer.run(loss_with(ones), server["params"], server["batch_stats"], opt,
                                                  data, key, epochs=1)  # as FedAvg's first epoch
        if use_fusion:
            a = jnp.where(info.round > 0, fusion_coefficient(info.round, alpha0, alpha_min, fusion_eps), 0.0)
            params = jax.tree_util.tree_map(lambda g, w: a * g + (1.0 - a) * w, server["params"], params)
        mask = pruning_masks(params, rho)
        params = jax.tree_util.tree_map(jnp.multiply, params, mask)
        metrics = m_dense
        if trainer.epochs > 1:  # the other E - 1 epochs masked (a straggler: e - 1 of its e)
            rest = client_epochs(data, trainer.epochs) - 1
            params, stats, opt, m_masked = trainer.run(loss_with(mask), params, stats, opt, data,
                                                       jax.random.fold_in(key, 1), epochs=rest)
            metrics = jax.tree_util.tree_map(lambda a, b: jnp.where(rest > 0, a, b), m_masked, m_dense)
        metrics = dict(metrics, ratio=rho, kept_params=tree_count(mask), kept_fraction=tree_density(mask))
        return {"params": params, "batch_stats": stats, "mask": mask}, metrics

    def masked_aggregate(values, masks, previous, weights):
        if recover_mode == "global":
            return jax.tree_util.tree_map(lambda x, m, g: recovered_mean(x, weights, m, g), values, masks, previous)
        return tree_weighted_mean(jax.tree_util.tree_map(jnp.multiply, values, masks), weights)

    def aggregate(server, clients, weights, info: RoundInfo):
        params = masked_aggregate(clients["params"], clients["mask"], server["params"], weights)
        stats = clients["batch_stats"]
        if bn_stats == "follow":
            live = jax.vmap(bn_channel_masks)(clients["mask"], stats)
            stats = masked_aggregate(stats, live, server["batch_stats"], weights)
        else:
            stats = tree_weighted_mean(stats, weights)
        return {"params": params, "batch_stats": stats}, {}

    return Algorithm("dapperfl", init, local_update, aggregate, *global_model_predictors(model))
