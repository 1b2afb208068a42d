"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021, "Personalized Federated Learning with First Order
Model Optimization"): each client combines the models of the clients that help it on its validation data.

The server keeps every client's latest trained model theta_n and an affinity matrix P [N, N]. Client i holds
out a fixed fraction of its samples for validation and keeps theta-bar_i, the model it started its last local
training from. In round t it downloads its own latest model and M others, chosen epsilon-greedily by P_i (each
slot: with probability eps_t = max(eps - t decay, 0) a random client that has a model, else the highest P_i),
and weighs them by first-order improvement on its validation loss L_i:

    w_n = (L_i(theta-bar_i) - L_i(theta_n)) / (||theta_n - theta-bar_i||_1 + 1e-5),
    theta_i^t = sum_n w_n^+ theta_n / sum_n w_n^+    (theta-bar_i if no w_n > 0),      P_i[n] += w_n / |sum_m w_m|

(over parameters and BN statistics), then trains theta_i^t on its training split with the run's optimizer and
uploads it into the server's table; theta-bar_i <- theta_i^t. Round 0 is local training (no model uploaded
yet). A client predicts with its latest trained model. Defaults: M = 4 ("5 models" with its own), eps = 0.3,
decay 0.05, 20% validation, the l1 distance (the official README's CIFAR-10 setting).

Reference: NVlabs/FedFomo @ fe04f664 (``federation.py`` ``compute_fomo_weights``, ``update_client_weights``,
``federate``; ``client.py`` ``get_federating_clients``, ``init_data``); also PFLlib ``clientfomo.py`` and
FL-bench ``fedfomo.py``.

Deviations:
- The official hierarchical candidates (averages over spectral clusters of P and a global average) are not
  offered: they are an extension beyond the paper's algorithm and need host-side spectral clustering.
- The official evaluation uses the combined model before training; here the latest trained model (PFLlib,
  FL-bench), which needs no validation passes at evaluation.
- The validation split is drawn once per client from ``split_seed`` and the client id; the official code draws
  it with its data seed. Cohorts and exploration are not reseeded every round (an official quirk).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import real_rows, write_rows
from ..core.metrics import cross_entropy
from ..core.options import Options, option
from ..core.trainer import ClientRows, LocalTrainer, batch_of, num_positions
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.hypernet import require_table_size
from ._common import aux_key, ce_loss, init_variables, model_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedFomoOptions(Options):
    name = "fedfomo"
    client_state = True
    server_client_rows = True  # (the server's table, one row per training client)
    sharing = ("its trained model, kept in the server's table; it downloads its own and M others chosen by its "
               "affinities", "theta-bar (the model it last started training from); its validation split")
    num_update_clients: int = option(4, "M: other clients' models downloaded per round", minimum=1)
    epsilon: float = option(0.3, "initial probability of exploring a random client per slot", lo=0.0, hi=1.0)
    epsilon_decay: float = option(0.05, "epsilon's decrease per round", lo=0.0)
    val_frac: float = option(0.2, "fraction of a client's samples held out for validation", lo=0.0, hi=0.9)
    norm: str = option("l1", "the distance in w_n's denominator", choices=("l1", "l2"))
    split_seed: int = option(0, "seed of the clients' validation splits", minimum=0)


def fomo_weights(val_base, val_losses, distances, valid):
    """w_n = (L(theta-bar) - L(theta_n)) / (d_n + 1e-5) for the valid candidates, 0 elsewhere.
    val_base []; val_losses, distances [K]; valid [K] bool -> [K]."""
    return jnp.where(valid, (val_base - val_losses) / (distances + 1e-5), 0.0)


def fomo_combination(weights, candidates, base):
    """sum_n w_n^+ theta_n / sum_n w_n^+ over the candidates' leaves [K, ...], or ``base`` when no w_n > 0."""
    pos = jnp.maximum(weights, 0.0)
    total = jnp.sum(pos)
    coef = pos / jnp.where(total > 0, total, 1.0)
    return jax.tree_util.tree_map(lambda c, b: jnp.where(total > 0, jnp.tensordot(coef, c, axes=1), b),
                                  candidates, base)


def epsilon_greedy(key, affinity, eligible, slots: int, epsilon):
    """``slots`` distinct ids, each with probability ``epsilon`` a uniformly random eligible one, else the eligible
    one of highest ``affinity`` (ties broken at random). affinity [N], eligible [N] bool ->
    (ids [slots], valid [slots] bool: False where nothing eligible was left)."""
    n = affinity.shape[0]

    def pick(s, carry):
        ids, valid, left = carry
        k = jax.random.fold_in(key, s)
        explore = jax.random.uniform(jax.random.fold_in(k, 0)) < epsilon
        noise = jax.random.uniform(jax.random.fold_in(k, 1), (n,))
        score = jnp.where(explore, noise, affinity + 1e-6 * noise)
        j = jnp.argmax(jnp.where(left, score, -jnp.inf))
        ok = jnp.any(left)
        return ids.at[s].set(j), valid.at[s].set(ok), left.at[j].set(False)

    init = (jnp.zeros(slots, jnp.int32), jnp.zeros(slots, bool), eligible)
    ids, valid, _ = jax.lax.fori_loop(0, slots, pick, init)
    return ids, valid


def split_rows(key, count, m: int, val_frac: float):
    """A fixed random order of a client's M padded positions (real samples first, shuffled) and its training
    count: positions [0, n_train) train, [n_train, count) validate. -> (order [M], n_train [])."""
    prio = jnp.where(jnp.arange(m) < count, jax.random.uniform(key, (m,)), 2.0)
    return jnp.argsort(prio), count - jnp.floor(val_frac * count).astype(count.dtype)


def reordered(data, order, count):
    """The client's data with its positions in ``order`` and ``count`` real samples (the training split)."""
    if isinstance(data, ClientRows):
        return ClientRows(data.store_x, data.store_y, data.rows[order], count, data.work)
    return ClientData(data.x[order], data.y[order], count, data.work)


@register(FedFomoOptions)
def fedfomo(model, trainer: LocalTrainer, o: FedFomoOptions, ctx: RunContext) -> Algorithm:
    """FedFomo: first-order model optimization over downloaded models, weighted on a local validation split."""
    require_table_size("fedfomo", ctx.num_clients)
    n_clients, b = ctx.num_clients, trainer.batch_size
    loss = ce_loss(model)
    distance = ((lambda d: jnp.sum(jnp.abs(d))) if o.norm == "l1" else (lambda d: jnp.sqrt(jnp.sum(d * d))))

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        table = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n_clients,) + a.shape), v)
        return ({"models": table, "affinity": jnp.zeros((n_clients, n_clients)),
                 "uploaded": jnp.zeros(n_clients, bool)}, {"base": v})

    def val_loss(variables, data, start, stop):
        """Mean evaluation-mode CE over positions [start, stop) of ``data`` (in batches of B)."""
        def step(t, total):
            pos = start + t * b + jnp.arange(b)
            w = (pos < stop).astype(jnp.float32)
            x, y = batch_of(data, jnp.minimum(pos, stop - 1))
            logits = model.apply(variables, trainer.preprocess(x), train=False)
            return total + jnp.sum(w * cross_entropy(logits, y))
        steps = (stop - start + b - 1) // b
        return jax.lax.fori_loop(0, steps, step, 0.0) / jnp.maximum(stop - start, 1)

    def local_update(server, client, data, key, info: RoundInfo):
        i = info.client_id
        m = num_positions(data)
        order, n_train = split_rows(jax.random.fold_in(jax.random.key(o.split_seed), i), data.count, m, o.val_frac)
        train = reordered(data, order, n_train)
        data = reordered(data, order, data.count)
        eps = jnp.maximum(o.epsilon - info.round * o.epsilon_decay, 0.0)
        others = server["uploaded"] & (jnp.arange(n_clients) != i)
        picks, picked = epsilon_greedy(aux_key(key), server["affinity"][i], others,
                                       o.num_update_clients, eps)
        ids = jnp.concatenate([i[None], picks])
        valid = jnp.concatenate([server["uploaded"][i][None], picked]) & (n_train < data.count)
        candidates = jax.tree_util.tree_map(lambda t: t[ids], server["models"])
        base = client["base"]
        losses = jax.lax.map(lambda c: val_loss(c, data, n_train, data.count), candidates)
        dists = jax.vmap(lambda p: sum(distance(a - c) for a, c in zip(jax.tree_util.tree_leaves(p),
                                                                      jax.tree_util.tree_leaves(base["params"]))))(
            candidates["params"])
        w = fomo_weights(val_loss(base, data, n_train, data.count), losses, dists, valid)
        start = fomo_combination(w, candidates, base)
        params, stats, _, metrics = trainer.run(loss, start["params"], start["batch_stats"],
                                                trainer.tx.init(start["params"]), train, key)
        d_affinity = w / jnp.maximum(jnp.abs(jnp.sum(w)), 1e-12)
        trained = {"params": params, "batch_stats": stats, "base": start, "ids": ids, "d_affinity": d_affinity}
        return trained, dict(metrics, helpers=jnp.sum(w > 0).astype(jnp.float32))

    def aggregate(server, trained, weights, info: RoundInfo):
        ids = info.client_id
        table = write_rows(server["models"], ids, weights, model_variables(trained))
        rows = real_rows(ids, weights, n_clients)  # a padded cohort row adds nothing ("drop")
        affinity = server["affinity"].at[rows[:, None], trained["ids"]].add(trained["d_affinity"], mode="drop")
        uploaded = write_rows(server["uploaded"], ids, weights, jnp.ones(weights.shape, bool))
        return {"models": table, "affinity": affinity, "uploaded": uploaded}, {"base": trained["base"]}

    def predict(server, client, x, client_id):
        return model.apply(jax.tree_util.tree_map(lambda t: t[client_id], server["models"]), x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(model_variables(trained), x, train=False)

    return Algorithm("fedfomo", init, local_update, aggregate, predict, predict_trained)
