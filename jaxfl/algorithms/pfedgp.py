"""pFedGP (Achituve, Shamsian, Navon, Chechik, Fetaya, NeurIPS 2021): a shared network, personal GP classifiers.

Every client classifies the shared network's embeddings z = f(x) (the encoder output; the head is unused) with a
tree of binary Gaussian-process classifiers built on its own training set (the "full" variant):
- Tree: the root holds the client's classes; a node with more than two classes splits them in two by 2-means on
  the class means of z (the exact optimum by enumerating every split for C <= 12 classes, Lloyd's iterations
  from the two farthest means beyond); two classes go one to each side, a side with two or more classes
  becomes a child node. Every node is a binary GP (``jaxfl.gp``: RBF kernel on L2-normalised embeddings,
  outputscale 8, lengthscale 1, zero mean, Polya-Gamma Gibbs sampling). The tree is rebuilt from the current
  network whenever the client trains or predicts.
- Local objective: per node, the samples are split per class at random, ``predict_ratio`` = 1/2 of each class
  to predict, the rest to condition on; Gibbs sampling (5 sweeps, 20 chains) on the conditioning half gives
  omega (held fixed); the loss is the CE of the predicted half, p(left) = mean over chains of exp(E[log
  sigma(f*)]), summed over nodes. ``inner_steps`` (1) full-batch steps per round, gradients clipped to global
  norm 50, with the run's client optimizer (this method's preset: weight decay 1e-3).
- Server: the network is averaged (FedAvg with the engine's weights).
- Prediction (``prepare_predict``): the tree is built from the client's whole training set under the current
  network, each node's chains (5 sweeps, 30 chains) condition on all its training points, and class c's
  probability is the product along its path of p(left) or 1 - p(left); classes the client does not hold get
  probability 0. ``predict`` returns log-probabilities.
State: the server holds the network; a client keeps nothing (the GPs are rebuilt from its data every time).

Deviations:
- Each node's GP is computed over the client's whole (padded) sample set with masks (the same static shapes
  for every client and node); masked points change nothing, but a node costs as much as the root.
- Polya-Gamma draws: a 200-term series with its exact mean for the tail (official: pypolyagamma).
- The tree's 2-means is exact (C <= 12) where the official KMeans is a 50-restart search.
- The network average uses the engine's weights (official: a plain mean); lr and momentum are the run's
  (official: SGD lr 0.05, momentum 0.9, weight decay 1e-3).
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, client_epochs, scan_first
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops import gp
from ._common import init_variables, model_variables, num_classes
from ._registry import register


EXACT_SPLIT_CLASSES = 12  # up to this many classes the tree's 2-means is solved by enumerating every split


@dataclasses.dataclass(frozen=True)
class PFedGPOptions(Options):
    name = "pfedgp"
    own_minibatches = True  # (its GP step reads every training sample: ``--augment`` does not apply)
    local_work = "inner_steps"
    cpu_device_split = False  # its GP's LAPACK calls on two CPU devices at once deadlock (core.options)
    sharing = ("the network (FedAvg); the GP classifiers are rebuilt on each client from its own data",
               "nothing: its tree of binary GPs is rebuilt from its training set")
    train_preset = {"weight_decay": 1e-3}  # the official client optimizer: SGD, momentum 0.9, weight decay 1e-3
    inner_steps: int = option(1, "full-batch steps per round (the whole training set is one batch)", minimum=1)
    predict_ratio: float = option(0.5, "share of each class predicted by the rest in the training objective",
                                  lo=0.0, hi=1.0, lo_open=True)
    gibbs_steps: int = option(5, "Gibbs sweeps (training and prediction)", minimum=1)
    train_draws: int = option(20, "parallel Gibbs chains in training", minimum=1)
    test_draws: int = option(30, "parallel Gibbs chains at prediction", minimum=1)
    outputscale: float = option(8.0, "RBF kernel output scale", lo=0.0, lo_open=True)
    lengthscale: float = option(1.0, "RBF kernel length scale", lo=0.0, lo_open=True)
    grad_clip: float = option(50.0, "global-norm clipping of the network's gradient (0: none)", lo=0.0)
    max_nodes: int = option(0, "GP nodes per client tree (0: C - 1, every split); k - 1 suffices when no client "
                            "holds more than k classes, and each node costs a full GP", minimum=0)


# -- the class tree ----------------------------------------------------------------------------------------
def _split_candidates(num_classes: int):
    """[2^C, C] bool: every subset of the C classes, one per row (``two_means_split`` keeps the proper subsets
    of a node's classes that hold its lowest class)."""
    return np.array(list(itertools.product([False, True], repeat=num_classes)), bool)


def two_means_split(means, members):
    """The left side of the 2-means split of the member classes' means [C, D] (members [C] bool, >= 3 of
    them): the subset S that minimises sum_{c in S} ||m_c - mean_S||^2 + sum_{c in M \\ S} ||m_c - mean_{M\\S}||^2,
    by enumeration for C <= 12 (every 2-means optimum), by 20 Lloyd iterations from the two farthest means beyond.
    Returns [C] bool (a proper, non-empty subset of members, holding the lowest member class)."""
    c = means.shape[0]
    if c <= EXACT_SPLIT_CLASSES:
        cand = jnp.asarray(_split_candidates(c))  # [S, C]
        lowest = jnp.argmax(members)
        ok = (jnp.all(~cand | members, 1) & jnp.any(cand, 1) & jnp.any(members & ~cand, 1) & cand[:, lowest])

        def sse(side):
            w = side.astype(means.dtype)
            mu = (w @ means) / jnp.maximum(jnp.sum(w), 1.0)
            return jnp.sum(w * jnp.sum(jnp.square(means - mu), -1))
        cost = jax.vmap(lambda s: sse(s) + sse(members & ~s))(cand)
        return cand[jnp.argmin(jnp.where(ok, cost, jnp.inf))]
    d2 = jnp.sum(jnp.square(means[:, None] - means[None]), -1)
    d2 = jnp.where(members[:, None] & members[None, :], d2, -1.0)
    a, b = jnp.unravel_index(jnp.argmax(d2), d2.shape)
    centers = jnp.stack([means[a], means[b]])

    def lloyd(centers, _):
        left = jnp.sum(jnp.square(means - centers[0]), -1) <= jnp.sum(jnp.square(means - centers[1]), -1)
        w = jnp.stack([left & members, ~left & members]).astype(means.dtype)
        new = (w @ means) / jnp.maximum(jnp.sum(w, 1, keepdims=True), 1.0)
        return jnp.where(jnp.sum(w, 1, keepdims=True) > 0, new, centers), None
    centers, _ = jax.lax.scan(lloyd, centers, None, length=20)
    left = (jnp.sum(jnp.square(means - centers[0]), -1) <= jnp.sum(jnp.square(means - centers[1]), -1)) & members
    return jnp.where(left[jnp.argmax(members)], left, members & ~left)


def class_tree(means, present, slots: int = 0):
    """The client's tree of binary splits, breadth first, as static-shape arrays over S = C - 1 node slots (or
    ``slots`` if smaller): (members [S, C], left [S, C], active [S]); node 0 holds the present classes, a node
    with two classes sends the lower one left, one with more splits by ``two_means_split``, and each side with
    >= 2 classes becomes the next free slot (a side finding no free slot stays a leaf holding several classes).
    means [C, D] class means, present [C] bool."""
    c = present.shape[0]
    s = min(slots, c - 1) if slots else c - 1
    members = jnp.zeros((s, c), bool).at[0].set(present)
    left = jnp.zeros((s, c), bool)
    nxt = jnp.asarray(1)
    for i in range(s):
        m = members[i]
        size = jnp.sum(m)
        first = jnp.arange(c) == jnp.argmax(m)
        side = jnp.where(size > 2, two_means_split(means, m) if c > 2 else first, first & m)
        side = jnp.where(size >= 2, side, False)
        left = left.at[i].set(side)
        for part in (side, m & ~side):
            grow = (size >= 2) & (jnp.sum(part) >= 2) & (nxt < s)
            slot = jnp.minimum(nxt, s - 1)
            members = members.at[slot].set(jnp.where(grow, part, members[slot]))
            nxt = nxt + grow
    return members, left, jnp.sum(members, 1) >= 2


def class_means(z, y, w, num_classes: int):
    """(means [C, D], present [C]): the mean embedding of each class over the real samples (w = 1)."""
    onehot = jax.nn.one_hot(y, num_classes) * w[:, None]
    n = jnp.sum(onehot, 0)
    return (onehot.T @ z) / jnp.maximum(n, 1.0)[:, None], n > 0


def predict_half(key, y, w, ratio: float):
    """[M] bool: per class, the floor(ratio n_c) real samples of lowest random rank go to the predicted half
    (official stratified ``train_test_split``)."""
    u = jax.random.uniform(key, y.shape)
    real = w > 0
    same = (y[:, None] == y[None, :]) & real[None, :] & real[:, None]
    rank = jnp.sum(same & (u[None, :] < u[:, None]), 1)
    n_c = jnp.sum(same, 1)
    return real & (rank < jnp.floor(ratio * n_c))


# -- the algorithm -----------------------------------------------------------------------------------------
@register(PFedGPOptions)
def pfedgp(model, trainer: LocalTrainer, o: PFedGPOptions, ctx: RunContext) -> Algorithm:
    """pFedGP (full variant, predictive-likelihood objective) on any ``Classifier``'s encoder."""
    tx = trainer.tx if not o.grad_clip else optax.chain(optax.clip_by_global_norm(o.grad_clip), trainer.tx)
    kernel = lambda a, b: gp.rbf_kernel(a, b, o.outputscale, o.lengthscale)

    def embed(variables, x, w, train):
        if train:
            z, updated = model.apply(variables, x, True, w, method="features", mutable=["batch_stats"])
            return z, updated.get("batch_stats", variables["batch_stats"])
        return model.apply(variables, x, False, method="features"), variables["batch_stats"]

    kss = o.outputscale + gp.JITTER  # a test point's prior variance: the RBF diagonal plus jitter

    def node_omega(key, K_all, y_left, cond, draws):
        """Polya-Gamma draws [draws, M] of the node's GP on the points ``cond``, K_all [M, M] = k(z, z)."""
        return gp.gibbs_omega(key, gp.masked_prior(K_all, cond), y_left, cond, o.gibbs_steps, draws)

    def node_p_left(K_all, K_s, y_left, cond, omega):
        """p(left) [P] at the columns of K_s [M, P] of the node's GP on the points ``cond``, given omega."""
        mean, var = gp.predictive(gp.masked_prior(K_all, cond), K_s, jnp.full(K_s.shape[1:], kss), y_left, cond,
                                  omega)
        return gp.class_zero_probability(mean, var)

    def tree_loss(z, y, w, classes, key):
        means, present = class_means(jax.lax.stop_gradient(z), y, w, classes)
        members, left, active = class_tree(means, present, o.max_nodes)
        real = w > 0
        K_all = kernel(z, z)  # every node's GP uses (masked rows of) the same kernel matrix

        def node(i):
            k_split, k_gibbs = jax.random.split(jax.random.fold_in(key, i))
            in_node = real & members[i][y]
            held_out = predict_half(k_split, y, in_node.astype(w.dtype), o.predict_ratio)
            cond = in_node & ~held_out
            y_left = left[i][y]
            p = node_p_left(K_all, K_all, y_left, cond, node_omega(k_gibbs, K_all, y_left, cond, o.train_draws))
            p_true = jnp.where(y_left, p, 1.0 - p)
            counted = held_out & active[i]
            n = jnp.sum(counted)
            loss = jnp.sum(jnp.where(counted, -jnp.log(p_true + 1e-12), 0.0)) / jnp.maximum(n, 1)
            return loss, jnp.sum(counted & (p_true > 0.5)), n
        # the nodes one after another in a lax.map, not a Python loop: one chain of batched LAPACK calls (see
        # gp._lower_solve), and one node's [draws, M, M] buffers alive at a time
        loss, correct, n = (jnp.sum(t) for t in jax.lax.map(node, jnp.arange(members.shape[0])))
        return loss, correct / jnp.maximum(n, 1)  # accuracy: the held-out points' split decisions

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        return v, {}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        x = trainer.preprocess(data.x)
        w = data.sample_mask().astype(jnp.float32)
        classes = num_classes(model, model_variables(server), x)

        def loss_fn(params, stats, k):
            z, new_stats = embed({"params": params, "batch_stats": stats}, x, w, True)
            loss, accuracy = tree_loss(z, data.y, w, classes, k)
            return loss, (new_stats, accuracy)

        def step(carry, k):
            params, stats, opt_state = carry
            (loss, (stats, accuracy)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, k)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), stats, opt_state), (loss, accuracy)

        params, runs = server["params"], client_epochs(data, o.inner_steps)  # a straggler: its first steps
        (params, stats, _), (losses, accs) = scan_first(step, (params, server["batch_stats"], tx.init(params)),
                                                        jax.random.split(key, o.inner_steps), runs)
        metrics = {"loss": jnp.sum(losses) / runs, "accuracy": jnp.sum(accs) / runs, "seen": jnp.sum(w) * runs,
                   "steps": jnp.asarray(runs, jnp.float32)}
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, trained, weights, info=None):
        return tree_weighted_mean(trained, weights), {}

    def prepare_predict(server, client, train: ClientData, key):
        variables = model_variables(server)
        w = train.sample_mask().astype(jnp.float32)
        z, _ = embed(variables, train.x, w, False)
        means, present = class_means(z, train.y, w, num_classes(model, variables, train.x))
        members, left, active = class_tree(means, present, o.max_nodes)
        real = w > 0
        cond = real[None, :] & jnp.take(members, train.y, axis=1)  # [nodes, M]
        y_left = jnp.take(left, train.y, axis=1)
        K_all = kernel(z, z)
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(members.shape[0]))
        omega = jax.lax.map(lambda a: node_omega(a[0], K_all, a[1], a[2], o.test_draws), (keys, y_left, cond))
        # the posterior's Cholesky factors ([nodes, draws, M, M]) are refactored per test batch: kept, they would
        # cost far more memory than the few batches of a client's test set cost time
        return {"z": z, "K": K_all, "cond": cond, "y_left": y_left, "omega": omega, "members": members,
                "left": left, "active": active, "present": present}

    def predict(server, view, x, client_id=None):
        z_new = model.apply(model_variables(server), x, False, method="features")
        probs = jnp.where(view["present"], 1.0, 0.0) * jnp.ones((x.shape[0], 1))
        K_s = kernel(view["z"], z_new)
        p = jax.lax.map(lambda a: node_p_left(view["K"], K_s, *a),
                        (view["y_left"], view["cond"], view["omega"]))[:, :, None]  # [nodes, P, 1]
        factor = jnp.where(view["left"][:, None], p, jnp.where(view["members"][:, None], 1.0 - p, 1.0))
        probs = probs * jnp.prod(jnp.where(view["active"][:, None, None], factor, 1.0), 0)
        return jnp.log(jnp.maximum(probs, 1e-30))

    return Algorithm("pfedgp", init, local_update, aggregate, predict, None, prepare_predict)
