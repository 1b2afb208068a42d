"""RFedDis (Wang et al. 2023): disentangled global/local heads with Dirichlet evidence fused by Dempster-Shafer.

A shared encoder feeds two heads of the same architecture: the global head ``head`` (averaged) and the local
head ``local_head`` (kept). Each head's logits z_v give evidence e_v = softplus(z_v), alpha_v = e_v + 1; the
two opinions are fused in closed form, alpha_F = 1 + e_G + e_L + e_G e_L / K (``ops.evidential.ds_combine``).
With h_v a head's hidden feature (``dis_feature``) and lam(t) = min(1, t/T) for the 0-based round t of T:

    L = CE(z_G, y) + CE(z_L, y) + sum_{v in G, L, F} [psi(S_v) - psi(alpha_v,y) + lam KL(Dir(alpha~_v) || Dir(1))]
        + lam exp(-(KLm(P_G || P_L) + KLm(P_L || P_G)))                       (rfeddis spec sections 2-3)

(batch means over real samples). Prediction: argmax alpha_F, with probability alpha_F / S_F and uncertainty
u_F = K / S_F. The server averages the encoder and the global head without BatchNorm (sample weights); BN
everywhere and the whole local head stay on the client.

Switches: share_global_head=False (the global head is not averaged); use_local_head=False with use_dis=False
(FedBN with an evidential head); fusion="sum" (the ablation that sums the logits: CE(z_G + z_L) + lam L_Dis);
head_ce=False (drops the two CE terms); kl_reduction="batchmean".

Deviations:
- The global head is averaged by default; the released Office/DomainNet code's filter misses it
  (``share_global_head=False`` reproduces that).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..models import MLPHead
from ..ops.evidential import (annealing_coefficient, dirichlet_alpha, disentangle_loss, ds_combine, edl_loss,
                              expected_probability, uncertainty)
from ._averaging import masked_averaging
from ._common import is_batchnorm
from ._registry import register


FUSIONS = ("ds", "sum")


class RFedDisNet(nn.Module):
    """Encoder + global head ``head`` + optional ``local_head`` (same architecture, own weights).

    Returns {"z_g", "h_g"} and, with a local head, {"z_l", "h_l"}: logits and the hidden feature named by
    ``dis_feature`` (an ``MLPHead`` tap such as "relu1", the Digits model's post-ReLU 2048-d feature).
    """
    encoder: nn.Module
    head: nn.Module
    local_head: nn.Module | None = None
    dis_feature: str = "relu1"

    def __call__(self, x, train: bool = False, mask=None):
        z = self.encoder(x, train, mask)
        z_g, taps_g = self.head(z, train, mask, taps=True)
        out = {"z_g": z_g, "h_g": taps_g.get(self.dis_feature, z)}
        if self.local_head is not None:
            z_l, taps_l = self.local_head(z, train, mask, taps=True)
            out.update(z_l=z_l, h_l=taps_l.get(self.dis_feature, z))
        return out


def fused_alpha(out, fusion: str = "ds"):
    """Dirichlet parameters of the prediction: alpha_F = ds_combine(alpha_G, alpha_L), or alpha_G alone
    without a local head; for ``fusion="sum"``, alpha of the summed logits z_G + z_L."""
    if "z_l" not in out:
        return dirichlet_alpha(out["z_g"])
    if fusion == "sum":
        return dirichlet_alpha(out["z_g"] + out["z_l"])
    return ds_combine(dirichlet_alpha(out["z_g"]), dirichlet_alpha(out["z_l"]))


@dataclasses.dataclass(frozen=True)
class RFedDisOptions(Options):
    name = "rfeddis"
    client_state = True
    server_optimizer = True
    user_dp = True
    sharing = ("encoder and global evidential head, without BatchNorm", "BatchNorm, the local evidential head")
    # the official digits script (RFedDis_digits.py: optim.SGD(lr=args.lr), --lr 1e-2, --batch 32)
    train_preset = {"lr": 0.01, "momentum": 0.0, "batch_size": 32}
    share_global_head: bool = option(True, "average the global head (--no-...: the released Office/DomainNet code)")
    use_local_head: bool = option(True, "--no-...: keep only the global evidential head")
    use_dis: bool = option(True, "the annealed disentangling loss exp(-symmetric KL)")
    head_ce: bool = option(True, "the softmax CE terms on both heads")
    fusion: str = option("ds", "ds (Dempster-Shafer on evidence) | sum (summed logits, the ablation)",
                         choices=FUSIONS)
    kl_reduction: str = option("mean_all", "mean_all (official code) | batchmean (KL summed over features)",
                               choices=("mean_all", "batchmean"))
    dis_feature: str = option("relu1", "head tap used as the disentangling feature: relu1 | fc1 | relu2 | fc2 ...")


@register(RFedDisOptions)
def rfeddis(model, trainer: LocalTrainer, o: RFedDisOptions, ctx: RunContext) -> Algorithm:
    """RFedDis on a ``Classifier`` whose head is an ``MLPHead``; both heads copy its architecture (a linear
    head gets one hidden layer of 512 so that there is a hidden feature to disentangle). Options:
    ``RFedDisOptions``.

    The annealing lam(t) = min(1, t/T) takes t and T (the run's round count) from the engine's ``RoundInfo``.
    """
    share_global_head, use_local_head, use_dis, head_ce = o.share_global_head, o.use_local_head, o.use_dis, o.head_ce
    fusion, kl_reduction, dis_feature = o.fusion, o.kl_reduction, o.dis_feature
    hidden = tuple(model.head.hidden) or (512,)
    classes = model.head.num_classes
    net = RFedDisNet(model.encoder, MLPHead(hidden, classes),
                     MLPHead(hidden, classes) if use_local_head else None, dis_feature)

    def loss(params, stats, x, y, w, key, anchor=None, *, info):
        out, updated = net.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                 mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        lam = annealing_coefficient(info.round, info.total_rounds("rfeddis's annealing min(1, t/T)"))
        mean = lambda v: weighted_mean_loss(v, w)
        alpha_f = fused_alpha(out, fusion)
        if use_local_head and fusion == "sum":
            total = mean(cross_entropy(out["z_g"] + out["z_l"], y))
        else:
            heads = [out["z_g"]] + ([out["z_l"]] if use_local_head else [])
            alphas = [dirichlet_alpha(z) for z in heads] + ([alpha_f] if use_local_head else [])
            per_sample = sum(edl_loss(a, y, lam) for a in alphas)
            if head_ce:
                per_sample = per_sample + sum(cross_entropy(z, y) for z in heads)
            total = mean(per_sample)
        if use_local_head and use_dis:
            total = total + lam * disentangle_loss(out["h_g"], out["h_l"], w, kl_reduction)
        return total, (updated["batch_stats"], jnp.log(expected_probability(alpha_f)))

    def predict(variables, x):
        alpha = fused_alpha(net.apply(variables, x, train=False), fusion)
        # log of the expected probability: argmax is argmax alpha_F, and the engine's CE is its NLL.
        return jnp.log(expected_probability(alpha)), {"uncertainty": uncertainty(alpha)}

    def share_param(path):
        if is_batchnorm(path):
            return False
        return path[0] == "encoder" or (path[0] == "head" and share_global_head)

    return masked_averaging("rfeddis", net, trainer, share_param=share_param, share_stats=False,
                            loss_uses_info=True, loss=loss, predict=predict)
