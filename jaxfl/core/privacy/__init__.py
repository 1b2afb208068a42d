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

The package: ``mechanism`` (clipping, noise, adaptive clipping, the fixed-denominator estimate, ``with_privacy``),
``accounting`` (the Rényi-DP curves, ``Accountant``, ``SampleAccountant``, noise calibration) and ``state``
(what an algorithm's state shapes say: shared BatchNorm statistics, state kept by clients).
"""
from .accounting import (ORDERS, TINY_NOISE, Accountant, SampleAccountant, calibrate_noise, default_delta,
                         epsilon_floor, epsilon_from_rdp, noise_for_epsilon, rdp_poisson_gaussian, rdp_wor_gaussian,
                         rdp_wor_subsampled)
from .mechanism import (CLIP_KEY, COUNT_STREAM, DEFAULT_CLIP_LR, DP_LEVELS, add_noise, all_shared, clip_factor,
                        clip_updates, fixed_denominator, update_clip, update_norm, value_noise_multiplier,
                        with_privacy)
from .state import bn_stats_shared, clients_keep_state, has_batch_stats

__all__ = ["CLIP_KEY", "COUNT_STREAM", "DEFAULT_CLIP_LR", "DP_LEVELS", "ORDERS", "TINY_NOISE", "Accountant",
           "SampleAccountant", "add_noise", "all_shared", "bn_stats_shared", "calibrate_noise", "clients_keep_state",
           "clip_factor", "clip_updates", "default_delta", "epsilon_floor", "epsilon_from_rdp", "fixed_denominator",
           "has_batch_stats", "noise_for_epsilon", "rdp_poisson_gaussian", "rdp_wor_gaussian", "rdp_wor_subsampled",
           "update_clip", "update_norm", "value_noise_multiplier", "with_privacy"]
