"""User-level differential privacy for the averaging algorithms (DP-FedAvg: McMahan, Ramage, Talwar and Zhang,
"Learning Differentially Private Recurrent Language Models", ICLR 2018), with a Rényi-DP accountant.

Each client of a round's cohort of k clients clips its update of the shared parameters to l2 norm C,

    Δ_i = x_i - x,   Δ̃_i = Δ_i · min(1, C / ||Δ_i||)     (||·|| over every parameter leaf the aggregate shares),

the algorithm averages the clipped models x + Δ̃_i with equal weights, and the server adds Gaussian noise to
the mean's shared leaves:

    x̄ = x + (1/k) Σ_i Δ̃_i + N(0, (z C / k)² I)           (z: the noise multiplier).

The guarantee is user-level and replace-one: two populations that differ in one client's data. jaxfl draws a
fixed-size cohort (k of N clients without replacement, q = k / N); if the changed client is drawn, its clipped
update moves the mean by at most 2C / k, so a round is a Gaussian mechanism of noise multiplier σ = z / 2 on a
sample without replacement. Its Rényi DP of integer order α ≥ 2 (Wang, Balle and Kasiviswanathan, "Subsampled
Rényi Differential Privacy and Analytical Moments Accountant", AISTATS 2019, Thm. 27: Thm. 9's bound refined by
forward differences, for the Gaussian's ε(j) = j / (2σ²) and ε(∞) = ∞):

    RDP(α) = 1 / (α - 1) · log(1 + q² binom(α, 2) min(4 (e^{ε(2)} - 1), 2 e^{ε(2)})
                  + Σ_{j=3..α} q^j binom(α, j) min(4 (Δ^{2⌊j/2⌋} φ(0) · Δ^{2⌈j/2⌉} φ(0))^{1/2}, 2 e^{(j - 1) ε(j)})),

φ(l) = e^{(l - 1) ε(l)} = e^{l (l - 1) / (2σ²)}, Δ^m φ(0) = Σ_{i=0..m} (-1)^{m-i} binom(m, i) φ(i) its m-th
forward difference at 0 (summed exactly in decimal arithmetic: the terms cancel by up to hundreds of digits),
capped by the Gaussian's own ε(α) (subsampling never costs privacy; the cap binds near q = 1). Without the
first argument of each min it is their Thm. 9.
T rounds compose to T · RDP(α), and (ε, δ)-DP follows with (Balle et al., "Hypothesis Testing Interpretations
and Rényi Differential Privacy", AISTATS 2020, Thm. 21)

    ε = min_α  T · RDP(α) + log((α - 1) / α) - (log δ + log α) / (α - 1).

Adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021;
``with_privacy(quantile=γ)``): C becomes server state and after each round C' = C · exp(-η (b̄ - γ)), b̄ the
fraction of the cohort's updates no longer than C, counted with Gaussian noise of std σ_b; the update's noise
multiplier is raised to σ_Δ = (z^-2 - (2σ_b)^-2)^-1/2, so that update and count together are as private as
fixed clipping's update alone at z: when one client's data changes the count moves by at most 1 and the update
by 2C, and (2C / (σ_Δ C))² + (1 / σ_b)² = (2C / (z C))², the same Gaussian mechanism of multiplier z / 2. The
accountant above applies unchanged.

``rdp_poisson_gaussian`` is the convention of TFF and FedJAX (Poisson sampling, add/remove one client; Mironov,
Talwar and Zhang 2019, Sec. 3.3): its ε is smaller at the same z (6 times at z = 2-4 and 17 times at z = 1 for
q = 0.1, 200 rounds, δ = 5e-4). It does not bound the fixed-size cohort (``Accountant.report`` gives it there
for comparison, labelled); it bounds Poisson sampling (``cohort.poisson_members``: each client joins a round
with probability q on its own stream), for which ``with_privacy(expected_clients=qN)`` runs McMahan et al.'s
fixed-denominator estimate

    x̄ = x + (1 / qN) Σ_{i in the cohort} Δ̃_i + N(0, (z C / qN)² I)

(adding or removing one client moves the sum by at most C: sensitivity C / qN, noise multiplier z), and
``Accountant(..., sampling="poisson")`` accounts for it.

Sample-level DP (DP-SGD in local training, ``jaxfl.core.dpsgd``) is accounted for by ``SampleAccountant``: the
same Poisson curve per local step, composed over every client's steps.

Deviations:
- The bound is the one Google's ``dp_accounting`` computes for sampling without replacement at orders up to 256
  (equal to 1e-9 in ``tests/test_privacy.py``), with exact forward differences: where dp_accounting's float64
  differences lose every digit to cancellation (σ = 20 and orders of 64 or more) its RDP is up to 4 times
  larger, jaxfl's matches a quadrature of E[(L - 1)^m]. Thm. 9 alone (``rdp_wor_subsampled``) is 0-4 % above it
  in the settings of ``experiments/dp_fedavg.py`` (z = 4: 6.60 against 6.37), up to 2.6 times for small q and
  large z.
- Integer orders only (2..256): ε is above an accountant with fractional orders when the best order is
  small (ε of tens or more).
- BatchNorm statistics are data too: a run refuses DP when the algorithm averages them (``bn_stats_shared``).
- A simulation's guarantee: the noise comes from the run's seed (saved in config.json), and the logs carry
  data-dependent values that are not accounted for (each client's update norm, training losses) and, under
  Poisson sampling, who was drawn (``clients_trained``): the add/remove bound assumes the cohort is secret.
"""
from __future__ import annotations

