"""Evidential (Dirichlet) learning and Dempster-Shafer fusion (RFedDis), per sample on [..., K].

No batch reductions happen inside: every function maps [..., K] to [..., K] or [...]; the caller
takes the (masked) batch mean.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import digamma, gammaln

from ..core.metrics import check_labels, check_positive, weighted_mean_loss


def evidence(logits):
    """e = softplus(z) >= 0. logits [..., K] -> [..., K]."""
    return jax.nn.softplus(logits)


def dirichlet_alpha(logits):
    """alpha = softplus(z) + 1 (every alpha > 1). logits [..., K] -> [..., K]."""
    return evidence(logits) + 1.0


def opinion(alpha):
    """Subjective-logic opinion of Dir(alpha): belief b_k = (alpha_k - 1) / S, uncertainty u = K / S, S = sum alpha.

    sum_k b_k + u = 1. alpha [..., K] -> (b [..., K], u [...], S [...]).
    """
    s = jnp.sum(alpha, -1)
    k = alpha.shape[-1]
    return (alpha - 1.0) / s[..., None], k / s, s


def uncertainty(alpha):
    """u = K / sum_k alpha_k. alpha [..., K] -> [...]."""
    return alpha.shape[-1] / jnp.sum(alpha, -1)


def expected_probability(alpha):
    """p = alpha / S, the mean of Dir(alpha). alpha [..., K] -> [..., K]."""
    return alpha / jnp.sum(alpha, -1, keepdims=True)


def ds_combine_opinions(b1, u1, b2, u2):
    """Dempster-Shafer combination of two opinions (explicit form, RFedDis Eq. 7-8).

        C = sum_{i != j} b1_i b2_j = (sum b1)(sum b2) - sum_k b1_k b2_k       (conflict)
        b_k = (b1_k b2_k + b1_k u2 + b2_k u1) / (1 - C),   u = u1 u2 / (1 - C)
    b1, b2 [..., K], u1, u2 [...] -> (b [..., K], u [...], C [...]).
    """
    conflict = jnp.sum(b1, -1) * jnp.sum(b2, -1) - jnp.sum(b1 * b2, -1)
    scale = 1.0 / (1.0 - conflict)
    b = (b1 * b2 + b1 * u2[..., None] + b2 * u1[..., None]) * scale[..., None]
    return b, u1 * u2 * scale, conflict


def ds_combine(alpha1, alpha2):
    """Dempster-Shafer fusion of two Dirichlets in closed form: e = e1 + e2 + e1 * e2 / K, alpha = e + 1.

    (Substituting b = e / S and u = K / S into ``ds_combine_opinions`` cancels the 1 - C factor.)
    Symmetric; a vacuous opinion (e = 0) is the identity; the fused u never exceeds min(u1, u2).
    alpha1, alpha2 [..., K] -> [..., K].
    """
    e1, e2 = alpha1 - 1.0, alpha2 - 1.0
    return 1.0 + e1 + e2 + e1 * e2 / alpha1.shape[-1]


def dirichlet_ce(alpha, labels):
    """Expected cross-entropy under Dir(alpha): sum_k y_k (psi(S) - psi(alpha_k)) = psi(S) - psi(alpha_y).

    alpha [..., K], labels int [...] in [0, K) -> [...].
    """
    check_labels(labels, alpha.shape[-1], "dirichlet_ce")
    a_y = jnp.take_along_axis(alpha, labels[..., None], -1)[..., 0]
    return digamma(jnp.sum(alpha, -1)) - digamma(a_y)


def remove_true_evidence(alpha, labels):
    """alpha~ = y + (1 - y) * alpha: the true class's alpha becomes 1, the others are unchanged.
    alpha [..., K], labels int [...] in [0, K) -> [..., K]."""
    check_labels(labels, alpha.shape[-1], "remove_true_evidence")
    onehot = jax.nn.one_hot(labels, alpha.shape[-1], dtype=alpha.dtype)
    return onehot + (1.0 - onehot) * alpha


def kl_to_uniform(alpha):
    """KL(Dir(alpha) || Dir(1, ..., 1))
    = lnG(S) - lnG(K) - sum_k lnG(alpha_k) + sum_k (alpha_k - 1)(psi(alpha_k) - psi(S)).

    >= 0, and 0 iff every alpha_k = 1. KL(Dir(2, 1) || Dir(1, 1)) = ln 2 - 0.5. alpha [..., K] -> [...].
    """
    k = alpha.shape[-1]
    s = jnp.sum(alpha, -1)
    return (gammaln(s) - gammaln(float(k)) - jnp.sum(gammaln(alpha), -1)
            + jnp.sum((alpha - 1.0) * (digamma(alpha) - digamma(s)[..., None]), -1))


def edl_loss(alpha, labels, lam):
    """Evidential loss L_Un = psi(S) - psi(alpha_y) + lam * KL(Dir(alpha~) || Dir(1)), alpha~ = remove_true_evidence.

    The KL term does not depend on the true class's evidence. alpha [..., K] (every alpha_k >= 1), labels int
    [...] in [0, K), lam [] (the annealing weight) -> per sample [...].
    """
    return dirichlet_ce(alpha, labels) + lam * kl_to_uniform(remove_true_evidence(alpha, labels))


def annealing_coefficient(round_idx, num_rounds):
    """lambda(t) = min(1, t / T) for the 0-based round t of T: 0 in the first round, (T - 1)/T in the last.
    round_idx [] (int), num_rounds T >= 1 -> [] float32."""
    check_positive(num_rounds, "num_rounds", "annealing_coefficient")
    return jnp.minimum(1.0, jnp.asarray(round_idx, jnp.float32) / num_rounds)


def softmax_kl_mean(h_p, h_q, weights=None):
    """KLm(P || Q) with P = softmax(h_p), Q = softmax(h_q) over the last (feature) axis, averaged over all B*D
    elements (torch ``kl_div(reduction='mean')``): (1 / (B D)) sum_b sum_d P log(P / Q).

    h: [B, D]; weights [B] (0 for padding) make it a mean over real samples only.
    """
    lp, lq = jax.nn.log_softmax(h_p, -1), jax.nn.log_softmax(h_q, -1)
    per_sample = jnp.mean(jnp.exp(lp) * (lp - lq), -1)
    return jnp.mean(per_sample) if weights is None else weighted_mean_loss(per_sample, weights)


def disentangle_loss(h_global, h_local, weights=None, reduction: str = "mean_all"):
    """RFedDis L_Dis = exp(-(KLm(P_G || P_L) + KLm(P_L || P_G))) in (0, 1]; 1 iff the feature distributions agree.

    Minimising it pushes the two heads' hidden features apart. h: [B, D]; weights [B] for padding.
    reduction: "mean_all" averages the KL over all B*D elements (the official code); "batchmean" sums it over
    the D features and averages over samples (D times larger, a much stronger term; a variant only).
    """
    if reduction not in ("mean_all", "batchmean"):
        raise ValueError(f"reduction must be 'mean_all' or 'batchmean', got {reduction!r}")
    scale = 1.0 if reduction == "mean_all" else h_global.shape[-1]
    kl = softmax_kl_mean(h_global, h_local, weights) + softmax_kl_mean(h_local, h_global, weights)
    return jnp.exp(-scale * kl)
