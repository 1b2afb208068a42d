"""FedPick (Zhu et al., TNNLS 2024): personalized feature selection with a per-client PFSM.

Per sample, the client's mask network phi (Dense(d, d/2)-ReLU-Dense(d/2, d), no BN) turns the shared
encoder's features z_g into mask logits z_l; m = ST(1[sigmoid((z_l + L)/tau) >= 0.5]) with logistic noise L
in training only (``ops.masks.relaxed_mask``). z_p = z_g * m feeds the personal head h_p, z_u = z_g * (1 - m)
the "irrelevant" head h_u. With a_* the logits of h_g(z_g), h_p(z_p), h_u(z_u):

    L = CE(a_g, y) + lam_lce CE(a_p, y) + lam_ent sum_c p_u log p_u + lam_dis [KL(p_p||p_g) + KL(p_g||p_p)]

(batch means over real samples; the KL term reduced by ``kl_reduction``, by default as PyTorch's F.kl_div
default does, over batch x classes: the paper's lam_dis = 10 was tuned so, and with the class sum it
collapses training). Prediction: argmax(a_g + a_p) (ensemble) or a_g (``no_ensemble``). The
server averages, weighted by sample counts, the encoder and the global head without BatchNorm; BN (params
and statistics) and the PFSM stay on the client. ``use_pfsm=False`` is exactly FedBN.

Deviations: none known.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..models import Dense, MLPHead
from ..ops.diagnostics import sparsity_per_sample
from ..ops.losses import KL_REDUCTIONS, negative_entropy, reduce_kl, symmetric_kl
from ..ops.masks import relaxed_mask, split_features
from ._averaging import masked_averaging
from ._common import is_batchnorm
from ._registry import register


# fedpick spec section 3: (tau, lam_lce, lam_ent, lam_dis) per dataset.
DIGITS = {"tau": 10.0, "lam_lce": 10.0, "lam_ent": 0.001, "lam_dis": 10.0}
OFFICE = {"tau": 1.0, "lam_lce": 1.0, "lam_ent": 0.001, "lam_dis": 1.0}


@dataclasses.dataclass(frozen=True)
class FedPickOptions(Options):
    """FedPick's options; tau and the lam_* left None take the paper's values for the dataset (Digits values
    for digit benchmarks, Office/DomainNet values otherwise)."""
    name = "fedpick"
    server_optimizer = True
    user_dp = True
    sharing = ("encoder and global head, without BatchNorm",
               "BatchNorm, the PFSM (mask net, personal and irrelevant heads)")
    presets = {"default": DIGITS, "digits": DIGITS, "mnist": DIGITS, "office": OFFICE}
    preset_default = "office"
    tau: float | None = option(None, "Gumbel-sigmoid temperature (default: 10 digits, 1 otherwise)", lo=0.0,
                               lo_open=True)
    lam_lce: float | None = option(None, "weight of the personal head's CE (default: 10 digits, 1 otherwise)",
                                   lo=0.0)
    lam_ent: float | None = option(None, "weight of the irrelevant head's negative entropy (default: 0.001)", lo=0.0)
    lam_dis: float | None = option(None, "weight of the symmetric KL between global and personal predictions "
                                   "(default: 10 digits, 1 otherwise)", lo=0.0)
    use_pfsm: bool = option(True, "--no-...: drop the PFSM (the FedBN ablation)")
    soft_mask: bool = option(False, "ablation: use the soft mask m_s, no threshold")
    no_ensemble: bool = option(False, "ablation: predict with the global head only")
    share_bn: bool = option(False, "ablation: average BatchNorm too")
    share_pfsm: bool = option(False, "ablation: average the PFSM too")
    pfsm_head: str = option("same", "personal and irrelevant heads: same (copy the global head) | linear",
                            choices=("same", "linear"))
    kl_reduction: str = option("mean", "reduction of L_dis's KL: mean (over batch x classes, PyTorch's default, "
                               "which the paper's lam_dis was tuned with) | batchmean (K x mean) | sum",
                               choices=KL_REDUCTIONS)

    def keeps_client_state(self) -> bool:
        """The PFSM stays on the client unless it is dropped (``use_pfsm=False``) or averaged (``share_pfsm``);
        BatchNorm, the other part it keeps, is not on a model without it."""
        return self.use_pfsm and not self.share_pfsm


def fedpick_objective(out, y, w, lam_lce: float, lam_ent: float, lam_dis: float, kl_reduction: str = "mean"):
    """FedPick's loss on one batch from the network's logits (a_g, a_p, a_u [B, K]), labels y [B], weights w [B]:

        L = CE(a_g) + lam_lce CE(a_p) + lam_ent sum_c p_u log p_u + lam_dis R(KL(p_p||p_g) + KL(p_g||p_p))

    CE and entropy are means over the real samples; R is ``losses.reduce_kl`` with ``kl_reduction``: "mean"
    (over batch x classes, PyTorch's default, for which the paper's lam_dis = 10 was tuned), "batchmean"
    (K times larger) or "sum" (n times "batchmean"). -> []."""
    mean = lambda v: weighted_mean_loss(v, w)
    dis = reduce_kl(symmetric_kl(out["a_p"], out["a_g"]), w, out["a_g"].shape[-1], kl_reduction)
    return (mean(cross_entropy(out["a_g"], y)) + lam_lce * mean(cross_entropy(out["a_p"], y))
            + lam_ent * mean(negative_entropy(out["a_u"])) + lam_dis * dis)


class PFSM(nn.Module):
    """Personalized feature selection module: mask network phi, personal head, irrelevant head.

    Returns (a_p, a_u, m) for features z [B, d]; the Gumbel noise comes from the ``gumbel`` rng stream
    (training only).
    """
    head_p: nn.Module
    head_u: nn.Module
    tau: float = 1.0
    hard: bool = True

    @nn.compact
    def __call__(self, z, train: bool = False, mask=None):
        d = z.shape[-1]
        logits = Dense(d, name="phi2")(nn.relu(Dense(d // 2, name="phi1")(z)))
        m = relaxed_mask(logits, self.make_rng("gumbel") if train else None, self.tau, self.hard)
        z_p, z_u = split_features(z, m)
        return self.head_p(z_p, train, mask), self.head_u(z_u, train, mask), m


class FedPickNet(nn.Module):
    """Encoder + global head (named ``encoder``/``head`` as in ``Classifier``, so without a PFSM it is the
    same network with the same init) + optional ``pfsm``. Returns {a_g, a_p, a_u, mask, z}."""
    encoder: nn.Module
    head: nn.Module
    pfsm: nn.Module | None = None

    def __call__(self, x, train: bool = False, mask=None):
        z = self.encoder(x, train, mask)
        out = {"a_g": self.head(z, train, mask), "z": z}
        if self.pfsm is not None:
            out["a_p"], out["a_u"], out["mask"] = self.pfsm(z, train, mask)
        return out


@register(FedPickOptions)
def fedpick(model, trainer: LocalTrainer, o: FedPickOptions, ctx: RunContext) -> Algorithm:
    """FedPick on a ``Classifier`` (its encoder and head become the shared encoder and global head); options:
    ``FedPickOptions`` (tau and lam_* left None take the Digits values).

    pfsm_head: "same" (h_p, h_u copy the global head's architecture) or "linear". Ablations: use_pfsm=False
    (FedBN), soft_mask (m = m_s, no threshold), no_ensemble (predict a_g), share_bn, share_pfsm, lam_* = 0.
    """
    tau, lam_lce, lam_ent, lam_dis = o.tau, o.lam_lce, o.lam_ent, o.lam_dis
    use_pfsm, soft_mask, no_ensemble, share_bn, share_pfsm = (o.use_pfsm, o.soft_mask, o.no_ensemble, o.share_bn,
                                                              o.share_pfsm)
    pfsm_head = o.pfsm_head
    classes = model.head.num_classes
    head_like = lambda name: MLPHead(() if pfsm_head == "linear" else tuple(model.head.hidden), classes, name=name)
    pfsm = PFSM(head_like("head_p"), head_like("head_u"), tau, not soft_mask) if use_pfsm else None
    net = FedPickNet(model.encoder, model.head, pfsm)

    def prediction(out):
        """Logits the client predicts with: a_g + a_p (ensemble), or a_g alone."""
        return out["a_g"] if no_ensemble or not use_pfsm else out["a_g"] + out["a_p"]

    def loss(params, stats, x, y, w, key, anchor=None):
        out, updated = net.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                 mutable=["batch_stats"], rngs=None if key is None else {"gumbel": key,
                                                                                          "dropout": key})
        if not use_pfsm:
            return weighted_mean_loss(cross_entropy(out["a_g"], y), w), (updated["batch_stats"], prediction(out))
        total = fedpick_objective(out, y, w, lam_lce, lam_ent, lam_dis, o.kl_reduction)
        return total, (updated["batch_stats"], prediction(out))

    def predict(variables, x):
        out = net.apply(variables, x, train=False)
        if not use_pfsm:
            return out["a_g"]
        return prediction(out), {"selection_ratio": jnp.mean(out["mask"], -1),
                                 "sparsity_ratio": sparsity_per_sample(out["z"])}

    def share_param(path):
        if path[0] == "pfsm":
            return share_pfsm
        return share_bn or not is_batchnorm(path)

    def share_stats(path):
        return share_pfsm if path[0] == "pfsm" else share_bn

    return masked_averaging("fedpick", net, trainer, share_param=share_param, share_stats=share_stats,
                            loss=loss, predict=predict)
