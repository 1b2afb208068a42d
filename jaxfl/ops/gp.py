"""Binary Gaussian-process classification with Polya-Gamma augmentation: pFedGP's node model, as pure functions.

pFedGP (Achituve et al., NeurIPS 2021; official IdanAchituve/pFedGP, ``pFedGP/pFedGP_full_data.py``) classifies
with a tree of binary GPs over a shared network's embeddings. Each binary GP has latent f ~ GP(mu, k), a
logistic likelihood p(y = 0 | f) = sigma(f) (label 0 is the "positive" side, as in the official code), and is
inferred by Gibbs sampling over the Polya-Gamma variables omega ~ PG(1, f), which make f | omega, y Gaussian:

    Sigma~ = (K^-1 + Omega)^-1 = K - K (K + Omega^-1)^-1 K,   mu~ = Sigma~ (kappa + K^-1 mu),   kappa = y0 - 1/2

(y0 = [y = 0]). The predictive distribution of f* at new points given omega is
    mean* = mu* + K_s^T (K + Omega^-1)^-1 (kappa / omega - mu),   var* = k** - diag(K_s^T (K + Omega^-1)^-1 K_s),
and the class probability is exp(E_{N(mean*, var*)}[log sigma(f*)]) averaged over the Gibbs chains (the official
``exp(quadrature(logsigmoid, dist)).mean(0)``, a geometric rather than arithmetic mean over f*).

Masks make every shape static: ``valid`` [N] marks the points that belong to the GP (the others get unit
prior variance, no likelihood and no cross-covariance, so they change nothing), so one jitted function serves
every node and client.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


PG_TERMS = 200  # series terms of the Polya-Gamma sampler; the tail enters through its exact mean
JITTER = 1e-3  # gpytorch's add_jitter default, as the official GPModel uses it


def polya_gamma_mean(c, b=1.0):
    """E[PG(b, c)] = b tanh(c/2) / (2c) (b/4 at c = 0). c [...] -> [...]."""
    c = jnp.abs(c)
    small = c < 1e-4
    safe = jnp.where(small, 1.0, c)
    return jnp.where(small, b * (0.25 - c * c / 48.0), b * jnp.tanh(safe / 2) / (2 * safe))


def polya_gamma_sample(key, c, b: float = 1.0, terms: int = PG_TERMS):
    """omega ~ PG(b, c) for each entry of c, by the series PG(b, c) = 1/(2 pi^2) sum_k g_k / ((k - 1/2)^2 +
    c^2 / (4 pi^2)), g_k ~ Gamma(b, 1) (Devroye's representation): the first ``terms`` terms sampled, the rest
    replaced by their mean, so E[omega] is exact. key, c [...] -> [...] (no gradient: the official sampler is
    numpy's)."""
    c = jax.lax.stop_gradient(c)
    k = jnp.arange(1, terms + 1, dtype=c.dtype) - 0.5
    denom = k * k + (c[..., None] / (2 * math.pi)) ** 2  # [..., terms]
    shape = c.shape + (terms,)
    # Gamma(1, 1) is Exp(1): the common b = 1 draws by inversion, ~30x faster on CPU than gamma's rejection loop
    g = (jax.random.exponential(key, shape, c.dtype) if isinstance(b, (int, float)) and b == 1
         else jax.random.gamma(key, b, shape, dtype=c.dtype))
    head = jnp.sum(g / denom, -1) / (2 * math.pi ** 2)
    head_mean = b * jnp.sum(1.0 / denom, -1) / (2 * math.pi ** 2)
    return head + jnp.maximum(polya_gamma_mean(c, b) - head_mean, 0.0)


def gauss_hermite(n: int = 20):
    """(locations, weights) for E_{N(m, v)}[g(f)] = sum_i w_i g(m + sqrt(2 v) x_i) (gpytorch's
    GaussHermiteQuadrature1D default, 20 points); weights sum to 1."""
    x, w = np.polynomial.hermite.hermgauss(n)
    return jnp.asarray(x, jnp.float32), jnp.asarray(w / math.sqrt(math.pi), jnp.float32)


def expected_log_sigmoid(mean, var, n: int = 20):
    """E_{f ~ N(mean, var)}[log sigma(f)] by Gauss-Hermite quadrature. mean, var [...] -> [...]."""
    x, w = gauss_hermite(n)
    f = mean[..., None] + jnp.sqrt(2 * jnp.maximum(var, 0.0))[..., None] * x
    return jnp.sum(w * jax.nn.log_sigmoid(f), -1)


def rbf_kernel(x1, x2, outputscale: float = 8.0, lengthscale: float = 1.0):
    """The official kernel: outputscale * exp(-||u1 - u2||^2 / (2 lengthscale^2)) on L2-normalised rows
    u = x / max(||x||, 1e-12). x1 [N, D], x2 [M, D] -> [N, M]."""
    u1 = x1 / jnp.maximum(jnp.linalg.norm(x1, axis=-1, keepdims=True), 1e-12)
    u2 = x2 / jnp.maximum(jnp.linalg.norm(x2, axis=-1, keepdims=True), 1e-12)
    sq = jnp.maximum(jnp.sum(u1 * u1, -1)[:, None] + jnp.sum(u2 * u2, -1)[None, :] - 2 * u1 @ u2.T, 0.0)
    return outputscale * jnp.exp(-0.5 * sq / (lengthscale * lengthscale))


def masked_prior(K, valid, jitter: float = JITTER):
    """The prior covariance restricted to the valid points: K + jitter I on them, the identity elsewhere.
    K [N, N], valid [N] -> [N, N]."""
    v = valid.astype(K.dtype)
    return (K + jitter * jnp.eye(K.shape[0], dtype=K.dtype)) * v[:, None] * v[None, :] + jnp.diag(1.0 - v)


def _noise(omega, valid):
    """Omega^-1's diagonal: 1/omega on the valid points, 1 elsewhere. omega [draws, N] -> [draws, N]."""
    return jnp.where(valid, 1.0 / jnp.maximum(omega, 1e-16), 1.0)


def _noisy_cholesky(K, omega, valid):
    """chol(K + Omega^-1) per chain, Omega^-1 = diag(1/omega) on the valid points and 1 elsewhere.
    K [N, N], omega [draws, N] -> [draws, N, N]."""
    return jnp.linalg.cholesky(K[None] + jax.vmap(jnp.diag)(_noise(omega, valid)))


def _lower_solve(L, B, transpose: bool = False):
    """L^-1 B (or L^-T B) for a batch of lower-triangular L [..., N, N] and B [..., N, R] -> [..., N, R], as ONE
    batched triangular solve. Why one call: jaxlib 0.10's CPU LAPACK kernels split a batch over XLA's intra-op
    pool and block until it is done, so two independent batched solves running at once can take every pool
    thread and deadlock (the pFedGP hang at 1,000 points per client); pFedGP's GP code keeps its LAPACK calls in
    one dependency chain."""
    return jax.lax.linalg.triangular_solve(L, B, left_side=True, lower=True, transpose_a=transpose)


def conditional_sample(key, K, L, y0, valid, omega, mean):
    """f ~ N(mu~, Sigma~), the latent function given omega, per chain, by pathwise conditioning (Matheron's rule):
    f = f0 + K (K + Omega^-1)^-1 (z - f0 - e), f0 ~ N(mean, K), e ~ N(0, Omega^-1), z = kappa / omega, which has
    exactly the mean mu~ = mean + K (K + Omega^-1)^-1 (z - mean) and the covariance Sigma~ = K - K (K + Omega^-1)^-1 K
    of the module docstring, at one Cholesky factor per chain instead of two and an [N, N] solve.
    key, K [N, N] the masked prior, L [N, N] = chol(K), y0 [N], valid [N], omega [draws, N], mean [N]
    -> f [draws, N] (the invalid entries are meaningless)."""
    draws, n = omega.shape
    k_prior, k_noise = jax.random.split(key)
    noise = _noise(omega, valid)
    f0 = mean + jax.random.normal(k_prior, (draws, n), K.dtype) @ L.T
    e = jnp.sqrt(noise) * jax.random.normal(k_noise, (draws, n), K.dtype)
    z = jnp.where(valid, (y0.astype(K.dtype) - 0.5) * noise, 0.0)
    Ln = _noisy_cholesky(K, omega, valid)  # [draws, N, N]
    u = _lower_solve(Ln, _lower_solve(Ln, (z - f0 - e)[..., None]), transpose=True)[..., 0]
    return f0 + u @ K


def gibbs_omega(key, K, y0, valid, steps: int = 5, draws: int = 20, mu=0.0):
    """Polya-Gamma variables after ``steps`` Gibbs sweeps of ``draws`` parallel chains (official ``gibbs_sample``):
    f ~ N(mu, K) (prior), omega ~ PG(1, f), then ``steps`` times f ~ N(mu~, Sigma~) (``conditional_sample``),
    omega ~ PG(1, f). K [N, N] the masked prior (``masked_prior``), y0 [N] 1 for label 0, valid [N]
    -> omega [draws, N] (1 on invalid points). Held fixed under differentiation."""
    K = jax.lax.stop_gradient(K)
    n = K.shape[0]
    L = jnp.linalg.cholesky(K)
    mean = jnp.full((n,), mu, K.dtype) * valid.astype(K.dtype)
    k_f, k_w, k_loop = jax.random.split(key, 3)
    f = mean + jax.random.normal(k_f, (draws, n), K.dtype) @ L.T
    omega = jnp.where(valid, polya_gamma_sample(k_w, f), 1.0)

    def sweep(omega, k):
        k_f, k_w = jax.random.split(k)
        f = conditional_sample(k_f, K, L, y0, valid, omega, mean)
        return jnp.where(valid, polya_gamma_sample(k_w, f), 1.0), None

    omega, _ = jax.lax.scan(sweep, omega, jax.random.split(k_loop, steps))
    return omega


@jax.custom_vjp
def _quadratic_forms(K, K_s, noise, z):
    """(q, r) [draws, M] with q = K_s^T S^-1 z and r = diag(K_s^T S^-1 K_s) per chain, S = K + diag(noise):
    K [N, N], K_s [N, M], noise [draws, N], z [draws, N]. Differentiable in K and K_s (noise and z, functions of
    the Polya-Gamma draws, are held fixed). The gradient is written out so that every LAPACK call of the backward
    pass, like the forward's, sits in one dependency chain (see ``_lower_solve``):
    with C = S^-1 K_s and a = S^-1 z, dK_s = a g_q^T + 2 C diag(g_r) and dS = -(C g_q) a^T - C diag(g_r) C^T."""
    return _quadratic_forms_fwd(K, K_s, noise, z)[0]


def _quadratic_forms_fwd(K, K_s, noise, z):
    m = K_s.shape[1]
    Ln = jnp.linalg.cholesky(K[None] + jax.vmap(jnp.diag)(noise))  # [draws, N, N]
    rhs = jnp.concatenate([jnp.broadcast_to(K_s, (noise.shape[0],) + K_s.shape), z[..., None]], -1)
    W = _lower_solve(Ln, rhs)  # [draws, N, M + 1] = Ln^-1 [K_s, z]
    A, b = W[..., :m], W[..., m]
    return (jnp.einsum("dnm,dn->dm", A, b), jnp.sum(A * A, 1)), (Ln, W, noise, z)


def _quadratic_forms_bwd(res, cotangents):
    Ln, W, noise, z = res
    g_q, g_r = cotangents
    m = W.shape[-1] - 1
    V = _lower_solve(Ln, W, transpose=True)  # S^-1 [K_s, z]
    C, a = V[..., :m], V[..., m]
    dK_s = jnp.einsum("dn,dm->nm", a, g_q) + 2.0 * jnp.einsum("dnm,dm->nm", C, g_r)
    Cg = jnp.einsum("dnm,dm->dn", C, g_q)
    dS = -jnp.einsum("dn,dk->nk", Cg, a) - jnp.einsum("dnm,dm,dkm->nk", C, g_r, C)
    return 0.5 * (dS + dS.T), dK_s, jnp.zeros_like(noise), jnp.zeros_like(z)


_quadratic_forms.defvjp(_quadratic_forms_fwd, _quadratic_forms_bwd)


def predictive(K, K_s, k_ss, y0, valid, omega, mu=0.0):
    """Predictive mean and variance of f* per chain (official ``predictive_dist``): K [N, N] the masked prior,
    K_s [N, M] the cross-covariance, k_ss [M] the test points' prior variances (jitter included), y0 [N], valid [N],
    omega [draws, N] -> (mean [draws, M], var [draws, M]). Invalid points contribute nothing. With
    S = K + Omega^-1: mean = mu + K_s^T S^-1 (kappa / omega - mu), var = k_ss - diag(K_s^T S^-1 K_s), from one
    Cholesky factor and one triangular solve per chain (``_quadratic_forms``)."""
    K_s = K_s * valid.astype(K.dtype)[:, None]
    z = jnp.where(valid, (y0.astype(K.dtype) - 0.5) / jnp.maximum(omega, 1e-16) - mu, 0.0)  # [draws, N]
    q, r = _quadratic_forms(K, K_s, jax.lax.stop_gradient(_noise(omega, valid)), jax.lax.stop_gradient(z))
    return mu + q, k_ss - r


def class_zero_probability(mean, var, n: int = 20):
    """p(y* = 0) = mean over chains of exp(E[log sigma(f*)]): mean, var [draws, M] -> [M]."""
    return jnp.mean(jnp.exp(expected_log_sigmoid(mean, var, n)), 0)