import decimal
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from .types import Algorithm

ORDERS = tuple(range(2, 257))


def all_shared(params):
    """The share mask of an aggregate that averages every parameter leaf."""
    return jax.tree_util.tree_map(lambda _: True, params)


def update_norm(server_params, trained_params, shared=None):
    """||x_i - x||_2 over the parameter leaves ``shared`` marks (a tree of Python bools or bool scalars over
    ``server_params``; None: every leaf). One client: leaves [...] -> float32 []."""
    shared = shared if shared is not None else all_shared(server_params)
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


DP_LEVELS = ("user", "sample")  # DP-FedAvg here; DP-SGD in local training (``jaxfl.core.dpsgd``)
DEFAULT_CLIP_LR = 0.2  # adaptive clipping's learning rate (Andrew et al.'s and TFF's)
CLIP_KEY = "dp_clip"  # adaptive clipping: the current clipping norm, beside the algorithm's server state
COUNT_STREAM = 2 ** 32 - 1  # fold_in(key, COUNT_STREAM): the clipped count's noise (a round index never reaches it)


def value_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """The update's noise multiplier σ_Δ under adaptive clipping, such that the update and the noised count of
    unclipped clients (std σ_b) together are the Gaussian mechanism of multiplier z that fixed clipping would be
    (Andrew et al. 2021, Thm. 1; TFF's ``adaptive_clip_noise_params``): σ_Δ = (z^-2 - (2 σ_b)^-2)^-1/2.
    Needs z < 2 σ_b; z = 0 gives 0."""
    if noise_multiplier == 0:
        return 0.0
    if not noise_multiplier < 2 * count_std:
        raise ValueError(f"adaptive clipping at noise multiplier {noise_multiplier} needs a count noise std above "
                         f"{noise_multiplier / 2}, got {count_std}")
    return (noise_multiplier ** -2 - (2 * count_std) ** -2) ** -0.5


def update_clip(clip, unclipped_fraction, target: float, lr: float):
    """The geometric clip update of adaptive clipping (Andrew et al. 2021, Alg. 1):
    C' = C · exp(-η (b̄ - γ)), b̄ the (noised) fraction of the cohort's updates no longer than C, γ the target
    quantile; C shrinks while more than γ of the updates fit. Scalars -> scalar."""
    return clip * jnp.exp(-lr * (unclipped_fraction - target))


def fixed_denominator(server_params, mean_params, shared, members, expected):
    """x + (x̄ - x) · k / (qN) on the leaves ``shared`` marks (the others: x̄): the cohort's mean x̄ of its k
    members turned into McMahan et al.'s fixed-denominator estimate x + Σ_i Δ̃_i / (qN), qN = ``expected``, the
    expected cohort size of Poisson sampling. Leaves [...]; members, expected: [] -> leaves [...]."""
    scale = members / expected

    def one(s, x, m):
        moved = x + (m - x) * scale.astype(m.dtype)
        return m if s is False else (moved if s is True else jnp.where(s, moved, m))
    return jax.tree_util.tree_map(one, shared, server_params, mean_params)


