"""FedPAC's classifier combination: the simplex-constrained QP each client solves over the cohort's heads."""
from __future__ import annotations

import jax
import jax.numpy as jnp


ALPHA_EPS = 1e-3  # FedPAC official: head weights below eps are zeroed before normalising


def simplex_projection(v):
    """Euclidean projection of v [k] onto {a >= 0, sum a = 1} (Duchi et al. 2008, sort-based):
    a = max(v - theta, 0), theta = (sum of the rho largest - 1) / rho. The same projection as
    ``optax.projections.projection_simplex`` (tested to 1e-6), kept because optax writes theta as
    css / rho - 1 / rho, which rounds differently in the last bit for about 10% of inputs and would change
    FedPAC's recorded runs."""
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u)
    j = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
    rho = jnp.sum(u - (css - 1.0) / j > 0)  # >= 1 always
    theta = (css[rho - 1] - 1.0) / rho.astype(v.dtype)
    return jnp.maximum(v - theta, 0.0)


def simplex_qp(P, iters: int = 1000):
    """argmin_{a in simplex} a^T P a for a symmetric PSD P [k, k]: FISTA projected gradient, step 1/L with
    L = 2 lambda_max(P), from the uniform point. Pure and vmappable."""
    k = P.shape[0]
    L = jnp.maximum(2.0 * jnp.linalg.eigvalsh(P)[-1], 1e-30)
    x0 = jnp.full((k,), 1.0 / k, P.dtype)

    def step(_, carry):
        x, y, t = carry
        x_new = simplex_projection(y - (2.0 * (P @ y)) / L)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        return x_new, x_new + ((t - 1.0) / t_new) * (x_new - x), t_new

    return jax.lax.fori_loop(0, iters, step, (x0, x0, jnp.ones((), P.dtype)))[0]


def head_weights(v, H, iters: int = 1000):
    """The cohort's classifier-combination weights A [k, k] (row i: client i's alpha), from v [k] and
    H [k, C, d]: alpha_i = simplex_qp(diag(v) + D_i), D_i[j, l] = <H_i - H_j, H_i - H_l>; entries below 1e-3
    zeroed and rows renormalised (official ``get_head_agg_weight`` + ``agg_classifier_weighted_p``)."""
    flat = H.reshape(H.shape[0], -1)
    K = flat @ flat.T  # Gram matrix <H_j, H_l>

    def one(i):
        D = K[i, i] - K[i][None, :] - K[i][:, None] + K
        a = simplex_qp(jnp.diag(v) + D, iters)
        a = jnp.where(a > ALPHA_EPS, a, 0.0)
        return a / jnp.sum(a)  # the largest entry of a point of the simplex is >= 1/k > eps

    return jax.vmap(one)(jnp.arange(H.shape[0]))
