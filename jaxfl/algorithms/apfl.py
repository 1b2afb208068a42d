"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized Federated Learning"): each client mixes a personal
model v_i with the global model w, v-bar_i = alpha_i v_i + (1 - alpha_i) w, and learns the mixing weight.

Client i receives w^t and, on each minibatch xi of its local epochs, takes the paper's simultaneous steps
(Algorithm 1; f the CE loss of the batch, eta the client lr, all gradients at the step's old values):

    w       <- w       - eta grad f(w; xi)
    v_i     <- v_i     - eta grad_v f(v-bar_i; xi)      = v_i - eta alpha_i grad f(v-bar_i; xi)
    alpha_i <- clip(alpha_i - eta_a (<v_i - w, grad f(v-bar_i; xi)> + r alpha_i), 0, 1)

as one gradient step on the joint loss f(w) + f(alpha v + (1 - alpha) sg(w)) + r/2 alpha^2 (sg: stop-gradient,
so w sees only its own loss). The server averages w (every parameter and BN statistic, the engine's weights);
v_i (its parameters and the BN statistics of the mixed forward passes) and alpha_i never leave the client. A
client predicts with v-bar_i = alpha_i v_i + (1 - alpha_i) w, w the global model it holds (``predict``) or its
locally trained w (``predict_trained``: the official evaluation point). ``mix="logits"`` mixes the two models'
logits instead (the official code's ``inference_personal``), alpha_i v(x) + (1 - alpha_i) w(x).

Defaults: alpha_init 0.5 (official and FL-bench), eta_a = the client lr, r = 0 (the official code adds 0.02 alpha
to alpha's gradient: ``--apfl.alpha-reg 0.02``). Every client starts with v_i = the initial global model.

Reference: MLOPTPSU/FedTorch @ ab8068db (``fedtorch/comms/trainings/federated/apfl.py``,
``comms/utils/flow_utils.py`` ``alpha_update``, ``comms/utils/eval.py`` ``inference_personal``); also PFLlib
``clientapfl.py`` and FL-bench ``apfl.py``.

Deviations (from the official code; the paper's Algorithm 1 is followed):
- The mixture is of parameters (paper) by default; the official code mixes logits (``mix="logits"``).
- The three updates are simultaneous (paper); the official code steps w first and v on the updated w.
- alpha is updated on every step by its exact gradient (paper); the official code updates it once per round,
  on the first batch, with a parameter-space surrogate gradient plus 0.02 alpha.
- The run's client optimizer (momentum, weight decay) applies to w and v; alpha takes plain SGD steps.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ._common import client_lr, init_variables, model_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class APFLOptions(Options):
    name = "apfl"
    client_state = True
    server_optimizer = True
    user_dp = True
    sharing = ("the global model w (all parameters and BN statistics, FedAvg)",
               "its personal model v and mixing weight alpha; predicts with alpha v + (1 - alpha) w")
    alpha_init: float = option(0.5, "initial mixing weight alpha of the personal model", lo=0.0, hi=1.0)
    adaptive: bool = option(True, "learn alpha (else it stays alpha_init)")
    alpha_lr: float | None = option(None, "alpha's SGD step size (default: the run's --lr)", lo=0.0, lo_open=True)
    alpha_reg: float = option(0.0, "r in r/2 alpha^2 added to the loss (the official code's 0.02)", lo=0.0)
    mix: str = option("params", "mix the models' parameters (paper) or their logits (official code)",
                      choices=("params", "logits"))


def mix_params(alpha, v, w):
    """alpha v + (1 - alpha) w, leaf by leaf. alpha: float []; v, w: pytrees of the same structure."""
    return jax.tree_util.tree_map(lambda a, b: alpha * a + (1 - alpha) * b, v, w)


def clip_to_unit_interval() -> optax.GradientTransformation:
    """Updates that keep the parameters in [0, 1]: u -> clip(p + u, 0, 1) - p (projected SGD on alpha)."""
    def update(updates, state, params=None):
        return jax.tree_util.tree_map(lambda u, p: jnp.clip(p + u, 0.0, 1.0) - p, updates, params), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def apfl_loss(model, alpha_reg: float, mix: str):
    """loss_fn(params, stats, x, y, w, key) for params {"w", "v", "alpha"} and stats {"w", "v"}:
    mean_w CE(w) + mean_w CE(mixture) + alpha_reg/2 alpha^2, returning (loss, (stats, the mixture's logits))."""
    def forward(params, stats, x, w, key):
        logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                      mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        return logits, updated.get("batch_stats", {})

    def loss_fn(params, stats, x, y, w, key):
        a = params["alpha"]
        logits_w, stats_w = forward(params["w"], stats["w"], x, w, key)
        if mix == "params":
            mixed, stats_v = forward(mix_params(a, params["v"], jax.lax.stop_gradient(params["w"])), stats["v"],
                                     x, w, key)
        else:
            logits_v, stats_v = forward(params["v"], stats["v"], x, w, key)
            mixed = a * logits_v + (1 - a) * jax.lax.stop_gradient(logits_w)
        loss = (weighted_mean_loss(cross_entropy(logits_w, y), w) + weighted_mean_loss(cross_entropy(mixed, y), w)
                + 0.5 * alpha_reg * a ** 2)
        return loss, ({"w": stats_w, "v": stats_v}, mixed)
    return loss_fn


@register(APFLOptions)
def apfl(model, trainer: LocalTrainer, o: APFLOptions, ctx: RunContext) -> Algorithm:
    """APFL: FedAvg's global model w, a personal v_i and a learned mixing weight alpha_i per client."""
    alpha_tx = optax.set_to_zero()
    if o.adaptive:  # eta_a: the option, else the client optimizer's learning rate (--lr)
        alpha_lr = client_lr(trainer, o.alpha_lr, "apfl", "alpha_lr")
        alpha_tx = optax.chain(optax.sgd(alpha_lr), clip_to_unit_interval())
    tx = optax.multi_transform({"model": trainer.tx, "alpha": alpha_tx},
                               lambda p: {"w": "model", "v": "model", "alpha": "alpha"})
    local_trainer = dataclasses.replace(trainer, tx=tx)
    loss_fn = apfl_loss(model, o.alpha_reg, o.mix)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        return variables, {"v": variables, "alpha": jnp.float32(o.alpha_init)}

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        params = {"w": server["params"], "v": client["v"]["params"], "alpha": client["alpha"]}
        stats = {"w": server["batch_stats"], "v": client["v"]["batch_stats"]}
        params, stats, _, metrics = local_trainer.run(loss_fn, params, stats, tx.init(params), data, key)
        return {"params": params["w"], "batch_stats": stats["w"],
                "v": {"params": params["v"], "batch_stats": stats["v"]},
                "alpha": params["alpha"]}, dict(metrics, alpha=params["alpha"])

    def aggregate(server, trained, weights, info=None):
        return tree_weighted_mean(model_variables(trained), weights), {"v": trained["v"], "alpha": trained["alpha"]}

    def personalized(global_model, v, alpha, x):
        if o.mix == "params":
            return model.apply({"params": mix_params(alpha, v["params"], global_model["params"]),
                                "batch_stats": v["batch_stats"]}, x, train=False)
        return alpha * model.apply(v, x, train=False) + (1 - alpha) * model.apply(global_model, x, train=False)

    def predict(server, client, x, client_id=None):
        return personalized(model_variables(server), client["v"], client["alpha"], x)

    def predict_trained(server, trained, x, client_id=None):
        return personalized(model_variables(trained), trained["v"], trained["alpha"], x)

    return Algorithm("apfl", init, local_update, aggregate, predict, predict_trained)