def with_privacy(alg: Algorithm, clip: float, noise_multiplier: float, key, *, quantile: float | None = None,
                 clip_lr: float = DEFAULT_CLIP_LR, count_std: float = 0.0,
                 expected_clients: float | None = None) -> Algorithm:
    """``alg`` as DP-FedAvg: each client's update of the shared parameters clipped to norm C (``clip``), Gaussian
    noise of std z · C / k on the aggregate's shared parameters (z = ``noise_multiplier``; k: the cohort's
    clients of positive weight; the engine must weigh them equally).

    ``quantile`` γ: adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping",
    NeurIPS 2021): C starts at ``clip`` and follows ``update_clip`` with ``clip_lr`` η and the fraction of
    unclipped updates counted with Gaussian noise of std ``count_std`` σ_b; the update's noise multiplier
    becomes ``value_noise_multiplier(z, σ_b)``, so the round's privacy is fixed clipping's at z. C is kept in the
    server state (``CLIP_KEY``; checkpointed), and each round's metrics (``round_metrics``) give ``dp_clip``, the
    C the round clipped to.

    ``alg``'s server state must hold the global model's ``"params"``, its ``aggregate`` average the trained rows'
    ``"params"`` (those ``alg.share_mask`` marks, all if it has none) and keep per client only what the clients
    trained. Round t's noise comes from fold_in(key, t) (the count's from fold_in(fold_in(key, COUNT_STREAM), t)).
    A client's metrics gain ``update_norm`` (before clipping); its trained row is ``alg``'s own (so
    ``predict_trained`` sees what it expects).

    ``expected_clients`` qN: the cohort is Poisson-sampled (``cohort.poisson_members``, q the sampling rate),
    and the mean becomes McMahan et al.'s fixed-denominator estimate x + Σ_i Δ̃_i / (qN) with noise of std
    z C / (qN) (add/remove neighbours, sensitivity C / (qN): ``rdp_poisson_gaussian`` accounts for it); an empty
    cohort leaves the model as it was, plus the noise. Adaptive clipping then counts the centred indicators
    Σ_i (b_i - 1/2) + N(0, σ_b²) (sensitivity 1/2) and estimates b̄ = that / (qN) + 1/2 (Andrew et al., Alg. 1)."""
    adaptive = quantile is not None
    noise = value_noise_multiplier(noise_multiplier, count_std) if adaptive else noise_multiplier

    def inner(server):  # what ``alg``'s own functions see: their server state without the clip
        return {k: v for k, v in server.items() if k != CLIP_KEY} if adaptive else server

    def current_clip(server):
        return server[CLIP_KEY] if adaptive else clip

    def mask(server, info):
        return alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])

    def init(rng, sample_x):
        server, client = alg.init(rng, sample_x)
        return ({**server, CLIP_KEY: jnp.asarray(clip, jnp.float32)} if adaptive else server), client

    def local_update(server, client, data, rng, info):
        s = inner(server)
        trained, metrics = alg.local_update(s, client, data, rng, info)
        return trained, dict(metrics, update_norm=update_norm(s["params"], trained["params"], mask(s, info)))

    def aggregate(server, trained, weights, info):
        s, c = inner(server), current_clip(server)
        shared = mask(s, info)
        norms = jax.vmap(lambda row: update_norm(s["params"], row, shared))(trained["params"])
        clipped = {**trained, "params": clip_updates(s["params"], trained["params"], clip_factor(norms, c))}
        new, _ = alg.aggregate(s, clipped, weights, info)  # the server's model from the clipped updates
        _, kept = alg.aggregate(s, trained, weights, info)  # what clients keep: their own training (XLA
        # drops the unused halves of the two calls)
        real = weights > 0
        members = jnp.sum(real).astype(jnp.float32)
        if expected_clients is None:  # a fixed-size cohort: the mean over its k members
            k = jnp.maximum(members, 1.0)
        else:  # Poisson sampling: the fixed denominator qN (an empty cohort's mean is the model as it was)
            k = jnp.float32(expected_clients)
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(members > 0, a, b), new, s)
            new = {**new, "params": fixed_denominator(s["params"], new["params"], shared, members, k)}
        if noise > 0:
            noisy = add_noise(jax.random.fold_in(key, info.round), new["params"], shared, noise * c / k)
            new = {**new, "params": noisy}
        if adaptive:
            fits = jnp.sum(real & (norms <= c)).astype(jnp.float32)
            if expected_clients is not None:
                fits = fits - members / 2  # centred: Σ (b_i - 1/2), sensitivity 1/2 under add/remove
            if count_std > 0:
                count_key = jax.random.fold_in(jax.random.fold_in(key, COUNT_STREAM), info.round)
                fits = fits + count_std * jax.random.normal(count_key, ())
            fraction = fits / k if expected_clients is None else fits / k + 0.5
            new = {**new, CLIP_KEY: update_clip(c, fraction, quantile, clip_lr).astype(jnp.float32)}
        return new, kept

    def round_metrics(before, after):  # the clip this round used (adaptive), and what ``alg`` reports
        own = {} if alg.round_metrics is None else alg.round_metrics(inner(before), inner(after))
        return dict(own, dp_clip=before[CLIP_KEY]) if adaptive else own

    def wrap(fn):  # fn(server, ...) of ``alg``, given the server state without the clip
        return None if fn is None else (lambda server, *a, **kw: fn(inner(server), *a, **kw))

    return alg._replace(init=init, local_update=local_update, aggregate=aggregate, predict=wrap(alg.predict),
                        predict_trained=wrap(alg.predict_trained), prepare_predict=wrap(alg.prepare_predict),
                        share_mask=wrap(alg.share_mask), round_metrics=round_metrics,
                        aggregates_empty=expected_clients is not None)  # an empty round is noised too


