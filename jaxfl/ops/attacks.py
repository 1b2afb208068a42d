"""Attacks by malicious clients, as transformations of their rows (``--attack``, ``--malicious``).

A run's malicious clients are fixed for the whole run: the first round(F N) of a permutation of the N client ids
drawn from the run's seed (``malicious_clients``). An update attack replaces a malicious row's update
Δ_i = x_i - x of the shared parameters (the trained model minus the global one) before aggregation; a data
attack changes a malicious client's training labels once, before the run. With B the benign rows of the
cohort (present and not malicious), μ and σ their per-coordinate mean and standard deviation:

    sign_flip   Δ_i <- -s Δ_i                                   (its own update; s = ``scale``, default 1)
    scale       Δ_i <- s Δ_i                                    (model replacement, Bagdasaryan et al. 2020)
    gaussian    Δ_i ~ N(0, σ_n^2 I)                             (σ_n = ``std``; no knowledge)
    alie        Δ_i <- μ - z σ                                  ("a little is enough", Baruch et al. 2019:
                z = Φ^-1((k - h) / k), h = floor(k / 2 + 1) - m, k rows, m of them malicious, or ``z``)
    ipm         Δ_i <- -ε μ                                     (inner-product manipulation, Xie et al. 2020)
    label_flip  y <- C - 1 - y on the malicious clients' training samples (data attack)
    backdoor    a ``size`` x ``size`` white square in the bottom-right corner of a ``fraction`` of the malicious
                clients' training images, relabelled ``target`` (data attack; Gu et al., BadNets, 2017);
                the run reports ``backdoor_accuracy``: the share of triggered test images whose true label is
                not ``target`` that the model classifies as ``target``, averaged over the clients

alie and ipm are omniscient: they read the benign rows of the cohort (μ, σ over B); the others read only the
attacker's own update. Every malicious row of a round gets the same alie / ipm update, as in the papers.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..core.privacy import all_shared
from ..core.types import Algorithm
from .spec import parse_spec
from .updates import shared_updates

# each attack's parameters and their defaults (``--attack NAME:key=value,...``)
ATTACKS = {
    "none": {},
    "sign_flip": {"scale": 1.0},
    "scale": {"scale": 10.0},
    "gaussian": {"std": 1.0},
    "alie": {"z": 0.0},  # 0: from the cohort (the paper's z_max)
    "ipm": {"eps": 0.5},
    "label_flip": {},
    "backdoor": {"target": 0, "fraction": 0.5, "size": 3},
}
UPDATE_ATTACKS = ("sign_flip", "scale", "gaussian", "alie", "ipm")


def _whole(text: str) -> int:
    """A whole number given as text ("3" or "3.0"); ValueError otherwise."""
    v = float(text)
    if v != int(v):
        raise ValueError(text)
    return int(v)


_CHECKS = {"scale": (float, lambda v: math.isfinite(v), "a finite number"),
           "std": (float, lambda v: 0 < v < math.inf, "a number > 0"),
           "z": (float, lambda v: v >= 0 and math.isfinite(v), "a number >= 0 (0: the paper's z from the cohort)"),
           "eps": (float, lambda v: 0 < v < math.inf, "a number > 0"),
           "target": (_whole, lambda v: v >= 0, "a class index >= 0"),
           "fraction": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
           "size": (_whole, lambda v: v >= 1, "an integer >= 1 (pixels)")}


def parse_attack(spec: str) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:key=value,..."`` -> (name, its parameters with defaults); ConfigError naming what
    is wrong and what is allowed (``spec.parse_spec``)."""
    return parse_spec(spec, "attack", ATTACKS, _CHECKS)


