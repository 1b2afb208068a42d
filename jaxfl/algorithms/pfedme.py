"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalized models theta_i regularised by Moreau envelopes.

Client i holds a local copy w of the global model and, for every minibatch D_b of its local training,

    theta <- argmin_theta  f_i(theta; D_b) + lambda/2 ||theta - w||^2         (approximately, by K inner steps:)
        theta <- theta - plr (grad f_i(theta; D_b) + lambda (theta - w) + mu theta)      K times, same batch
    w <- w - eta lambda (w - theta)                                           (the Moreau envelope's gradient)
    w_global <- (1 - beta) w_global + beta sum_i p_i w_i,    p_i = n_i / sum_j n_j over the round's clients.

theta and w start the round at the server's w; theta is warm-started from one minibatch to the next. The client
predicts with theta_i. BatchNorm: every inner forward pass (at theta, train mode, padded samples masked) updates
the running statistics; the client sends them with w, the server averages them with sample weights (no beta
mixing, which could make a variance negative); the client keeps its own with theta. Engine mapping:
``LocalTrainer.run`` drives the minibatch loop with w as its parameters; theta rides in the trainer's
non-differentiated state, and the loss returns a value whose gradient in w is exactly lambda (w - theta_K) (the
K inner steps run inside the loss, same batch, w constant). The outer step size eta is the run's ``--lr``; with
plain SGD (``--momentum 0``, no weight decay) this is the update above, otherwise momentum or weight decay act on
the envelope gradient. Options: ``lam`` = 15, ``inner_steps`` K = 5, ``personal_lr`` plr = 0.01, ``beta`` = 1,
``mu`` = 0 (the official optimizer's extra term, not in the paper). State: server {"params": w, "batch_stats"};
per client {"personal": {"params": theta_i, "batch_stats"}} (only read by ``predict``: every round restarts
theta from the server's w).

Deviations:
- The outer loop is the trainer's (``--local-epochs`` full passes, one outer step per minibatch, as FedTP's
  version); CharlieDinh's code takes R = ``local_epochs`` (20) single minibatches, cycling its loader.
- CharlieDinh trains every client every round and aggregates a sampled subset; here, as in FedTP's version,
  only the round's cohort trains.
- The metrics' loss/accuracy are those of the last inner forward pass of each minibatch (CE at theta before
  its last inner step).
- Momentum or weight decay of the client optimizer act on the envelope gradient (official outer step: plain SGD).
"""
from __future__ import annotations

import dataclasses

import jax
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import ce_loss, init_variables, model_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class PFedMeOptions(Options):
    name = "pfedme"
    client_state = True
    multilabel = True
    sharing = ("the local copies w_i of the global model (and BN statistics), mixed in with weight beta",
               "its personalized model theta_i (Moreau-envelope solution around w)")
    lam: float = option(15.0, "lambda, weight of lambda/2 ||theta - w||^2 (the Moreau envelope)", lo=0.0)
    inner_steps: int = option(5, "K, inner gradient steps on theta per minibatch", minimum=1)
    personal_lr: float = option(0.01, "learning rate of the inner steps on theta", lo=0.0, lo_open=True)
    beta: float = option(1.0, "server mixing: w <- (1 - beta) w + beta * mean(w_i)", lo=0.0, lo_open=True)
    mu: float = option(0.0, "extra mu * theta term of the official inner step (FedTP: 0)", lo=0.0)


def moreau_inner_steps(model, lam: float, inner_steps: int, personal_lr: float, mu: float = 0.0):
    """inner(theta, stats, anchor, x, y, w, key) -> (theta_K, stats, (loss, logits) of the last inner pass).

    K steps of theta <- theta - plr (grad CE(theta) + lam (theta - anchor) + mu theta) on one batch; every
    forward pass updates the BatchNorm statistics; step k's dropout key is fold_in(key, k)."""
    grad_ce = jax.value_and_grad(ce_loss(model), has_aux=True)

    def step(theta, stats, anchor, x, y, w, key):
        (loss, (stats, logits)), g = grad_ce(theta, stats, x, y, w, key)
        theta = jax.tree_util.tree_map(lambda t, gt, a: t - personal_lr * (gt + lam * (t - a) + mu * t),
                                       theta, g, anchor)
        return theta, stats, (loss, logits)

    def inner(theta, stats, anchor, x, y, w, key):
        k0 = None if key is None else jax.random.fold_in(key, 0)
        theta, stats, out = step(theta, stats, anchor, x, y, w, k0)  # the first one outside: fixes out's shape

        def body(k, carry):
            theta, stats, _ = carry
            return step(theta, stats, anchor, x, y, w, None if key is None else jax.random.fold_in(key, k))

        return jax.lax.fori_loop(1, inner_steps, body, (theta, stats, out))

    return inner


def envelope_loss(model, lam: float, inner_steps: int, personal_lr: float, mu: float = 0.0):
    """A ``LocalTrainer`` loss over w whose state is {"theta", "batch_stats"}: it runs the K inner steps from the
    state's theta toward stop_gradient(w) and returns (value, (new state, logits)) with value = CE of the last
    inner pass and d value / d w = lam (w - theta_K), the gradient of the Moreau envelope."""
    inner = moreau_inner_steps(model, lam, inner_steps, personal_lr, mu)

    def loss_fn(params, state, x, y, w, key):
        anchor = jax.lax.stop_gradient(params)
        theta, stats, (loss, logits) = inner(state["theta"], state["batch_stats"], anchor, x, y, w, key)
        surrogate = 0.5 * lam * optax.tree.norm(optax.tree.sub(params, theta), squared=True)
        value = jax.lax.stop_gradient(loss) + surrogate - jax.lax.stop_gradient(surrogate)
        return value, ({"theta": theta, "batch_stats": stats}, logits)

    return loss_fn


@register(PFedMeOptions)
def pfedme(model, trainer: LocalTrainer, o: PFedMeOptions, ctx: RunContext) -> Algorithm:
    """pFedMe; options: ``PFedMeOptions``. The outer step is ``trainer.tx`` on lambda (w - theta)."""
    loss_fn = envelope_loss(model, o.lam, o.inner_steps, o.personal_lr, o.mu)
    beta = o.beta

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        return variables, {"personal": variables}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        w0 = server["params"]
        state = {"theta": w0, "batch_stats": server["batch_stats"]}  # theta restarts at the server's w
        w, state, _, metrics = trainer.run(loss_fn, w0, state, trainer.tx.init(w0), data, key)
        return {"params": w, "batch_stats": state["batch_stats"],
                "personal": {"params": state["theta"], "batch_stats": state["batch_stats"]}}, metrics

    def aggregate(server, clients, weights, info: RoundInfo = None):
        mean = tree_weighted_mean(model_variables(clients), weights)
        if beta != 1.0:
            mean["params"] = jax.tree_util.tree_map(lambda old, new: (1.0 - beta) * old + beta * new,
                                                    server["params"], mean["params"])
        return mean, {"personal": clients["personal"]}

    def predict(server, client, x, client_id=None):
        return model.apply(client["personal"], x, train=False)

    return Algorithm("pfedme", init, local_update, aggregate, predict, predict)  # the trained row has "personal"
