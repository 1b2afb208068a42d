"""Steps of a run's build that stand alone: differential privacy around an algorithm (``with_sample_dp``,
``with_user_dp``), what the server does around it, and what malicious clients do to their data.
``runner.Experiment`` calls them in this order after the algorithm is built.

Server-side composition, innermost first (each wrapper's ``aggregate`` calls the one inside it):

    algorithm (with DP-FedAvg's clipping and noise, if any)
    -> robust rule over the updates (``--aggregator``; ``ops.robust_aggregation``)
    -> decoding of compressed updates (``--compression``; ``ops.compression``)
    -> the malicious clients' update attack (``--attack``; ``ops.attacks``): outermost of the three, so the
       server's decoding, robust rule and clipping all see what the attackers send
    -> the server optimizer's step from the aggregate (``--server-opt``; ``core.server_opt``)

Keys: fold_in(key(seed), 7) for the attack, fold_in(key(seed), 8) for compression (4 is DP's, 0-3 and 5 the
engine's: ``core.cohort``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from ..core.dpsgd import SampleDP
from ..core.privacy import (Accountant, SampleAccountant, bn_stats_shared, calibrate_noise, clients_keep_state,
                            default_delta, has_batch_stats, noise_for_epsilon, with_privacy)
from ..core.server_opt import with_server_optimizer
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm
from ..data.ragged import RaggedClients
from ..errors import ConfigError
from ..ops.attacks import (UPDATE_ATTACKS, backdoor_samples, backdoor_test, flip_labels, malicious_clients,
                           parse_attack, with_update_attack)
from ..ops.compression import parse_compression, with_compression
from ..ops.robust_aggregation import parse_aggregator, with_robust_aggregate
from .config import RunConfig, dp_count_noise, model_name

ATTACK_STREAM, COMPRESSION_STREAM = 7, 8
DP_STREAM = 4  # fold_in(key(seed), 4): DP-FedAvg's noise


def with_sample_dp(cfg: RunConfig, alg: Algorithm, rebuild: Callable[[LocalTrainer], Algorithm],
                   trainer: LocalTrainer, counts: list[int], sample_x, rate: float):
    """DP-SGD in every client's local training (``--dp-level sample``): (cfg with its noise multiplier, the DP
    trainer, the algorithm built on it by ``rebuild(trainer)``, its ``SampleAccountant``). ``alg``, built on
    the plain trainer, tells what the DP one cannot change: whether a model has BatchNorm (refused: its
    statistics mix a batch's samples) and whether clients keep state (then a fixed-size cohort's draw does not
    amplify a round). ``counts``: every client's training samples; ``rate``: the cohort's sampling rate."""
    key = jax.random.key(0)
    if has_batch_stats(alg, key, sample_x):
        raise ConfigError(f"--dp-level sample: {model_name(cfg)} has BatchNorm, whose statistics mix a "
                          f"batch's samples; use a model without it (logreg, mlp_2nn, femnist_cnn, "
                          f"fedavg_cnn, pfl_cnn, vit_tiny, ...)")
    delta = cfg.dp_delta or default_delta(sum(counts))
    # the fixed-size cohort's draw amplifies a round only where it depends on the cohort's data alone
    amplified = cfg.cohort_sampling == "fixed" and not clients_keep_state(alg, key, sample_x)

    def spent(z):
        return SampleAccountant(counts, cfg.batch_size, cfg.local_epochs, z, delta, rate if amplified else 1.0)

    if cfg.dp_epsilon is not None:
        noise = calibrate_noise(lambda z: spent(z).epsilon(cfg.rounds), cfg.dp_epsilon,
                                f"after {cfg.rounds} rounds at delta {delta:g}", delta)
        cfg = cfg.replace(dp_noise=noise)
    trainer = dataclasses.replace(trainer, dp=SampleDP(cfg.dp_clip, cfg.dp_noise))
    return cfg, trainer, rebuild(trainer), spent(cfg.dp_noise)


def with_user_dp(cfg: RunConfig, alg: Algorithm, options, sample_x, num_clients: int, cohort: int, rate: float):
    """DP-FedAvg (``--dp-clip`` at user level): (cfg with its noise multiplier, ``alg`` with clipped updates and
    noise on the mean (``core.privacy.with_privacy``, before any server optimizer), its ``Accountant``).
    Refused where the algorithm averages BatchNorm statistics, which the mechanism does not protect."""
    if bn_stats_shared(alg, jax.random.key(0), sample_x):
        local = (f"--{cfg.algorithm}.local-bn" if hasattr(options, "local_bn") else "fedbn")
        raise ConfigError(f"--dp-clip: {cfg.algorithm} averages the BatchNorm statistics of "
                          f"{model_name(cfg)} without noise; use a model without BatchNorm (logreg, mlp_2nn, "
                          f"femnist_cnn, fedavg_cnn, pfl_cnn, vit_tiny, ...) or keep them per client "
                          f"({local})")
    delta = cfg.dp_delta or default_delta(num_clients)
    if cfg.dp_epsilon is not None:  # the noise multiplier that spends the asked epsilon over the run
        cfg = cfg.replace(dp_noise=noise_for_epsilon(rate, cfg.rounds, delta, cfg.dp_epsilon, cfg.cohort_sampling))
    adaptive = {} if cfg.dp_quantile is None else dict(
        quantile=cfg.dp_quantile, clip_lr=cfg.dp_clip_lr, count_std=dp_count_noise(cfg, cohort))
    poisson = cfg.cohort_sampling == "poisson"  # then the sum over the expected cohort qN
    alg = with_privacy(alg, cfg.dp_clip, cfg.dp_noise, jax.random.fold_in(jax.random.key(cfg.seed), DP_STREAM),
                       **adaptive, expected_clients=rate * num_clients if poisson else None)
    return cfg, alg, Accountant(rate, cfg.dp_noise, delta, cfg.cohort_sampling)


def malicious_of(cfg: RunConfig, num_clients: int) -> np.ndarray | None:
    """bool [N]: the run's malicious clients (``ops.attacks.malicious_clients``), None without an attack."""
    attack, _ = parse_attack(cfg.attack)
    return None if attack == "none" else malicious_clients(num_clients, cfg.malicious, cfg.seed)