# -- the accountant (host-side numpy) ------------------------------------------------------------------------
def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


@functools.lru_cache(maxsize=8)
def _log_factorials(top: int) -> np.ndarray:
    """log k! for k = 0..top (read-only), for binom(α, j) at every order at once."""
    out = np.array([math.lgamma(k + 1) for k in range(top + 1)])
    out.flags.writeable = False
    return out


def _log_sum_rows(logs) -> np.ndarray:
    """log Σ_j e^{logs[i, j]} for each row i, without overflow: [m, n] -> [m] (inf where a row holds inf)."""
    top = logs.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):  # (inf - inf in an infinite row: its sum is inf)
        out = top[:, 0] + np.log(np.exp(logs - top).sum(axis=1))
    return np.where(np.isposinf(top[:, 0]), np.inf, out)


def _gaussian_rdp(orders, sigma: float) -> np.ndarray:
    """The Gaussian mechanism's RDP α / (2σ²) at ``orders``, inf where it overflows (σ of 1e-160 and below)."""
    with np.errstate(over="ignore", divide="ignore"):
        return np.asarray(orders, np.float64) * (0.5 / np.float64(sigma)) / np.float64(sigma)


TINY_NOISE = 1e-3  # below it a subsampled curve is the Gaussian's own within a relative 1e-4 (its sums overflow)


