"""User-level differential privacy for the averaging algorithms (DP-FedAvg: McMahan, Ramage, Talwar and Zhang,
"Learning Differentially Private Recurrent Language Models", ICLR 2018), with a Rényi-DP accountant.

Each client of a round's cohort of k clients clips its update of the shared parameters to l2 norm C,

    Δ_i = x_i - x,   Δ̃_i = Δ_i · min(1, C / ||Δ_i||)     (||·|| over every parameter leaf the aggregate shares),

the algorithm averages the clipped models x + Δ̃_i with equal weights, and the server adds Gaussian noise to
the mean's shared leaves:

    x̄ = x + (1/k) Σ_i Δ̃_i + N(0, (z C / k)² I)           (z: the noise multiplier).

One client changes the mean by at most C / k, so a round is the sampled Gaussian mechanism with noise z times
its sensitivity, on a cohort of k of N clients (sampling rate q = k / N). Its Rényi DP of integer order α
(Mironov, Talwar and Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019, Sec. 3.3):

    RDP(α) = 1 / (α - 1) · log Σ_{j=0..α} binom(α, j) (1 - q)^(α-j) q^j exp((j² - j) / (2 z²)),

T rounds compose to T · RDP(α), and (ε, δ)-DP follows with (Balle et al., "Hypothesis Testing Interpretations
and Rényi Differential Privacy", AISTATS 2020, Thm. 21)

    ε = min_α  T · RDP(α) + log((α - 1) / α) - (log δ + log α) / (α - 1).

Deviations:
- The accountant assumes Poisson sampling (each client joins a round with chance q, TFF's and FedJAX's
  convention); jaxfl draws a fixed-size cohort of k of N clients, and the noise is scaled by the fixed k.
- Integer orders only (2..256): ε is a little above an accountant with fractional orders, by 0.3-1 % at
  ε ≈ 5-8 and up to 40 % at ε > 20 (q = 0.1, z = 0.5, T = 50: 27.0 here, 19.3 with fractional orders;
  ``tests/test_privacy.py`` holds the reference values and the command that made them).
- BatchNorm statistics are data too: a run refuses DP when the algorithm averages them (``bn_stats_shared``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .types import Algorithm

ORDERS = tuple(range(2, 257))
SCALE_KEY = "dp_scale"  # the clip factor a client's local update adds to its trained row


def update_norm(server_params, trained_params, shared=None):
    """||x_i - x||_2 over the parameter leaves ``shared`` marks (a tree of Python bools or bool scalars over
    ``server_params``; None: every leaf). One client: leaves [...] -> float32 []."""
    shared = shared if shared is not None else jax.tree_util.tree_map(lambda _: True, server_params)
    total = jnp.zeros((), jnp.float32)
    for s, x, xi in zip(jax.tree_util.tree_leaves(shared), jax.tree_util.tree_leaves(server_params),
                        jax.tree_util.tree_leaves(trained_params)):
        if s is False:
            continue
        sq = jnp.sum(jnp.square((xi - x).astype(jnp.float32)))
        total = total + (sq if s is True else jnp.where(s, sq, 0.0))
    return jnp.sqrt(total)


def clip_factor(norm, clip: float):
    """min(1, C / norm) (1 at norm 0). norm: [...] -> [...]."""
    return jnp.where(norm > clip, clip / jnp.where(norm > 0, norm, 1.0), 1.0)


def clip_updates(server_params, trained_params, scale):
    """x + c_i (x_i - x) for every client i, and x_i itself (bit for bit) where c_i = 1.
    server_params: leaves [...]; trained_params: leaves [k, ...]; scale c: [k] -> leaves [k, ...]."""
    def one(x, xi):
        c = scale.astype(xi.dtype).reshape((-1,) + (1,) * x.ndim)
        return jnp.where(c < 1, x[None] + c * (xi - x[None]), xi)
    return jax.tree_util.tree_map(one, server_params, trained_params)


def add_noise(key, params, shared, std):
    """params + N(0, std²) on every leaf ``shared`` marks (a leaf marked by a traced bool gets it where True);
    one key per leaf, ``fold_in(key, leaf index)``. params: leaves [...]; std: [] -> leaves [...]."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = []
    for i, (s, x) in enumerate(zip(jax.tree_util.tree_leaves(shared), leaves)):
        if s is False:
            out.append(x)
            continue
        noise = (std * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype)
        out.append(x + (noise if s is True else jnp.where(s, noise, 0)))
    return jax.tree_util.tree_unflatten(treedef, out)


def all_shared(params):
    """The share mask of an aggregate that averages every parameter leaf."""
    return jax.tree_util.tree_map(lambda _: True, params)


