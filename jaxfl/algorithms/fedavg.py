"""FedAvg, FedBN and local training: one algorithm, three share masks.

Each client trains a full model with weighted CE. After the round the server averages, with sample
weights, every leaf whose share mask is True (``aggregation.tree_masked_mean``); leaves whose mask is False
are the client's personal state, the only state it keeps between rounds (FedAvg: nothing, FedBN: its
BatchNorm leaves). At the start of a round a client loads the server's shared leaves and adds its own.

- ``fedavg``: every parameter and BatchNorm statistic is shared (as FedBN's reference code averages the
  whole state dict).
- ``fedbn``: BatchNorm scale/bias and running statistics stay local (Li et al., ICLR 2021).
- ``local`` (SingleSet): nothing is shared; no communication.

``masked_averaging`` is the family's constructor; FedProx, FedPer, FedRep and LG-FedAvg are instances of it
with other masks, a proximal term, a phased local trainer, or warm-up rounds.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from ..aggregation import broadcast_clients, tree_masked_mean, tree_where
from ..engine import Algorithm, ClientData, LocalTrainer, RoundInfo
from ..losses import cross_entropy, weighted_mean_loss
from ..options import Options, option
from ..trees import PathPredicate, fill, leaf_paths, path_mask, prune, tree_sq_distance  # noqa: F401 (re-exported)


def is_batchnorm(path: tuple[str, ...]) -> bool:
    """True for leaves inside a BatchNorm module (modules named ``bn*`` or ``BatchNorm*``)."""
    return any(k.startswith("bn") or k.startswith("BatchNorm") for k in path)


def in_part(*parts: str) -> PathPredicate:
    """Predicate: the leaf's top-level key (e.g. "encoder", "head") is one of ``parts``."""
    return lambda path: path[0] in parts


def keep_bn_local(share: PathPredicate, local_bn: bool) -> PathPredicate:
    """``share`` with BatchNorm leaves made personal when ``local_bn`` (FedBN-style variants)."""
    return (lambda p: share(p) and not is_batchnorm(p)) if local_bn else share


def ce_loss(model, prox_mu: float = 0.0):
    """loss_fn(params, stats, x, y, w, key, anchor) = weighted CE + prox_mu/2 ||params - anchor||^2.

    Returns (loss, (new_batch_stats, logits)), the LocalTrainer contract; ``anchor`` (the parameters the
    client started the round from) enters only when prox_mu != 0; ``key`` drives dropout, if the model has any.
    """
    def loss_fn(params, stats, x, y, w, key, anchor=None):
        logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                      mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        loss = weighted_mean_loss(cross_entropy(logits, y), w)
        if prox_mu:
            loss = loss + 0.5 * prox_mu * tree_sq_distance(params, anchor)
        return loss, (updated["batch_stats"], logits)
    return loss_fn


def model_variables(state):
    """The model's {"params", "batch_stats"} out of a server or client state that also holds other things
    (control variates, drifts, masks, a personal head)."""
    return {"params": state["params"], "batch_stats": state["batch_stats"]}


def num_classes(model, variables, x) -> int:
    """K, the size of the model's logits [B, K] on inputs x (shapes only: nothing is computed)."""
    return jax.eval_shape(lambda: model.apply(variables, x[:1], False)).shape[-1]


def global_model_predictors(model):
    """(predict, predict_trained) of a method whose clients predict with the server's model: evaluation-mode
    ``model.apply`` of the server's, respectively the just-trained row's, params and BN statistics."""
    def predict(server, client, x, client_id=None):
        return model.apply(model_variables(server), x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(model_variables(trained), x, train=False)

    return predict, predict_trained


def init_variables(model, trainer: LocalTrainer, key, sample_x):
    """{"params", "batch_stats"} of ``model`` initialised on one preprocessed sample (batch_stats {} if none)."""
    variables = model.init(key, trainer.preprocess(sample_x[:1]), train=False)
    return {"params": variables["params"], "batch_stats": variables.get("batch_stats", {})}


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

    return Algorithm(name, init, local_update, aggregate, predict_fn, predict_trained)


@dataclasses.dataclass(frozen=True)
class FedAvgOptions(Options):
    """FedAvg has no options of its own."""
    name = "fedavg"
    sharing = ("all parameters and BN statistics", "nothing")


@dataclasses.dataclass(frozen=True)
class FedBNOptions(Options):
    """FedBN has no options of its own."""
    name = "fedbn"
    sharing = ("all but BatchNorm", "BatchNorm scale/bias and statistics")


@dataclasses.dataclass(frozen=True)
class LocalOptions(Options):
    """Local training has no options."""
    name = "local"
    sharing = ("nothing", "everything")


@dataclasses.dataclass(frozen=True)
class LocalBNOption(Options):
    """The option of the masked-averaging baselines that can keep BatchNorm per client."""
    local_bn: bool = option(False, "keep BatchNorm per client too (FedBN-style)")


def fedavg(model, trainer, **kw) -> Algorithm:
    """FedAvg (McMahan et al. 2017): average every parameter and BN statistic."""
    return masked_averaging("fedavg", model, trainer, share_param=lambda p: True, share_stats=True, **kw)


def fedbn(model, trainer, **kw) -> Algorithm:
    """FedBN (Li et al. 2021): average everything except BatchNorm layers, which stay per client."""
    return masked_averaging("fedbn", model, trainer, share_param=lambda p: not is_batchnorm(p),
                            share_stats=False, **kw)


def local(model, trainer, **kw) -> Algorithm:
    """SingleSet / local training: nothing is shared."""
    return masked_averaging("local", model, trainer, share_param=lambda p: False, share_stats=False, **kw)
