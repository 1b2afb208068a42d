"""FedPHP (Li, Zhan, Shao, Li, Song, ECML-PKDD 2021, "FedPHP: Federated Personalization with Inherited Private
Models"): FedAvg whose clients keep an inherited private model (HPM) as a temporal ensemble of their trained
models, distil it into each round's training, and predict with it.

Client i receives w^t and trains it (the student) on

    L = (1 - lam) mean_b CE(z_b, y_b) + lam R,
    R = mean_b -sum_c softmax(p_b / T)_c log_softmax(z_b)_c        (reg = "kd"; p: the HPM's logits, eval mode)
      or multi-kernel MMD^2 between the student's and the HPM's encoder outputs    (reg = "mmd")

(``losses.soft_target_ce``, ``losses.multi_kernel_mmd``), then updates its HPM (parameters and BN statistics)

    v_i <- mu_i v_i + (1 - mu_i) w_i,   mu_i = min(mu_max c_i / M, mu_max),   M = max(floor(q T), 1)

with c_i its participations before this round (0 at the first: v_i becomes its trained model), q the cohort's
fraction of the clients and T the run's rounds (M: a client's expected participations). The server averages
the trained models as FedAvg (every parameter and BN statistic, the engine's weights). The client keeps v_i and
c_i, and predicts with v_i. Defaults: lam = 0.1, KD at T = 4 (hard-coded officially), mu_max = 0.9. Every HPM
starts as the initial global model.

Reference: lxcnju/FedRepo @ 617ee015 (the first author's code: ``algorithms/fedphp.py`` ``update_local``,
``generate_mu``, ``update_hpm``; ``tools.py`` ``mmd_rbf_noaccelerate``); PFLlib's ``clientphp.py`` differs
(round-based mu, parameters only, MMD with fixed bandwidths, no prediction with the HPM) and is not followed.

Deviations:
- Local training is the run's epochs over the client's samples; the official loop takes max(E |loader|, 5)
  steps and clips gradient norms at 100.
- q is the run's cohort fraction (the official ``c_ratio``); without a run context it is 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.losses import multi_kernel_mmd, soft_target_ce
from ._common import init_variables, logits_and_representation, model_variables
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedPHPOptions(Options):
    name = "fedphp"
    client_state = True
    server_optimizer = True
    user_dp = True
    sharing = ("all parameters and BN statistics (FedAvg)",
               "its inherited private model (HPM: a moving average of its trained models; what it predicts with) "
               "and its participation count")
    lam: float = option(0.1, "lambda: loss = (1 - lambda) CE + lambda R", lo=0.0, hi=1.0)
    reg: str = option("kd", "R: distillation from the HPM's logits (kd) or MMD of the encoder outputs (mmd)",
                      choices=("kd", "mmd"))
    temperature: float = option(4.0, "kd: the HPM's softmax temperature", lo=0.0, lo_open=True)
    mu_max: float = option(0.9, "the HPM's largest inheritance weight mu", lo=0.0, hi=1.0)


def inheritance_weight(participations, expected, mu_max: float):
    """mu = min(mu_max c / M, mu_max) (clipped at 0): c the client's participations before this round, M its
    expected participations over the run. participations: int array [...] -> float [...]."""
    return jnp.clip(mu_max * participations.astype(jnp.float32) / expected, 0.0, mu_max)


def fedphp_loss(model, lam: float, reg: str, temperature: float):
    """loss_fn(params, stats, x, y, w, key, hpm) -> ((1 - lam) CE + lam R, (new_stats, logits)); the HPM
    (``{"params", "batch_stats"}``) is a fixed teacher in evaluation mode."""
    forward = logits_and_representation("features")

    def loss_fn(params, stats, x, y, w, key, hpm):
        (logits, z), updated = model.apply({"params": params, "batch_stats": stats}, x, True, w, method=forward,
                                           mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        t_logits, t_z = jax.lax.stop_gradient(model.apply(hpm, x, False, None, method=forward))
        if reg == "kd":
            r = weighted_mean_loss(soft_target_ce(logits, t_logits, temperature), w)
        else:
            r = multi_kernel_mmd(z, t_z, w)
        loss = (1 - lam) * weighted_mean_loss(cross_entropy(logits, y), w) + lam * r
        return loss, (updated.get("batch_stats", {}), logits)
    return loss_fn


@register(FedPHPOptions)
def fedphp(model, trainer: LocalTrainer, o: FedPHPOptions, ctx: RunContext) -> Algorithm:
    """FedPHP: FedAvg + a per-client inherited private model, distilled into training and used to predict."""
    loss_fn = fedphp_loss(model, o.lam, o.reg, o.temperature)
    q = 1.0 if not (ctx.cohort_size and ctx.num_clients) else ctx.cohort_size / ctx.num_clients

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        return v, {"hpm": v, "participations": jnp.int32(0)}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        expected = max(int(q * info.total_rounds("fedphp's inheritance schedule")), 1)
        mu = inheritance_weight(client["participations"], expected, o.mu_max)
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, client["hpm"])
        params, stats, _, metrics = trainer.run(fn, server["params"], server["batch_stats"],
                                                trainer.tx.init(server["params"]), data, key)
        trained = {"params": params, "batch_stats": stats}
        hpm = jax.tree_util.tree_map(lambda v, w: mu * v + (1 - mu) * w, client["hpm"], trained)
        return dict(trained, hpm=hpm, participations=client["participations"] + 1), dict(metrics, mu=mu)

    def aggregate(server, trained, weights, info=None):
        return (tree_weighted_mean(model_variables(trained), weights),
                {"hpm": trained["hpm"], "participations": trained["participations"]})

    def predict(server, client, x, client_id=None):
        return model.apply(client["hpm"], x, train=False)

    def predict_trained(server, trained, x, client_id=None):  # the HPM after this round's update (official)
        return model.apply(trained["hpm"], x, train=False)

    return Algorithm("fedphp", init, local_update, aggregate, predict, predict_trained)
