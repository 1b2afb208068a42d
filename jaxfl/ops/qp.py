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


OUTSIDE = -1e30  # a coordinate outside the QP's support: the simplex projection gives it 0


def simplex_qp(P, iters: int = 1000, support=None):
    """argmin_{a in simplex} a^T P a for a symmetric PSD P [k, k]: FISTA projected gradient, step 1/L with
    L = 2 lambda_max(P), from the uniform point. Pure and vmappable.

    support: bool [k] or None (all): the coordinates a may use (the others are 0): the QP of P's support block,
    the same iterates on it (P outside the block is ignored)."""
    k = P.shape[0]
    if support is not None:  # P's support block, zeros elsewhere: the same largest eigenvalue (PSD)
        P = jnp.where(support[:, None] & support[None, :], P, 0.0)
    L = jnp.maximum(2.0 * jnp.linalg.eigvalsh(P)[-1], 1e-30)
    x0 = jnp.full((k,), 1.0 / k, P.dtype)
    if support is not None:  # uniform on the support (x0 itself, bit for bit, when that is everything)
        x0 = jnp.where(jnp.all(support), x0, jnp.where(support, 1.0 / jnp.sum(support).astype(P.dtype), 0.0))

    def step(_, carry):
        x, y, t = carry
        z = y - (2.0 * (P @ y)) / L
        x_new = simplex_projection(z if support is None else jnp.where(support, z, OUTSIDE))
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        return x_new, x_new + ((t - 1.0) / t_new) * (x_new - x), t_new

    return jax.lax.fori_loop(0, iters, step, (x0, x0, jnp.ones((), P.dtype)))[0]


def head_weights(v, H, iters: int = 1000, members=None):
    """The cohort's classifier-combination weights A [k, k] (row i: client i's alpha), from v [k] and
    H [k, C, d]: alpha_i = simplex_qp(diag(v) + D_i), D_i[j, l] = <H_i - H_j, H_i - H_l>; entries below 1e-3
    zeroed and rows renormalised (official ``get_head_agg_weight`` + ``agg_classifier_weighted_p``).
    members: bool [k] or None (all): the rows that are clients (a padded cohort's others get weight 0)."""
    flat = H.reshape(H.shape[0], -1)
    K = flat @ flat.T  # Gram matrix <H_j, H_l>

    def one(i):
        D = K[i, i] - K[i][None, :] - K[i][:, None] + K
        a = simplex_qp(jnp.diag(v) + D, iters, members)
        a = jnp.where(a > ALPHA_EPS, a, 0.0)
        return a / jnp.sum(a)  # the largest entry of a point of the simplex is >= 1/k > eps

    return jax.vmap(one)(jnp.arange(H.shape[0]))
