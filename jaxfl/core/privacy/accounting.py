"""The Rényi-DP accountant (host-side numpy; the package docstring gives the bounds): the subsampled Gaussian's
RDP curves without replacement and under Poisson sampling, (epsilon, delta) from a curve, ``Accountant`` for
DP-FedAvg, ``SampleAccountant`` for DP-SGD in local training, and the noise that meets a target epsilon."""
from __future__ import annotations

import decimal
import functools
import math

import numpy as np

from ...errors import ConfigError

ORDERS = tuple(range(2, 257))


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


def default_delta(num_clients: int) -> float:
    """δ = N^-1.1 [OUR CHOICE]: below 1/N, as a user-level guarantee over N clients asks."""
    return float(num_clients) ** -1.1
