"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach"): FedAvg of a meta-model that one SGD step on a client's
data personalizes.

Client i receives w^t and takes meta-steps; each draws consecutive minibatches D, D' (and D'') of its epoch's
shuffle (f the CE loss of a batch, alpha the inner and beta the outer step size):

    w~ = w - alpha grad f(w; D)
    FO: w <- w - beta grad f(w~; D')
    HF: g = grad f(w~; D'),  d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta),
        w <- w - beta (g - alpha d)            (d: a finite-difference Hessian-vector product at w)

max(1, floor(ceil(n_i / B) / k)) meta-steps an epoch (k = 2 batches for FO, 3 for HF; a batch index past the
client's samples wraps around its shuffle, so every batch holds only real samples). BatchNorm statistics follow
the D and D' forward passes. The server averages w (every parameter and BN statistic, the engine's weights:
``--weighting uniform`` is the paper's). Clients keep nothing. Before predicting, a client adapts the global
model with ``eval_steps`` SGD steps of size alpha, each on one random batch of B of its training samples
(``prepare_predict``; the paper's and PFLlib's one step).

Defaults: alpha = beta = the run's --lr (PFLlib ties them), delta = 1e-3 (FL-bench), one adaptation step.
FL-bench's beta = 1e-3 (``--perfedavg.beta 1e-3``) goes with its 5 local epochs: with one epoch the meta-model
barely moves (MNIST, 2NN, 20 clients, lr 0.05: 66 % after 20 rounds against 87 % with beta = alpha; FedAvg 87 %).

Reference: no official code is published; read against FL-bench (KarhouTam/FL-bench @ 06e658bc,
``src/client/perfedavg.py``: FO and HF) and PFLlib (TsingZ0/PFLlib @ d832e76f, ``clientperavg.py``: FO).

Deviations:
- A client with fewer than k batches still takes one meta-step (wrapping around its samples); FL-bench takes
  none, PFLlib drops incomplete batches.
- Inner and outer steps are plain SGD (as both references); the run's momentum and weight decay do not apply.
- BatchNorm statistics move with the D and D' passes (PFLlib); FL-bench restores them after every meta-step.
- The adaptation before evaluation is one step on one batch (PFLlib, the paper); FL-bench fine-tunes >= 1 epoch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import correct_count
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, batch_of, client_epochs, epoch_permutation, num_positions
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import ce_loss, client_lr, global_model_predictors, init_variables, model_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class PerFedAvgOptions(Options):
    name = "perfedavg"
    own_minibatches = True  # (its meta-steps draw their own minibatches: ``--augment`` does not apply)
    server_optimizer = True
    user_dp = True
    sharing = ("the meta-model (all parameters and BN statistics, averaged)",
               "nothing: it predicts with the global model adapted by eval_steps SGD steps on its own data")
    variant: str = option("fo", "first-order (fo) or hessian-free (hf) meta-gradient", choices=("fo", "hf"))
    alpha: float | None = option(None, "inner (personalization) step size (default: the run's --lr)",
                                 lo=0.0, lo_open=True)
    beta: float | None = option(None, "outer (meta) step size (default: the run's --lr; FL-bench: 1e-3)",
                                lo=0.0, lo_open=True)
    delta: float = option(1e-3, "hf: the finite-difference step of the Hessian-vector product", lo=0.0,
                          lo_open=True)
    eval_steps: int = option(1, "SGD steps (one batch each, step alpha) adapting the global model before a "
                                "client predicts", minimum=0)


def meta_gradient(grad_fn, params, stats, batches, alpha: float, delta: float | None):
    """Per-FedAvg's meta-gradient at w = params from batches (D, D') (FO, ``delta`` None) or (D, D', D'') (HF).

    grad_fn(params, stats, batch) -> ((loss, (new_stats, logits)), grads). Returns (g, stats after D and D',
    (loss, logits) of the D' pass at w~ = w - alpha grad f(w; D)):
        FO: g = grad f(w~; D');   HF: g - alpha [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta).
    """
    (_, (stats, _)), g0 = grad_fn(params, stats, batches[0])
    adapted = optax.apply_updates(params, optax.tree.scale(-alpha, g0))
    (loss, (stats, logits)), g = grad_fn(adapted, stats, batches[1])
    if delta is not None:
        shift = optax.tree.scale(delta, g)
        (_, _), g_plus = grad_fn(optax.tree.add(params, shift), stats, batches[2])
        (_, _), g_minus = grad_fn(optax.tree.sub(params, shift), stats, batches[2])
        hvp = optax.tree.scale(1.0 / (2 * delta), optax.tree.sub(g_plus, g_minus))
        g = optax.tree.sub(g, optax.tree.scale(alpha, hvp))
    return g, stats, (loss, logits)


def sgd_adapt(grad_fn, variables, batches, alpha: float):
    """``variables`` after one plain SGD step of size alpha per batch (BN statistics updated by each pass)."""
    params, stats = variables["params"], variables["batch_stats"]
    for batch in batches:
        (_, (stats, _)), g = grad_fn(params, stats, batch)
        params = optax.apply_updates(params, optax.tree.scale(-alpha, g))
    return {"params": params, "batch_stats": stats}


@register(PerFedAvgOptions)
def perfedavg(model, trainer: LocalTrainer, o: PerFedAvgOptions, ctx: RunContext) -> Algorithm:
    """Per-FedAvg (FO or HF): a MAML meta-model averaged by the server, adapted by each client to predict."""
    alpha = client_lr(trainer, o.alpha, "perfedavg", "alpha")
    beta = client_lr(trainer, o.beta, "perfedavg", "beta")
    k = 2 if o.variant == "fo" else 3
    delta = o.delta if o.variant == "hf" else None
    b = trainer.batch_size
    loss = ce_loss(model)

    def grad_fn(params, stats, batch):
        x, y, w, key = batch
        return jax.value_and_grad(loss, has_aux=True)(params, stats, x, y, w, key)

    def init(key, sample_x):
        return init_variables(model, trainer, key, sample_x), {}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        n = data.count
        m = num_positions(data)
        steps = jnp.where(n > 0, jnp.maximum(1, ((n + b - 1) // b) // k), 0)

        def epoch(e, carry):
            ekey = jax.random.fold_in(key, e)
            perm = epoch_permutation(jax.random.fold_in(ekey, 0), n, m)

            def batch(j):  # batch j of the epoch: positions j B .. j B + B - 1, wrapping around the real samples
                idx = perm[(j * b + jnp.arange(b)) % jnp.maximum(n, 1)]
                x, y = batch_of(data, idx)
                return trainer.preprocess(x), y, jnp.ones(b, jnp.float32), jax.random.fold_in(ekey, j + 1)

            def step(s, carry):
                params, stats, sums = carry
                batches = [batch(k * s + r) for r in range(k)]
                g, stats, (l1, logits) = meta_gradient(grad_fn, params, stats, batches, alpha, delta)
                params = optax.apply_updates(params, optax.tree.scale(-beta, g))
                sums = sums + jnp.stack([l1 * b, correct_count(logits, batches[1][1], jnp.ones(b)), float(b), 1.0])
                return params, stats, sums

            return jax.lax.fori_loop(0, steps, step, carry)

        init_carry = (server["params"], server["batch_stats"], jnp.zeros(4, jnp.float32))
        params, stats, sums = jax.lax.fori_loop(0, client_epochs(data, trainer.epochs), epoch, init_carry)
        seen = jnp.maximum(sums[2], 1.0)
        return {"params": params, "batch_stats": stats}, {"loss": sums[0] / seen, "accuracy": sums[1] / seen,
                                                          "seen": sums[2], "steps": sums[3]}

    def aggregate(server, trained, weights, info=None):
        return tree_weighted_mean(model_variables(trained), weights), {}

    def prepare_predict(server, client, train: ClientData, key):
        m = train.y.shape[0]

        def batch(s):  # a random batch of the client's real samples (masked when it has fewer than B)
            skey = jax.random.fold_in(key, s)
            idx = epoch_permutation(skey, train.count, m)[jnp.arange(b) % m]
            w = (jnp.arange(b) < train.count).astype(jnp.float32)
            return train.x[idx], train.y[idx], w, jax.random.fold_in(skey, 1)

        return {"tuned": sgd_adapt(grad_fn, model_variables(server), [batch(s) for s in range(o.eval_steps)],
                                   alpha)}

    def predict(server, client, x, client_id=None):
        return model.apply(client["tuned"], x, train=False)

    if o.eval_steps == 0:  # the meta-model itself
        return Algorithm("perfedavg", init, local_update, aggregate, *global_model_predictors(model))
    return Algorithm("perfedavg", init, local_update, aggregate, predict, prepare_predict=prepare_predict)