def server_side(alg: Algorithm, cfg: RunConfig, malicious: np.ndarray | None) -> Algorithm:
    """``alg`` inside the server-side wrappers the config asks for, in the module docstring's order."""
    seed_key = jax.random.key(cfg.seed)
    name, params = parse_aggregator(cfg.aggregator)
    if name != "mean":
        alg = with_robust_aggregate(alg, name, **params)
    codec, codec_params = parse_compression(cfg.compression)
    if codec != "none":
        alg = with_compression(alg, codec, jax.random.fold_in(seed_key, COMPRESSION_STREAM), **codec_params)
    attack, attack_params = parse_attack(cfg.attack)
    if attack in UPDATE_ATTACKS:
        alg = with_update_attack(alg, attack, malicious, jax.random.fold_in(seed_key, ATTACK_STREAM), **attack_params)
    server_tx = cfg.server_optimizer()
    if server_tx is not None:
        alg = with_server_optimizer(alg, server_tx)
    return alg


def poison_data(cfg: RunConfig, train: RaggedClients, malicious: np.ndarray | None, num_classes: int) -> None:
    """A data attack on the malicious clients' training samples, in place: ``label_flip`` (y -> C - 1 - y) or
    ``backdoor`` (a triggered share relabelled; its draw from numpy's generator of [seed, 7])."""
    attack, params = parse_attack(cfg.attack)
    if attack not in ("label_flip", "backdoor"):
        return
    rng = np.random.default_rng([cfg.seed, ATTACK_STREAM])
    for i in np.flatnonzero(malicious):
        rows = slice(train.offsets[i], train.offsets[i] + train.counts[i])
        if attack == "label_flip":
            train.y[rows] = flip_labels(train.y[rows], num_classes)
        else:
            train.x[rows], train.y[rows] = backdoor_samples(train.x[rows], train.y[rows], params["target"],
                                                            params["fraction"], params["size"], rng)


def backdoor_test_data(cfg: RunConfig, test: RaggedClients) -> RaggedClients | None:
    """Every client's backdoor test set (``ops.attacks.backdoor_test``) under ``--attack backdoor``, else None."""
    attack, params = parse_attack(cfg.attack)
    if attack != "backdoor":
        return None
    return RaggedClients.from_clients([
        backdoor_test(test.x[o:o + c], test.y[o:o + c], params["target"], params["size"])
        for o, c in zip(test.offsets, test.counts)])
