"""Steps of a run's build that stand alone: what the server does around an algorithm, and what malicious
clients do to their data. ``runner.Experiment`` calls them in this order after the algorithm (and user-level
DP, which the accountant ties to the run) is built.

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

import jax
import numpy as np

from ..core.server_opt import with_server_optimizer
from ..core.types import Algorithm
from ..data.ragged import RaggedClients
from ..ops.attacks import (UPDATE_ATTACKS, backdoor_samples, backdoor_test, flip_labels, malicious_clients,
                           parse_attack, with_update_attack)
from ..ops.compression import parse_compression, with_compression
from ..ops.robust_aggregation import parse_aggregator, with_robust_aggregate
from .config import RunConfig

ATTACK_STREAM, COMPRESSION_STREAM = 7, 8


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