def malicious_clients(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """bool [N]: the run's malicious clients, the first round(fraction N) of a permutation of the ids drawn from
    ``seed`` (numpy; the same set every round and on resume)."""
    count = int(round(fraction * num_clients))
    chosen = np.random.default_rng([seed, 0x5EED]).permutation(num_clients)[:count]
    mask = np.zeros(num_clients, bool)
    mask[chosen] = True
    return mask


def flip_labels(y, num_classes: int):
    """y -> C - 1 - y (label flipping: every class mapped to another one for C >= 2, the same map for all)."""
    return num_classes - 1 - y


def add_trigger(x, size: int):
    """Images [n, H, W, C] with their bottom-right ``size`` x ``size`` pixels at the channel maximum (255 for
    uint8, else 1). Pure numpy or jnp by the input's type."""
    top = 255 if x.dtype == np.uint8 else 1
    if isinstance(x, np.ndarray):
        out = x.copy()
        out[:, -size:, -size:, :] = top
        return out
    return x.at[:, -size:, -size:, :].set(top)


def backdoor_samples(x, y, target: int, fraction: float, size: int, rng: np.random.Generator):
    """(x, y) with round(fraction n) samples, drawn by ``rng``, triggered (``add_trigger``) and relabelled
    ``target``. numpy."""
    x, y = np.array(x, copy=True), np.array(y, copy=True)
    chosen = rng.permutation(len(y))[:int(round(fraction * len(y)))]
    x[chosen] = add_trigger(x[chosen], size)
    y[chosen] = target
    return x, y


def backdoor_test(x, y, target: int, size: int):
    """The backdoor's test set of one client: its test images whose label is not ``target``, triggered, all
    labelled ``target`` (accuracy on it = the attack's success rate). numpy."""
    keep = np.asarray(y) != target
    return add_trigger(np.asarray(x)[keep], size), np.full(int(keep.sum()), target, np.int32)


def alie_z(k, m):
    """Baruch et al.'s z_max = Φ^-1((k - h) / k), h = floor(k / 2 + 1) - m: the largest shift that keeps the
    malicious rows within the majority's spread (k rows, m malicious; jnp scalars). Clamped to >= 0."""
    h = jnp.floor(k / 2 + 1) - m
    p = jnp.clip((k - h) / jnp.maximum(k, 1), 1e-6, 1 - 1e-6)
    return jnp.maximum(jax.scipy.special.ndtri(p), 0.0)


def attacked_updates(name: str, deltas, malicious, present, key, **params):
    """Δ [k, D] with the malicious present rows replaced by attack ``name`` (``UPDATE_ATTACKS``; the module
    docstring). malicious, present: bool [k]; key: the round's key (gaussian). -> [k, D]."""
    bad = malicious & present
    benign = (present & ~malicious).astype(deltas.dtype)
    nb = jnp.maximum(jnp.sum(benign), 1.0)
    mu = jnp.sum(benign[:, None] * jnp.where(present[:, None], deltas, 0.0), axis=0) / nb
    if name == "sign_flip":
        new = -params["scale"] * deltas
    elif name == "scale":
        new = params["scale"] * deltas
    elif name == "gaussian":
        new = params["std"] * jax.random.normal(key, deltas.shape, deltas.dtype)
    elif name == "alie":
        var = jnp.sum(benign[:, None] * jnp.where(present[:, None], (deltas - mu) ** 2, 0.0), axis=0) / nb
        k, m = jnp.sum(present).astype(deltas.dtype), jnp.sum(bad).astype(deltas.dtype)
        z = params["z"] if params["z"] > 0 else alie_z(k, m)
        new = jnp.broadcast_to(mu - z * jnp.sqrt(var), deltas.shape)
    elif name == "ipm":
        new = jnp.broadcast_to(-params["eps"] * mu, deltas.shape)
    else:
        raise ValueError(f"no update attack {name!r}; the update attacks: {', '.join(UPDATE_ATTACKS)}")
    return jnp.where(bad[:, None], new, deltas)


def with_update_attack(alg: Algorithm, name: str, malicious, key, **params) -> Algorithm:
    """``alg`` whose aggregate sees the malicious rows' updates of the shared parameters replaced by attack
    ``name`` (``attacked_updates`` over all shared leaves flattened per row). malicious: bool [N] over the
    population's client ids; key: the attack's key (round t uses fold_in(key, t)). ``alg`` must be an averaging
    algorithm (``Options.user_dp``): server state with ``"params"``, aggregate over the trained rows' shared
    ``"params"`` leaves (``share_mask``)."""
    if name not in UPDATE_ATTACKS:
        raise ValueError(f"no update attack {name!r}; the update attacks: {', '.join(UPDATE_ATTACKS)}")
    params = {**ATTACKS[name], **params}
    bad_ids = jnp.asarray(malicious, bool)
    n = bad_ids.shape[0]

    def aggregate(server, trained, weights, info):
        shared = alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])
        flat, rebuild = shared_updates(server["params"], trained["params"], shared)
        ids = jnp.asarray(info.client_id, jnp.int32)
        bad = jnp.where(ids < n, bad_ids[jnp.clip(ids, 0, n - 1)], False)
        new = attacked_updates(name, flat, bad, weights > 0, jax.random.fold_in(key, info.round), **params)
        return alg.aggregate(server, {**trained, "params": rebuild(new)}, weights, info)

    return alg._replace(aggregate=aggregate)
