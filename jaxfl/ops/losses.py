"""Per-sample losses and metrics with sample weights (0 for padded samples)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# cross_entropy, weighted_mean_loss and correct_count are the engine's own, listed here with the other losses
from ..core.metrics import correct_count, cross_entropy, weighted_mean_loss  # noqa: F401


def kl_divergence(logits_p, logits_q):
    """KL(p || q) = sum_c p_c (log p_c - log q_c), p = softmax(logits_p), q = softmax(logits_q); [..., C] -> [...]."""
    lp, lq = jax.nn.log_softmax(logits_p, -1), jax.nn.log_softmax(logits_q, -1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), -1)


def symmetric_kl(logits_a, logits_b):
    """KL(a || b) + KL(b || a) at temperature 1 (FedPick's L_dis); symmetric, >= 0, 0 iff equal.
    logits_a, logits_b [..., C] -> [...].

    Gradients flow into both arguments (mutual distillation, no stop-gradient).
    """
    return kl_divergence(logits_a, logits_b) + kl_divergence(logits_b, logits_a)


KL_REDUCTIONS = ("mean", "batchmean", "sum")


def reduce_kl(per_sample, weights, num_classes: int, reduction: str = "mean"):
    """Reduce per-sample KL values (each summed over the K classes) over the real samples as PyTorch's
    ``F.kl_div(..., reduction=...)`` reduces the elementwise terms [B, K]; n = max(sum_b w_b, 1):
        mean       sum_b w_b kl_b / (n K)   (the element mean, PyTorch's default)
        batchmean  sum_b w_b kl_b / n
        sum        sum_b w_b kl_b
    per_sample [B], weights [B] (1 real, 0 padding) -> []."""
    if reduction not in KL_REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {KL_REDUCTIONS}")
    if reduction == "sum":
        return jnp.sum(weights.astype(per_sample.dtype) * per_sample)
    batchmean = weighted_mean_loss(per_sample, weights)
    return batchmean / num_classes if reduction == "mean" else batchmean


def negative_entropy(logits):
    """sum_c p_c log p_c, p = softmax(logits): -log C for uniform p, 0 for one-hot. logits [..., C] -> [...].

    Minimising it maximises entropy (FedPick's L_ent on the irrelevant head).
    """
    logp = jax.nn.log_softmax(logits, -1)
    return jnp.sum(jnp.exp(logp) * logp, -1)


def feature_norm(z, squared=False):
    """DapperFL's domain-adaptive regulariser per sample: ||z||_2 (code) or ||z||_2^2 (paper Eq. 3); [B, d] -> [B].

    d||z||/dz = z / ||z|| (0 at z = 0); d||z||^2/dz = 2z.
    """
    sq = jnp.sum(jnp.square(z), -1)
    if squared:
        return sq
    safe = jnp.where(sq > 0, sq, 1.0)  # sqrt has an infinite derivative at 0
    return jnp.where(sq > 0, jnp.sqrt(safe), 0.0)


COS_EPS = 1e-8  # torch.nn.CosineSimilarity's default eps


def cosine_similarity(a, b, eps: float = COS_EPS):
    """Row-wise cos(a, b) = <a / max(|a|, eps), b / max(|b|, eps)>: a, b [B, D] -> [B]. The norm is
    sqrt(max(|a|^2, eps^2)), so a zero row has a finite (zero) gradient."""
    na = jnp.sqrt(jnp.maximum(jnp.sum(a * a, -1), eps * eps))
    nb = jnp.sqrt(jnp.maximum(jnp.sum(b * b, -1), eps * eps))
    return jnp.sum(a * b, -1) / (na * nb)


def model_contrastive_loss(z, z_glob, z_prev, tau: float):
    """Per-sample l_con = -log(e^{s_g} / (e^{s_g} + e^{s_p})), s_g = cos(z, z_glob)/tau, s_p = cos(z, z_prev)/tau.
    z, z_glob, z_prev [B, D] -> [B]."""
    s_g = cosine_similarity(z, z_glob) / tau
    s_p = cosine_similarity(z, z_prev) / tau
    return jnp.logaddexp(s_g, s_p) - s_g


def class_counts(y, count, num_classes: int):
    """n_c = #{j < count : y_j = c}: the class counts of one client's real samples. y [M], count [] -> [C]."""
    real = jnp.arange(y.shape[0]) < count
    return jnp.sum(real[:, None] * jax.nn.one_hot(y, num_classes), 0)


def class_log_prior(y, count, num_classes: int):
    """log n_c (``class_counts``): the log class counts of one client's real training samples
    (log 0 = -inf for an absent class; all zeros for a client without samples). y [M], count [] -> [C]."""
    return jnp.log(jnp.where(count > 0, class_counts(y, count, num_classes), 1.0))


def logit_calibration(counts, tau: float, floor: float = 1e-8):
    """FedLC's per-class logit offsets tau * max(n_c, floor)^(-1/4): the rarer a class on the client, the more
    its logit is lowered during training (an absent class by tau * floor^(-1/4) = 100 tau). counts [C] -> [C]."""
    return tau * jnp.maximum(counts, floor) ** -0.25


def balanced_softmax_ce(logits, y, log_prior):
    """Per-sample balanced-softmax CE: CE(logits + log_prior, y). logits [B, C], y [B], log_prior [C] -> [B]."""
    return cross_entropy(logits + log_prior, y)


def gaussian_cmi_bound(z_mu, z_sigma, r_mu, r_sigma, scale):
    """FedSR's conditional-mutual-information bound per sample: KL(N(c mu, (c sigma)^2) || N(r_mu, r_sigma^2))
    summed over dimensions,

        sum_d [ log r_sigma - log(c sigma) + ((c sigma)^2 + (c mu - r_mu)^2) / (2 r_sigma^2) - 1/2 ],

    with z ~ N(mu, sigma^2) the sample's representation and N(r_mu, r_sigma^2) the reference distribution r(z|y)
    of its class. z_mu, z_sigma, r_mu, r_sigma [B, d] (r rows already picked by label, sigmas > 0), scale c [] ->
    [B]."""
    s = scale * z_sigma
    m = scale * z_mu
    kl = jnp.log(r_sigma) - jnp.log(s) + (s * s + jnp.square(m - r_mu)) / (2.0 * r_sigma * r_sigma) - 0.5
    return jnp.sum(kl, -1)


def prototype_contrastive_loss(z, y, cluster, cluster_valid, unbiased, class_valid, tau: float):
    """FPL's per-sample prototype loss (Huang et al., CVPR 2023): cluster-prototype InfoNCE + unbiased-prototype MSE,

        l_b = [ -log( sum_{j valid} e^{s(b, y_b, j)} / sum_{c, j valid} e^{s(b, c, j)} )
                + mean_d (z_b - u_{y_b})^2 ] * class_valid[y_b],     s(b, c, j) = cos(z_b, P_{c, j}) / tau,

    the positives the clusters of the sample's class, the negatives every cluster of the other classes.
    z [B, D], y [B], cluster P [C, S, D], cluster_valid [C, S], unbiased u [C, D], class_valid [C] -> [B]
    (0 for a sample whose class has no prototype)."""
    c, s, d = cluster.shape
    flat = cluster.reshape(c * s, d)
    sims = cosine_similarity(z[:, None, :], flat[None, :, :]).reshape(-1, c, s) / tau
    sims = jnp.where(cluster_valid[None], sims, -1e30)  # finite: no NaN gradient where nothing is valid
    pos = jnp.take_along_axis(sims, y[:, None, None], 1)[:, 0]
    has = class_valid[y]
    infonce = jax.nn.logsumexp(sims.reshape(-1, c * s), -1) - jax.nn.logsumexp(pos, -1)
    mse = jnp.mean(jnp.square(z - unbiased[y]), -1)
    return jnp.where(has, infonce + mse, 0.0)


def soft_target_ce(logits, teacher_logits, temperature: float):
    """Per-sample distillation CE -sum_c softmax(t / T)_c log_softmax(z)_c (teacher tempered by T, student at 1,
    no T^2 factor: FedPHP's KD). logits, teacher_logits [B, C] -> [B]."""
    target = jax.nn.softmax(teacher_logits / temperature, -1)
    return -jnp.sum(target * jax.nn.log_softmax(logits, -1), -1)


def joint_sq_distances(a, b):
    """D_uv = ||U_u - U_v||^2 over the rows of U = [a; b]. a, b [B, d] -> [2B, 2B]."""
    u = jnp.concatenate([a, b], 0)
    sq = jnp.sum(u * u, -1)
    return jnp.maximum(sq[:, None] + sq[None] - 2 * u @ u.T, 0.0)


def _mmd_of_distances(d, w, bandwidths):
    """``gaussian_mmd`` from the joint squared distances d [2B, 2B] (``joint_sq_distances``)."""
    k = jnp.sum(jnp.exp(-d[None] / jnp.reshape(jnp.asarray(bandwidths, d.dtype), (-1, 1, 1))), 0)
    m = w.shape[0]
    signed = k[:m, :m] + k[m:, m:] - k[:m, m:] - k[m:, :m]
    real = w[:, None] * w[None]
    return jnp.sum(real * signed) / jnp.maximum(jnp.sum(real), 1.0)


def _bandwidths_of_distances(d, w, kernels: int, multiplier: float):
    """``adaptive_bandwidths`` from the joint squared distances d [2B, 2B]."""
    mu = jnp.concatenate([w, w], 0)
    n = jnp.sum(mu)
    beta = jax.lax.stop_gradient(jnp.sum(mu[:, None] * mu[None] * d) / jnp.maximum(n * n - n, 1.0)) + 1e-8
    return beta / multiplier ** (kernels // 2) * multiplier ** jnp.arange(kernels)


def gaussian_mmd(a, b, w, bandwidths):
    """Squared MMD (biased: every pair, the diagonal included) between the real rows of a and b [B, d] with the
    kernel k(D) = sum_s exp(-D / bandwidths_s) of squared distances D:
    MMD^2 = mean over real (i, j) of k(D(a_i, a_j)) + k(D(b_i, b_j)) - 2 k(D(a_i, b_j)).
    w [B]: 1 for real rows; bandwidths [S] (or a list). -> []."""
    return _mmd_of_distances(joint_sq_distances(a, b), w, bandwidths)


def adaptive_bandwidths(a, b, w, kernels: int = 5, multiplier: float = 2.0):
    """DAN's (and FedPHP's) bandwidths beta m^k / m^(kernels // 2), k < kernels, with beta = sg(sum_uv D_uv /
    (n^2 - n)) + 1e-8 the mean squared distance of the real rows of U = [a; b] (n = 2 sum w). -> [kernels]."""
    return _bandwidths_of_distances(joint_sq_distances(a, b), w, kernels, multiplier)


def multi_kernel_mmd(a, b, w, kernels: int = 5, multiplier: float = 2.0):
    """FedPHP's (DAN's) multi-kernel MMD^2: ``gaussian_mmd`` with ``adaptive_bandwidths`` (the distances computed
    once for both). a, b [B, d]; w [B]."""
    d = joint_sq_distances(a, b)
    return _mmd_of_distances(d, w, _bandwidths_of_distances(d, w, kernels, multiplier))


def cosine_ce(features, embeddings, y):
    """Per-sample CE of the cosine similarities as logits, -log softmax_c(cos(f, E_c))[y] (GPFL's angle-level
    guidance: no temperature). features [B, d], embeddings [C, d], y [B] -> [B]."""
    f = features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)
    e = embeddings / jnp.maximum(jnp.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
    return cross_entropy(f @ e.T, y)