def with_privacy(alg: Algorithm, clip: float, noise_multiplier: float, key) -> Algorithm:
    """``alg`` as DP-FedAvg: each client's update of the shared parameters clipped to norm ``clip``, Gaussian
    noise of std noise_multiplier · clip / k on the aggregate's shared parameters (k: the cohort's clients of
    positive weight; the engine must weigh them equally).

    ``alg``'s server state must hold the global model's ``"params"``, its ``aggregate`` average the trained rows'
    ``"params"`` (those ``alg.share_mask`` marks, all if it has none) and keep per client only what the clients
    trained. Round t's noise comes from fold_in(key, t). A client's metrics gain ``update_norm`` (before
    clipping)."""
    def mask(server, info):
        return alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])

    def local_update(server, client, data, rng, info):
        trained, metrics = alg.local_update(server, client, data, rng, info)
        norm = update_norm(server["params"], trained["params"], mask(server, info))
        return {**trained, SCALE_KEY: clip_factor(norm, clip)}, dict(metrics, update_norm=norm)

    def aggregate(server, trained, weights, info):
        rows = {k: v for k, v in trained.items() if k != SCALE_KEY}
        clipped = {**rows, "params": clip_updates(server["params"], rows["params"], trained[SCALE_KEY])}
        new, _ = alg.aggregate(server, clipped, weights, info)  # the server's model from the clipped updates
        _, kept = alg.aggregate(server, rows, weights, info)  # what clients keep: their own training (XLA
        # drops the unused halves of the two calls)
        k = jnp.maximum(jnp.sum(weights > 0), 1).astype(jnp.float32)
        if noise_multiplier > 0:
            noisy = add_noise(jax.random.fold_in(key, info.round), new["params"], mask(server, info),
                              noise_multiplier * clip / k)
            new = {**new, "params": noisy}
        return new, kept

    return alg._replace(local_update=local_update, aggregate=aggregate)


# -- the accountant (host-side numpy) ------------------------------------------------------------------------
def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))


def rdp_sampled_gaussian(q: float, noise_multiplier: float, orders=ORDERS) -> np.ndarray:
    """RDP(α) of one round of the sampled Gaussian mechanism (sampling rate q, noise z) at integer orders α
    (module docstring); q = 0 gives 0, z = 0 gives inf. orders: ints [m] -> float64 [m]."""
    z = float(noise_multiplier)
    out = []
    for a in orders:
        a = int(a)
        if q == 0:
            out.append(0.0)
        elif z == 0:
            out.append(math.inf)
        elif q == 1:
            out.append(a / (2 * z * z))
        else:
            log_sum = -math.inf
            for j in range(a + 1):
                term = (math.lgamma(a + 1) - math.lgamma(j + 1) - math.lgamma(a - j + 1) + j * math.log(q)
                        + (a - j) * math.log1p(-q) + (j * j - j) / (2 * z * z))
                log_sum = _log_add(log_sum, term)
            out.append(log_sum / (a - 1))
    return np.asarray(out, np.float64)


def epsilon_from_rdp(rdp, delta: float, orders=ORDERS) -> tuple[float, int]:
    """(ε, α): the smallest ε over the orders of ``rdp`` (a composed RDP curve [m]) at δ (module docstring)."""
    a = np.asarray(orders, np.float64)
    eps = np.asarray(rdp, np.float64) + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    best = int(np.argmin(eps))
    return max(float(eps[best]), 0.0), int(a[best])


def epsilon(q: float, noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε of ``rounds`` rounds of DP-FedAvg at sampling rate q, noise z and δ (inf without noise)."""
    if noise_multiplier == 0:
        return math.inf
    return epsilon_from_rdp(rounds * rdp_sampled_gaussian(q, noise_multiplier), delta)[0]


class Accountant:
    """ε after t rounds of DP-FedAvg on a cohort of k of N clients (q = k / N) with noise z, at δ."""

    def __init__(self, q: float, noise_multiplier: float, delta: float):
        self.q, self.noise_multiplier, self.delta = q, noise_multiplier, delta
        self._rdp = rdp_sampled_gaussian(q, noise_multiplier)  # one round's curve, composed by multiplying

    def epsilon(self, rounds: int) -> float:
        if self.noise_multiplier == 0:
            return math.inf
        return epsilon_from_rdp(rounds * self._rdp, self.delta)[0]

    def report(self, rounds: int) -> dict:
        """summary.json's privacy record after ``rounds`` rounds (epsilon None without noise: no guarantee)."""
        eps = self.epsilon(rounds)
        return {"epsilon": None if math.isinf(eps) else eps, "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "sampling_rate": self.q, "rounds": rounds,
                "accountant": "RDP, Poisson sampling, integer orders 2-256"}

    def describe(self, rounds: int) -> str:
        """One line for the start-up message."""
        eps = self.epsilon(rounds)
        spent = "no privacy guarantee (no noise)" if math.isinf(eps) else f"({eps:.3g}, {self.delta:.2g})-DP"
        return f"noise {self.noise_multiplier:g}, sampling rate {self.q:.3g}: {spent} after {rounds} rounds"


def bn_stats_shared(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg`` has BatchNorm statistics its clients do not keep to themselves (so the server averages
    them, without clipping or noise): its server state's top-level ``batch_stats`` has leaves and its client
    state's has fewer. Shapes only (``jax.eval_shape``)."""
    server, client = jax.eval_shape(alg.init, key, sample_x)
    count = lambda state: (len(jax.tree_util.tree_leaves(state.get("batch_stats", {})))
                           if isinstance(state, dict) else 0)
    return count(server) > count(client)


def default_delta(num_clients: int) -> float:
    """δ = N^-1.1 [OUR CHOICE]: below 1/N, as a user-level guarantee over N clients asks."""
    return float(num_clients) ** -1.1
