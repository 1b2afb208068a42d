"""The masked-averaging family: FedAvg, FedBN, local training, FedProx, FedPer, FedRep, LG-FedAvg, FedPick and
RFedDis are instances of ``masked_averaging`` with other share masks, losses, trainers or warm-up rounds.

Each client trains a full model. After the round the server averages, with the engine's weights, every leaf
whose share mask is True (``aggregation.tree_masked_mean``); leaves whose mask is False are the client's
personal state, the only state it keeps between rounds. At the start of a round a client loads the server's
shared leaves and adds its own.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from ..core.aggregation import broadcast_clients, tree_masked_mean, tree_where
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.trees import PathPredicate, fill, path_mask, prune
from ..core.types import Algorithm, RoundInfo
from ..data.clients import ClientData
from ._common import ce_loss, init_variables, is_batchnorm


def keep_bn_local(share: PathPredicate, local_bn: bool) -> PathPredicate:
    """``share`` with BatchNorm leaves made personal when ``local_bn`` (FedBN-style variants)."""
    return (lambda p: share(p) and not is_batchnorm(p)) if local_bn else share


def masked_averaging(name: str, model, trainer: LocalTrainer, *,
                     share_param: PathPredicate, share_stats: bool | PathPredicate,
                     prox_mu: float = 0.0, train: Callable | None = None,
                     warmup_rounds: int = 0, loss_uses_info: bool = False, loss: Callable | None = None,
                     predict: Callable | None = None) -> Algorithm:
    """An Algorithm that averages the parameters selected by ``share_param(path)`` and the BatchNorm
    statistics selected by ``share_stats`` (a bool or a path predicate), keeping everything else per client.

    A client's persistent state is only its personal leaves (``trees.prune``): FedAvg's is empty, FedBN's its
    BatchNorm leaves. The optimizer starts fresh each round (FedBN's code rebuilds its optimizers every round).
    prox_mu: FedProx's proximal weight (0: plain CE).
    train(trainer, loss_fn, params, stats, opt_state, data, key) -> (params, stats, opt_state, metrics):
        replaces ``trainer.run`` (FedRep's head-then-body epochs).
    warmup_rounds: the first rounds (``RoundInfo.round`` < warmup_rounds) share every leaf (LG-FedAvg).
    loss_uses_info: ``loss`` gets the keyword ``info`` (the client's ``RoundInfo``: schedules).
    loss: replaces ``ce_loss(model, prox_mu)`` (same signature); predict(variables, x): replaces
        ``model.apply(variables, x, train=False)`` and may return (logits, per-sample diagnostics).
    """
    stats_pred = share_stats if callable(share_stats) else (lambda _: share_stats)
    loss_fn = loss or ce_loss(model, prox_mu)
    apply_eval = predict or (lambda variables, x: model.apply(variables, x, train=False))

    def static_masks(variables):
        return {"params": path_mask(variables["params"], share_param),
                "batch_stats": path_mask(variables["batch_stats"], stats_pred)}

    def masks(server, info):
        m = static_masks(server)
        if warmup_rounds:
            warm = info.round < warmup_rounds  # traced: every leaf is shared while warming up
            m = jax.tree_util.tree_map(lambda s: True if s else warm, m)
        return m

    def personal(variables):
        """The leaves a client keeps between rounds: those not always shared."""
        return jax.tree_util.tree_map(lambda s: not s, static_masks(variables))

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        return variables, prune(variables, personal(variables))

    def merged(server, client, m):
        # Shared leaves come from the server, the rest from the client's own leaves.
        return tree_where(m, server, fill(server, client))

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        v = merged(server, client, masks(server, info))
        anchor = jax.lax.stop_gradient(v["params"])
        extra = {"info": info} if loss_uses_info else {}
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, anchor, **extra)
        params, stats, _, metrics = (train or LocalTrainer.run)(
            trainer, fn, v["params"], v["batch_stats"], trainer.tx.init(v["params"]), data, key)
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        m = masks(server, info)
        new = tree_masked_mean(clients, weights, m, server)
        if warmup_rounds:  # while warming up a client's model is the global one: it keeps the averaged leaves
            clients = tree_where(m, broadcast_clients(new, weights.shape[0]), clients)
        return new, prune(clients, personal(server))

    def predict_fn(server, client, x, client_id=None):
        return apply_eval(merged(server, client, static_masks(server)), x)

    def predict_trained(server, trained, x, client_id=None):  # the full model the client just trained
        return apply_eval(trained, x)

    return Algorithm(name, init, local_update, aggregate, predict_fn, predict_trained,
                     share_mask=lambda server, info: masks(server, info)["params"])


@dataclasses.dataclass(frozen=True)
class LocalBNOption(Options):
    """The option of the masked-averaging baselines that can keep BatchNorm per client."""
    local_bn: bool = option(False, "keep BatchNorm per client too (FedBN-style)")
