"""SCAFFOLD (Karimireddy et al., ICML 2020): FedAvg with control variates that correct client drift.

Server state: the global model x and the server control variate c; client state: its control variate c_i
(both params-sized, zero at the start). In round t client i starts from y_i = x and takes its K_i local steps on

    L_i(y) = CE_i(y) + <c - c_i, y>            (gradient g_i(y) + c - c_i: the corrected step of Alg. 1 l.10)

then updates its control variate with the paper's option II and sends dy_i = y_i - x, dc_i = c_i+ - c_i:

    c_i+ = c_i - c + (x - y_i) / (K_i lr)
    x   <- (1 - lr_g) x + lr_g sum_i p_i y_i   (= x + lr_g sum_i p_i dy_i,  p_i: the engine's weights)
    c   <- c + |S|/N mean_{i in S} dc_i        (= c + 1/N sum_{i in S} dc_i, N: all clients)

K_i is the client's own number of optimizer steps this round (the trainer's ``steps``; ragged clients each
their own), lr the client learning rate. BatchNorm running statistics are not parameters: they are averaged
as FedAvg does and get no control variate. Every client predicts with the global model.

Hyperparameters: ``global_lr`` lr_g = 1 (the paper's experiments and the reference code's default);
``lr``: the client learning rate of the control-variate update; by default the run's ``--lr`` (the runner
puts it in ``LocalTrainer.lr``), or, for a trainer built without it, read from its optimizer
(``optimizer_lr``: minus its first update of a unit gradient at w = 0, which is lr for SGD with or without
momentum and for Adam; pass it for Nesterov SGD or a schedule).

Reference code read: alpemreacar/FedDyn (commit 48a19fac), ``utils_methods.py::train_SCAFFOLD`` and
``utils_general.py::train_scaffold_mdl`` (the same SCAFFOLD the FedDC repository gaoliang13/FedDC ships):
the correction enters as the linear loss term sum(w * (c - c_i)), so it goes through the optimizer as a
gradient (with momentum it is carried by the momentum buffer, as in PyTorch implementations that add it to
the gradient; NIID-Bench instead subtracts lr (c - c_i) after each step, the same thing for plain SGD), and
x <- lr_g mean(y_i) + (1 - lr_g) x, c += 1/N sum dc_i as above. Deviations, and why:
- the reference scales c by each client's relative data size r_i = n_i N / sum_j n_j (c / r_i in the loss,
  r_i dc_i in the server update); we follow the paper (r_i = 1), which is the same when clients have equal
  data (the RFedDis datasets) and needs no dataset-wide counts on the clients;
- the reference trains a fixed number of minibatches K for every client; here clients train the engine's
  epochs and K_i is each client's real step count, which the paper's option II formula asks for;
- the reference clips gradients at norm 10 and uses weight decay 1e-3 for every method it runs (its FedAvg
  too); we use jaxfl's client optimizer as configured, as for every other baseline here;
- the model average uses the engine's weights (sample counts or uniform: ``--weighting``), as every jaxfl
  baseline; the paper's 1/|S| mean is ``--weighting uniform``.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ..aggregation import tree_weighted_mean
from ..engine import Algorithm, ClientData, LocalTrainer, RoundInfo
from ..errors import ConfigError
from ..options import Options, option
from ..trees import tree_vdot, tree_zeros
from .fedavg import ce_loss, global_model_predictors, init_variables, model_variables

tmap = jax.tree_util.tree_map


def optimizer_lr(trainer: LocalTrainer, lr: float | None = None, name: str = "scaffold") -> float:
    """The client learning rate: ``lr`` if given, else ``trainer.lr`` (the runner sets it), else minus the first
    update the trainer's optimizer makes from a unit gradient at w = 0 (lr for SGD, with or without momentum
    and weight decay, and for Adam)."""
    if lr is not None or trainer.lr is not None:
        return float(lr if lr is not None else trainer.lr)
    zero = jnp.zeros((), jnp.float32)
    update, _ = trainer.tx.update(jnp.ones((), jnp.float32), trainer.tx.init(zero), zero)
    step = -float(update)
    if not (math.isfinite(step) and step > 0):
        raise ConfigError(f"{name} cannot read the client learning rate from the optimizer (its first step is "
                          f"{step}); pass --{name}.lr")
    return step


def cohort_sum_over_n(tree, weights, num_clients: int | None):
    """1/N sum_{i in S} tree_i (= |S|/N times the cohort mean); N: ``num_clients`` or, if None, the cohort size."""
    k = weights.shape[0]
    mean = tree_weighted_mean(tree, jnp.ones((k,), jnp.float32))
    scale = 1.0 if num_clients is None else k / num_clients
    return mean if scale == 1.0 else tmap(lambda m: m * scale, mean)


def control_variate(c_i, c, x, y, steps, lr: float):
    """SCAFFOLD option II: c_i+ = c_i - c + (x - y) / (K lr), K = ``steps``."""
    k_lr = jnp.maximum(steps, 1.0) * lr
    return tmap(lambda ci, cg, xx, yy: ci - cg + (xx - yy) / k_lr, c_i, c, x, y)


@dataclasses.dataclass(frozen=True)
class ScaffoldOptions(Options):
    name = "scaffold"
    sharing = ("all parameters and BN statistics, and each round's change of its control variate",
               "its control variate c_i")
    global_lr: float = option(1.0, "server learning rate lr_g: x <- x + lr_g * mean(y_i - x)", lo=0.0, lo_open=True)
    lr: float | None = option(None, "client learning rate in c_i+ = c_i - c + (x - y_i)/(K lr) (default: the client "
                              "optimizer's)", lo=0.0, lo_open=True)


def scaffold(model, trainer: LocalTrainer, num_clients: int | None = None, **options) -> Algorithm:
    """SCAFFOLD (option II control variates); num_clients: N, the run's client count (None: every client takes
    part in every round); options: ``ScaffoldOptions``."""
    o = ScaffoldOptions(**options).validate()
    lr, lr_g = optimizer_lr(trainer, o.lr), o.global_lr
    ce = ce_loss(model)

    def init(key, sample_x):
        variables = init_variables(model, trainer, key, sample_x)
        zeros = tree_zeros(variables["params"])
        return dict(variables, c=zeros), {"c": zeros}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        x = server["params"]
        correction = jax.lax.stop_gradient(tmap(jnp.subtract, server["c"], client["c"]))  # c - c_i

        def loss_fn(p, s, xb, yb, w, k):
            loss, aux = ce(p, s, xb, yb, w, k)
            return loss + tree_vdot(correction, p), aux

        y, stats, _, metrics = trainer.run(loss_fn, x, server["batch_stats"], trainer.tx.init(x), data, key)
        c_new = control_variate(client["c"], server["c"], x, y, metrics["steps"], lr)
        return {"params": y, "batch_stats": stats, "c": c_new,
                "dc": tmap(jnp.subtract, c_new, client["c"])}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        avg = tree_weighted_mean(model_variables(clients), weights)
        params = avg["params"] if lr_g == 1.0 else tmap(lambda m, x: lr_g * m + (1.0 - lr_g) * x, avg["params"],
                                                         server["params"])
        dc = cohort_sum_over_n(clients["dc"], weights, num_clients)
        c = tmap(jnp.add, server["c"], dc)
        return {"params": params, "batch_stats": avg["batch_stats"], "c": c}, {"c": clients["c"]}

    return Algorithm("scaffold", init, local_update, aggregate, *global_model_predictors(model))
