"""FedAvg, FedBN and local training: one algorithm, three share masks.

Each client trains a full model with weighted CE. After the round the server averages, with sample
weights, every leaf whose share mask is True (``aggregation.tree_masked_mean``); leaves whose mask is False
stay in their client's row. At the start of a round a client loads the server's shared leaves and keeps
its own for the rest.

- ``fedavg``: every parameter and BatchNorm statistic is shared (as FedBN's reference code averages the
  whole state dict).
- ``fedbn``: BatchNorm scale/bias and running statistics stay local (Li et al., ICLR 2021).
- ``local`` (SingleSet): nothing is shared; no communication.
"""
from __future__ import annotations

from typing import Callable

import jax

from ..aggregation import tree_masked_mean, tree_where
from ..engine import Algorithm, ClientData, LocalTrainer
from ..losses import cross_entropy, weighted_mean_loss


def path_mask(tree, predicate: Callable[[tuple[str, ...]], bool]):
    """A tree of Python bools: predicate(path) for each leaf, path = tuple of dict keys."""
    def key_name(k):
        return str(getattr(k, "key", getattr(k, "name", k)))
    return jax.tree_util.tree_map_with_path(lambda p, _: bool(predicate(tuple(map(key_name, p)))), tree)


def is_batchnorm(path: tuple[str, ...]) -> bool:
    """True for leaves inside a BatchNorm module (modules named ``bn*`` or ``BatchNorm*``)."""
    return any(k.startswith("bn") or k.startswith("BatchNorm") for k in path)


def masked_averaging(name: str, model, trainer: LocalTrainer, *,
                     share_param: Callable[[tuple[str, ...]], bool],
                     share_stats: bool, reset_optimizer: bool = True) -> Algorithm:
    """An Algorithm that averages the parameters selected by ``share_param(path)`` (and all BatchNorm
    statistics if ``share_stats``) and keeps everything else per client.

    ``reset_optimizer``: start each round with a fresh optimizer state (FedBN's code rebuilds its
    optimizers every round).
    """
    def masks(variables):
        return {"params": path_mask(variables["params"], share_param),
                "batch_stats": path_mask(variables["batch_stats"], lambda _: share_stats)}

    def split(variables):
        return {"params": variables["params"], "batch_stats": variables.get("batch_stats", {})}

    def init(key, sample_x):
        variables = split(model.init(key, trainer.preprocess(sample_x[:1]), train=False))
        client = dict(variables, opt_state=trainer.tx.init(variables["params"]))
        return variables, client

    def merged(server, client):
        # Shared leaves come from the server, the rest from the client's own row.
        return tree_where(masks(server), server, {k: client[k] for k in server})

    def loss_fn(params, stats, x, y, w, key):
        logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                      mutable=["batch_stats"])
        return weighted_mean_loss(cross_entropy(logits, y), w), (updated["batch_stats"], logits)

    def local_update(server, client, data: ClientData, key):
        v = merged(server, client)
        opt_state = trainer.tx.init(v["params"]) if reset_optimizer else client["opt_state"]
        params, stats, opt_state, metrics = trainer.run(loss_fn, v["params"], v["batch_stats"], opt_state,
                                                        data, key)
        return {"params": params, "batch_stats": stats, "opt_state": opt_state}, metrics

    def aggregate(server, clients, weights):
        shared = {k: clients[k] for k in server}
        return tree_masked_mean(shared, weights, masks(server), server), clients

    def predict(server, client, x):
        return model.apply(merged(server, client), x, train=False)

    return Algorithm(name, init, local_update, aggregate, predict)


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