@functools.lru_cache(maxsize=64)
def _log_even_differences(sigma: float, top: int) -> tuple:
    """log Δ^m φ(0) for m = 0, 1, ..., ``top`` (the odd ones NaN: unused), φ(l) = e^{l (l - 1) / (2σ²)}: the
    alternating sums in decimal arithmetic, its precision raised until the cancellation (the log10 ratio of the
    sum of the terms' magnitudes to the result) leaves 25 digits."""
    c = 1 / (2 * sigma * sigma)
    # log of the sum of |terms|, in floats: how many digits the cancellation can take
    log_phi = [i * (i - 1) * c for i in range(top + 1)]
    log_mag = [max(_log_binom(m, i) + log_phi[i] for i in range(m + 1)) + math.log(m + 1) for m in range(top + 1)]
    digits = 60
    while True:
        ctx = decimal.Context(prec=digits, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
        r2 = ctx.exp(ctx.create_decimal(repr(2 * c)))  # φ(i + 1) = φ(i) · r^{2i}, r = e^c
        phi, step = [ctx.create_decimal(1)], ctx.create_decimal(1)
        for _ in range(top):
            phi.append(ctx.multiply(phi[-1], step))
            step = ctx.multiply(step, r2)
        out, need = [math.nan] * (top + 1), 0.0
        for m in range(0, top + 1, 2):
            total = ctx.create_decimal(0)
            for i in range(m + 1):
                term = ctx.multiply(math.comb(m, i), phi[i])
                total = ctx.add(total, term) if (m - i) % 2 == 0 else ctx.subtract(total, term)
            if total <= 0:  # (even differences are moments E[(L - 1)^m] >= 0: only cancellation gives <= 0)
                need = math.inf
                break
            out[m] = float(total.ln(ctx))
            need = max(need, (log_mag[m] - out[m]) / math.log(10) + 25)
        if need <= digits:
            return tuple(out)
        digits = int(min(2 * digits, need + 10) if math.isfinite(need) else 2 * digits)


def rdp_wor_gaussian(q: float, sigma: float, orders=ORDERS) -> np.ndarray:
    """RDP(α) of one round of the Gaussian mechanism of noise multiplier σ on a sample of a fraction q drawn
    without replacement, replace-one neighbours (module docstring: Wang et al. 2019, Thm. 27, capped by the
    Gaussian's own α / (2σ²)), at integer orders α >= 2; q = 0 gives 0, σ = 0 inf. orders: ints [m] -> float64
    [m]."""
    if q == 0:
        return np.zeros(len(orders))
    if sigma == 0:
        return np.full(len(orders), math.inf)
    if sigma < TINY_NOISE:  # (the cap: subsampling changes nothing measurable there)
        return _gaussian_rdp(orders, sigma)
    orders = [int(a) for a in orders]
    top = max(orders)
    eps = lambda j: j / (2 * sigma * sigma)  # the Gaussian's RDP at order j
    diffs = np.asarray(_log_even_differences(float(sigma), 2 * (-(-top // 2))))
    j = np.arange(3, top + 1)
    refined = math.log(4) + 0.5 * (diffs[2 * (j // 2)] + diffs[2 * (-(-j // 2))])
    # log of the j-th term without its binom(α, j): j >= 3, then j = 2's log min(4 (e^{ε(2)} - 1), 2 e^{ε(2)})
    tail = np.minimum(refined, math.log(2) + (j - 1) * eps(j)) + j * math.log(q)
    log_expm1 = eps(2) + math.log(-math.expm1(-eps(2)))  # log(e^x - 1), without overflow at tiny σ
    second = 2 * math.log(q) + min(math.log(4) + log_expm1, math.log(2) + eps(2))
    log_fact = _log_factorials(top)
    out = []
    for a in orders:
        log_binom = log_fact[a] - log_fact[j[:a - 2]] - log_fact[a - j[:a - 2]]
        logs = np.concatenate([[0.0, _log_binom(a, 2) + second], tail[:a - 2] + log_binom])
        top_log = logs.max()
        log_sum = top_log + math.log(np.exp(logs - top_log).sum())
        # subsampling never costs privacy: the Gaussian's own RDP bounds it too (the tighter near q = 1)
        out.append(min(log_sum / (a - 1), eps(a)))
    return np.asarray(out, np.float64)


def rdp_wor_subsampled(q: float, rdp) -> np.ndarray:
    """RDP(α) of any mechanism of RDP curve ε(j) (``rdp``, float [255] at the orders 2..256, ``ORDERS``) run on a
    fixed-size sample of a fraction q of the units drawn without replacement, replace-one units (Wang et al. 2019,
    Thm. 9, with ε(∞) = ∞), capped by ε(α) itself:

        RDP(α) = 1 / (α - 1) · log(1 + q² binom(α, 2) min(4 (e^{ε(2)} - 1), 2 e^{ε(2)})
                                    + Σ_{j=3..α} q^j binom(α, j) 2 e^{(j - 1) ε(j)}).

    q = 1 gives the curve itself. -> float64 [255]."""
    eps = np.asarray(rdp, np.float64)
    if len(eps) != len(ORDERS):
        raise ValueError(f"rdp_wor_subsampled needs the curve at orders {ORDERS[0]}..{ORDERS[-1]}")
    if q >= 1:
        return eps
    if q == 0:
        return np.zeros_like(eps)
    a = np.asarray(ORDERS, np.int64)[:, None]
    j = np.arange(3, ORDERS[-1] + 1)[None, :]
    log_fact = _log_factorials(ORDERS[-1])
    tail = (log_fact[a] - log_fact[j] - log_fact[np.maximum(a - j, 0)] + j * math.log(q) + math.log(2)
            + (j - 1) * eps[j - 2])
    tail = np.where(j <= a, tail, -np.inf)
    e2 = eps[0]
    log_expm1 = e2 + math.log(-math.expm1(-e2)) if e2 > 0 else -np.inf  # log(e^x - 1) without overflow
    second = (2 * math.log(q) + log_fact[a[:, 0]] - log_fact[2] - log_fact[a[:, 0] - 2]
              + min(math.log(4) + log_expm1, math.log(2) + e2))
    logs = np.concatenate([np.zeros((len(ORDERS), 1)), second[:, None], tail], axis=1)
    return np.minimum(_log_sum_rows(logs) / (a[:, 0] - 1), eps)


def rdp_poisson_gaussian(q: float, noise_multiplier: float, orders=ORDERS) -> np.ndarray:
    """RDP(α) of one round of the Poisson-sampled Gaussian mechanism (sampling rate q, noise z relative to the
    sensitivity, add/remove neighbours; Mironov, Talwar and Zhang 2019, Sec. 3.3) at integer orders α:
    1 / (α - 1) · log Σ_{j=0..α} binom(α, j) (1 - q)^(α-j) q^j exp((j² - j) / (2 z²)). Not what a jaxfl run
    is (module docstring): the convention its ``Accountant`` reports beside the valid ε, for comparison.
    q = 0 gives 0, z = 0 inf. orders: ints [m] -> float64 [m]."""
    z = float(noise_multiplier)
    if q == 0:
        return np.zeros(len(orders))
    if z == 0:
        return np.full(len(orders), math.inf)
    if q == 1 or z < TINY_NOISE:  # (at tiny z the sampled curve is the Gaussian's own, and its sum overflows)
        return _gaussian_rdp(orders, z)
    a = np.asarray(orders, np.int64)[:, None]
    j = np.arange(int(a.max()) + 1)[None, :]
    log_fact = _log_factorials(int(a.max()))
    logs = (log_fact[a] - log_fact[j] - log_fact[np.maximum(a - j, 0)] + j * math.log(q)
            + (a - j) * math.log1p(-q) + (j * j - j) / (2 * z * z))
    logs = np.where(j <= a, logs, -np.inf)  # the sum runs over j = 0..α
    return _log_sum_rows(logs) / (a[:, 0] - 1)


def epsilon_from_rdp(rdp, delta: float, orders=ORDERS) -> tuple[float, int]:
    """(ε, α): the smallest ε over the orders of ``rdp`` (a composed RDP curve [m]) at δ (module docstring)."""
    a = np.asarray(orders, np.float64)
    eps = np.asarray(rdp, np.float64) + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    best = int(np.argmin(eps))
    return max(float(eps[best]), 0.0), int(a[best])


class Accountant:
    """ε after t rounds of DP-FedAvg with noise z at δ: on a fixed-size cohort of k of N clients (q = k / N;
    ``sampling="fixed"``), replace-one neighbours, sensitivity 2C / k (``rdp_wor_gaussian``); on a Poisson
    cohort of rate q (``sampling="poisson"``, the fixed denominator qN), add/remove neighbours, sensitivity
    C / (qN) (``rdp_poisson_gaussian``)."""

    def __init__(self, q: float, noise_multiplier: float, delta: float, sampling: str = "fixed"):
        self.q, self.noise_multiplier, self.delta, self.sampling = q, noise_multiplier, delta, sampling
        # one round's curve, composed by multiplying
        self._rdp = (rdp_poisson_gaussian(q, noise_multiplier) if sampling == "poisson"
                     else rdp_wor_gaussian(q, noise_multiplier / 2))

    def epsilon(self, rounds: int) -> float:
        if self.noise_multiplier == 0:
            return math.inf
        return epsilon_from_rdp(rounds * self._rdp, self.delta)[0]

    def report(self, rounds: int) -> dict:
        """summary.json's privacy record after ``rounds`` rounds (epsilons None without noise: no guarantee)."""
        finite = lambda e: None if math.isinf(e) else e
        base = {"epsilon": finite(self.epsilon(rounds)), "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "sampling_rate": self.q, "rounds": rounds}
        if self.sampling == "poisson":
            return {**base, "accountant": "RDP, Poisson sampling (fixed denominator), add/remove one client, "
                                          "integer orders 2-256"}
        # the comparison figure, needed once a run: computed here, not in every Accountant (noise_for_epsilon
        # builds one per bisection step)
        poisson = epsilon_from_rdp(rounds * rdp_poisson_gaussian(self.q, self.noise_multiplier), self.delta)[0]
        return {**base, "accountant": "RDP, fixed-size cohort (sampling without replacement), replace-one, "
                                      "integer orders 2-256",
                "epsilon_poisson_convention": finite(poisson),
                "epsilon_poisson_convention_note": "TFF's and FedJAX's convention (Poisson sampling, add/remove one "
                                                   "client): for comparison with papers; it does not bound this run "
                                                   "(--cohort-sampling poisson runs the mechanism it bounds)"}

    def describe(self, rounds: int) -> str:
        """One line for the start-up message."""
        eps = self.epsilon(rounds)
        spent = "no privacy guarantee (no noise)" if math.isinf(eps) else f"({eps:.3g}, {self.delta:.2g})-DP"
        neighbours = "add/remove, Poisson sampling" if self.sampling == "poisson" else "replace-one"
        return (f"noise {self.noise_multiplier:g}, {self.q:.3g} of the clients a round: {spent} after {rounds} rounds "
                f"(user-level, {neighbours})")


class SampleAccountant:
    """ε after t rounds of DP-SGD in every client's local training (``jaxfl.core.dpsgd``), add/remove one
    sample, at δ. Client i takes E · s_i steps a round (s_i = ceil(n_i / B)), each the Poisson-sampled
    Gaussian mechanism of rate 1 / s_i and noise multiplier z (``rdp_poisson_gaussian``): a round in which it
    trains has RDP ε_i(α) = E s_i RDP_{1/s_i}(α) for its samples. With ``cohort_fraction`` q < 1 (a fixed-size
    cohort of k of N clients, drawn without replacement, of an algorithm whose clients keep nothing between
    rounds, so that a round is a function of the global model and its cohort's data alone), a round is that
    mechanism on a sample of the clients: ``rdp_wor_subsampled(q, ε_i)`` (Wang et al.'s Thm. 9; one sample
    changed changes its client's data: replace-one clients). Otherwise (q = 1, Poisson cohorts, clients that keep
    state, which ties their rounds together) every client counts in every round. T rounds compose to T times the
    round's curve; the run's ε is the largest over the clients (every sample's guarantee). A straggler's shorter
    rounds count in full: an upper bound. counts: the clients' sample counts n_i."""

    def __init__(self, counts, batch_size: int, epochs: int, noise_multiplier: float, delta: float,
                 cohort_fraction: float = 1.0):
        self.noise_multiplier, self.delta, self.batch_size, self.epochs = noise_multiplier, delta, batch_size, epochs
        self.cohort_fraction = cohort_fraction
        self.steps = sorted({-(-int(n) // batch_size) for n in counts if int(n) > 0})  # distinct s_i
        round_rdp = lambda s: epochs * s * rdp_poisson_gaussian(1.0 / s, noise_multiplier)  # noqa: E731
        self._rdp = [rdp_wor_subsampled(cohort_fraction, round_rdp(s)) for s in self.steps]

    def epsilon(self, rounds: int) -> float:
        if self.noise_multiplier == 0:
            return math.inf
        return max(epsilon_from_rdp(rounds * rdp, self.delta)[0] for rdp in self._rdp)

    def worst_steps(self, rounds: int) -> int:
        """s_i of the clients whose samples spend the most (the smallest clients, usually: no amplification
        where n_i <= B)."""
        return self.steps[int(np.argmax([epsilon_from_rdp(rounds * rdp, self.delta)[0] for rdp in self._rdp]))]

    def report(self, rounds: int) -> dict:
        """summary.json's privacy record after ``rounds`` rounds (epsilon None without noise: no guarantee)."""
        eps = self.epsilon(rounds)
        return {"level": "sample", "epsilon": None if math.isinf(eps) else eps, "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "rounds": rounds, "local_epochs": self.epochs,
                "batch_size": self.batch_size, "worst_client_steps_per_epoch": self.worst_steps(rounds),
                "cohort_fraction": self.cohort_fraction,
                "accountant": "RDP, DP-SGD with Poisson-sampled batches (rate 1 / steps per epoch), add/remove one "
                              "sample, " + self._rounds_note() + ", integer orders 2-256"}

    def _rounds_note(self) -> str:
        return ("every client counted in every round" if self.cohort_fraction >= 1 else
                f"a fixed-size cohort of {self.cohort_fraction:.3g} of the clients a round (Thm. 9, replace-one "
                f"clients)")

    def describe(self, rounds: int) -> str:
        """One line for the start-up message."""
        eps = self.epsilon(rounds)
        spent = "no privacy guarantee (no noise)" if math.isinf(eps) else f"({eps:.3g}, {self.delta:.2g})-DP"
        return (f"noise {self.noise_multiplier:g}: {spent} after {rounds} rounds (sample-level, add/remove one "
                f"sample, {self._rounds_note()})")


def epsilon_floor(delta: float) -> float:
    """The smallest ε these accountants certify at δ, however large the noise: ``epsilon_from_rdp`` of a curve
    that is 0 at every order (min over α of log((α - 1) / α) - (log δ + log α) / (α - 1); the orders stop at
    256)."""
    return epsilon_from_rdp(np.zeros(len(ORDERS)), delta)[0]


def calibrate_noise(spent, target: float, what: str, delta: float | None = None) -> float:
    """The smallest noise multiplier z (to 0.1 %) with spent(z) <= ``target`` (spent: z -> ε, falling as z
    grows): bisection. ConfigError, naming ``what`` (e.g. "after 100 rounds at delta 1e-05"), for a target at
    or below ``epsilon_floor(delta)`` (when δ is given: no noise reaches it) and past z = 1000."""
    floor = None if delta is None else epsilon_floor(delta)
    if floor is not None and target <= floor:
        raise ConfigError(f"epsilon {target:g} is at or below {floor:.4g}, the smallest epsilon the accountant "
                          f"certifies at delta {delta:g} with any noise (its Renyi orders stop at 256); ask for a "
                          f"larger epsilon or delta")
    lo, hi = 0.0, 1.0
    while spent(hi) > target:
        lo, hi = hi, 2 * hi
        if hi > 1000:
            raise ConfigError(f"epsilon {target:g} {what} needs a noise multiplier above 1000; ask for a larger "
                              f"epsilon or delta")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) > target else (lo, mid)
    return hi


def noise_for_epsilon(q: float, rounds: int, delta: float, target: float, sampling: str = "fixed") -> float:
    """The smallest noise multiplier z (to 0.1 %) whose ``rounds`` rounds at sampling rate q spend at most ε =
    ``target`` at δ (``Accountant`` with ``sampling``). ConfigError past z = 1000."""
    return calibrate_noise(lambda z: Accountant(q, z, delta, sampling).epsilon(rounds), target,
                           f"after {rounds} rounds at delta {delta:g}", delta)


def bn_stats_shared(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg`` has BatchNorm statistics its clients do not keep to themselves (so the server averages
    them, without clipping or noise): its server state's top-level ``batch_stats`` has leaves and its client
    state's has fewer. Shapes only (``jax.eval_shape``)."""
    server, client = jax.eval_shape(alg.init, key, sample_x)
    count = lambda state: (len(jax.tree_util.tree_leaves(state.get("batch_stats", {})))
                           if isinstance(state, dict) else 0)
    return count(server) > count(client)


def has_batch_stats(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg``'s server or client state holds BatchNorm statistics (top-level ``batch_stats`` with
    leaves). Shapes only."""
    server, client = jax.eval_shape(alg.init, key, sample_x)
    return any(isinstance(state, dict) and jax.tree_util.tree_leaves(state.get("batch_stats", {}))
               for state in (server, client))


def clients_keep_state(alg: Algorithm, key, sample_x) -> bool:
    """Whether ``alg``'s clients keep any state between rounds (their client state has leaves). Shapes only."""
    _, client = jax.eval_shape(alg.init, key, sample_x)
    return bool(jax.tree_util.tree_leaves(client))


def default_delta(num_clients: int) -> float:
    """δ = N^-1.1 [OUR CHOICE]: below 1/N, as a user-level guarantee over N clients asks."""
    return float(num_clients) ** -1.1
