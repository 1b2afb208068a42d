"""Seeded partitioners: labels -> one index array per client. Pure numpy; every function takes an explicit
``numpy.random.Generator``.
"""
from __future__ import annotations

import numpy as np

from ..errors import DataError, check_range


def _check_counts(n_samples: int, n_clients: int) -> None:
    if n_clients < 1:
        raise DataError(f"num_clients={n_clients} must be at least 1")
    if n_clients > n_samples:
        raise DataError(f"num_clients={n_clients} is more than the {n_samples} samples available; "
                        f"use at most {n_samples} clients")


def iid(labels, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and split into ``n_clients`` parts whose sizes differ by at most one."""
    labels = np.asarray(labels)
    _check_counts(len(labels), n_clients)
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), n_clients)]


def dirichlet(labels, n_clients: int, alpha: float, rng: np.random.Generator, *, min_size: int = 1,
              max_retries: int = 100) -> list[np.ndarray]:
    """Label skew: for each class c, its samples are split among clients in proportions q_c ~ Dir(alpha 1_N).

    Draws again (at most ``max_retries`` times) until every client has at least ``min_size`` samples, then
    raises DataError. Cost O(C * N) per draw, so 1000 clients take milliseconds.
    """
    labels = np.asarray(labels)
    _check_counts(len(labels), n_clients)
    check_range("dirichlet_alpha", alpha, 0.0, float("inf"), lo_open=True)
    if min_size * n_clients > len(labels):
        raise DataError(f"min_size={min_size} x num_clients={n_clients} exceeds the {len(labels)} samples")
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    for _ in range(max_retries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for idx in by_class:
            q = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise DataError(f"dirichlet partition with alpha={alpha} gave a client fewer than min_size={min_size} "
                    f"samples in {max_retries} draws; raise alpha, lower num_clients={n_clients} or min_size")


def shards(labels, n_clients: int, classes_per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological label skew: every client holds exactly ``classes_per_client`` distinct classes.

    Client i takes class i mod C first (so every class is used when N >= C), then k-1 other distinct
    classes at random; each class's samples are split evenly at random among the clients holding it.
    """
    labels = np.asarray(labels)
    _check_counts(len(labels), n_clients)
    classes = np.unique(labels)
    n_cls = len(classes)
    if not 1 <= classes_per_client <= n_cls:
        raise DataError(f"classes_per_client={classes_per_client} must be in [1, {n_cls}] "
                        f"(the number of classes)")
    held = []
    for i in range(n_clients):
        first = classes[i % n_cls]
        others = rng.choice(classes[classes != first], classes_per_client - 1, replace=False)
        held.append(np.concatenate([[first], others]))
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in classes:
        owners = [i for i in range(n_clients) if c in held[i]]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(owners):
            raise DataError(f"class {c} has {len(idx)} samples for {len(owners)} clients; "
                            f"use fewer clients or more classes_per_client")
        for i, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def split_like(train_parts, train_labels, test_labels, rng: np.random.Generator) -> list[np.ndarray]:
    """Split a test set so each client's test label mix follows its training label mix.

    For every class c, the test samples of c go to the clients in proportion to how many training samples
    of c they hold (largest-remainder rounding); a class no client trains on is dropped.
    """
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    n = len(train_parts)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in np.unique(test_labels):
        have = np.array([np.sum(train_labels[p] == c) for p in train_parts], float)
        if have.sum() == 0:
            continue
        idx = rng.permutation(np.flatnonzero(test_labels == c))
        share = have / have.sum() * len(idx)
        take = np.floor(share).astype(int)
        rest = len(idx) - take.sum()
        take[np.argsort(-(share - take), kind="stable")[:rest]] += 1
        for i, chunk in enumerate(np.split(idx, np.cumsum(take)[:-1])):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, int) for p in parts]


PARTITIONS = ("iid", "dirichlet", "shards")


def partition(kind: str, labels, n_clients: int, rng: np.random.Generator, *, alpha: float = 0.5,
              classes_per_client: int = 2, min_size: int = 1) -> list[np.ndarray]:
    """Dispatch to ``iid``, ``dirichlet`` or ``shards`` by name."""
    from ..errors import check_choice
    check_choice("partition", kind, PARTITIONS)
    if kind == "iid":
        return iid(labels, n_clients, rng)
    if kind == "dirichlet":
        return dirichlet(labels, n_clients, alpha, rng, min_size=min_size)
    return shards(labels, n_clients, classes_per_client, rng)
