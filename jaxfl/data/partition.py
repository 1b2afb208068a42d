"""Seeded partitioners: labels -> one index array per client. Pure numpy; every function takes an explicit
``numpy.random.Generator``.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, DataError, check_range


def _check_counts(n_samples: int, n_clients: int) -> None:
    if n_clients < 1:
        raise DataError(f"num_clients={n_clients} must be at least 1")
    if n_clients > n_samples:
        raise DataError(f"num_clients={n_clients} (--num-clients) is more than the {n_samples} samples available; "
                        f"use at most {n_samples} clients")


def _check_min_size(min_size: int, n_clients: int, n_samples: int) -> None:
    if min_size < 0:
        raise DataError(f"min_size={min_size} must be >= 0")
    if min_size * n_clients > n_samples:
        raise DataError(f"min_size={min_size} x num_clients={n_clients} exceeds the {n_samples} samples")


def _parts_from_counts(by_class, counts: np.ndarray) -> list[np.ndarray]:
    """counts[c, i] samples of class c to client i, taken in order from the (shuffled) pool ``by_class[c]``.

    Returns each client's indices sorted; every pool index is assigned exactly once.
    """
    n_clients = counts.shape[1]
    if (counts < 0).any() or not np.array_equal(counts.sum(1), [len(p) for p in by_class]):
        raise RuntimeError("internal error: partition counts do not match the class sizes")
    idx = np.concatenate(by_class)
    owner = np.concatenate([np.repeat(np.arange(n_clients), k) for k in counts])
    order = np.lexsort((idx, owner))  # by client, then by sample index
    return np.split(idx[order], np.cumsum(np.bincount(owner, minlength=n_clients))[:-1])


def _round_rows(share: np.ndarray, total, allowed: np.ndarray | None = None) -> np.ndarray:
    """Largest-remainder rounding of each row of ``share`` [B, K] (>= 0) to integers summing to ``total`` [B].

    Units left over go to the largest fractional parts of the row (ties: lower index), among the
    ``allowed`` [K] entries only; a unit too many (float error only) comes off the row's largest entry.
    """
    share = np.atleast_2d(share)
    total = np.broadcast_to(np.asarray(total, np.int64), share.shape[:1])
    t = np.floor(share).astype(np.int64)
    frac = share - t
    n_ok = share.shape[1]
    if allowed is not None:
        frac = np.where(allowed, frac, -1.0)
        n_ok = int(np.count_nonzero(allowed))
    order = np.argsort(-frac, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(share.shape[1]), order.shape), axis=1)
    rest = total - t.sum(1)
    t += rank < np.clip(rest, 0, n_ok)[:, None]
    for b in np.flatnonzero((rest < 0) | (rest > n_ok)):  # float error only
        while t[b].sum() < total[b] and n_ok:
            t[b, order[b, : min(n_ok, total[b] - t[b].sum())]] += 1
        while t[b].sum() > total[b]:
            t[b, int(np.argmax(t[b]))] -= 1
    return t


def _repair(counts: np.ndarray, min_size: int) -> np.ndarray:
    """Lift every client of ``counts`` [C, N] to ``min_size`` samples, in place, deterministically.

    The samples come from the clients that hold the most: donors give down to a common level L (the
    largest with enough above it; a few give one less so the total is exact), the same as taking one
    sample at a time from the currently largest client, and never below ``min_size``. Receivers (clients
    below ``min_size``, in index order) take, while they lack samples, the class they already hold most of
    from the donor that can give the most of it; a receiver that holds no class, or none a donor can still
    give, takes the largest class of the donor with the most left to give. So label mixes change as
    little as possible. Needs sum(counts) >= min_size * N. Cost O(N log n + steps * (N + C)), steps <=
    receivers + donors + C * donors.
    """
    size = counts.sum(0)
    lack = np.maximum(min_size - size, 0)
    deficit = int(lack.sum())
    if deficit == 0:
        return counts
    lo, hi = min_size, int(size.max())  # largest L with sum(max(size - L, 0)) >= deficit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.maximum(size - mid, 0).sum()) >= deficit:
            lo = mid
        else:
            hi = mid - 1
    supply = np.maximum(size - lo, 0)
    extra = int(supply.sum()) - deficit  # < the number of donors, each of which is above L
    if extra:
        supply[np.flatnonzero(supply)[-extra:]] -= 1
    for r in np.flatnonzero(lack):
        need = int(lack[r])
        while need > 0:
            for c in np.argsort(-counts[:, r], kind="stable")[: np.count_nonzero(counts[:, r])]:
                can = np.minimum(counts[c], supply)  # what each donor can give of class c
                j = int(np.argmax(can))
                if can[j] > 0:
                    break
            else:
                j = int(np.argmax(supply))
                c = int(np.argmax(counts[:, j]))
            t = min(need, int(counts[c, j]), int(supply[j]))
            counts[c, j] -= t
            counts[c, r] += t
            supply[j] -= t
            need -= t
    return counts


def iid(labels, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and split into ``n_clients`` parts whose sizes differ by at most one."""
    labels = np.asarray(labels)
    _check_counts(len(labels), n_clients)
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), n_clients)]


def dirichlet(labels, n_clients: int, alpha: float, rng: np.random.Generator, *, min_size: int = 1,
              max_retries: int = 100) -> list[np.ndarray]:
    """Label skew: for each class c, its samples are split among clients in proportions q_c ~ Dir(alpha 1_N).

    Client i gets floor(n_c * sum_{j<=i} q_cj) - floor(n_c * sum_{j<i} q_cj) samples of class c (a random
    subset). The split is drawn again, at most ``max_retries`` draws in all (at least one), until every client
    has at least ``min_size`` samples (rejection sampling, as in the literature); a draw that qualifies gives
    the same partition as before the repair existed. If none does, the draw that lacks the fewest samples is
    repaired: each client below ``min_size`` takes what it lacks from the clients that hold the most samples,
    preferring a class it already holds, so the label skew is kept (see ``_repair``).
    So it always succeeds when ``min_size * n_clients <= len(labels)`` (else DataError), and the result is a
    function of the rng's state. Cost O(C * N) per draw plus the repair: 1,000 clients x 50,000 samples
    (10 classes) with alpha 0.1 take about 0.15 s, nearly all of it the 100 draws that fail.
    """
    labels = np.asarray(labels)
    _check_counts(len(labels), n_clients)
    check_range("dirichlet_alpha", alpha, 0.0, float("inf"), lo_open=True)
    if not math.isfinite(alpha):
        raise ConfigError(f"dirichlet_alpha={alpha!r} must be finite")
    _check_min_size(min_size, n_clients, len(labels))
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    n_c = np.array([len(idx) for idx in by_class])
    best, best_lack = None, None
    for _ in range(max(1, max_retries)):
        q = rng.dirichlet(np.full(n_clients, float(alpha)), size=len(by_class))  # [C, N]
        bad = ~np.all(np.isfinite(q), axis=1) | ~(q.sum(1) > 0)
        for c in np.flatnonzero(bad):  # a degenerate draw (NaN or all zero): the class goes to one client
            q[c] = 0.0
            q[c, rng.integers(n_clients)] = 1.0
        cuts = np.clip((np.cumsum(q, axis=1)[:, :-1] * n_c[:, None]).astype(np.int64), 0, n_c[:, None])
        counts = np.diff(np.concatenate([np.zeros((len(n_c), 1), np.int64), cuts, n_c[:, None]], axis=1), axis=1)
        lack = int(np.maximum(min_size - counts.sum(0), 0).sum())
        if best_lack is None or lack < best_lack:
            best, best_lack = counts, lack
        if lack == 0:
            break
    return _parts_from_counts(by_class, _repair(best, min_size))


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


def label_shards(labels, n_clients: int, shards_per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al.'s (2017) pathological non-IID split: sort the samples by label (ties by index), cut the
    sorted order into ``n_clients * shards_per_client`` shards of equal size, and give each client
    ``shards_per_client`` of them drawn at random without replacement (``rng.permutation`` of the shard ids,
    client i taking positions i*s .. i*s + s - 1). MNIST with 100 clients and 2 shards each: 200 shards of 300
    samples, most clients holding two digits. Samples past the last whole shard (n mod shards) go to nobody.
    """
    labels = np.asarray(labels)
    n_shards = n_clients * shards_per_client
    if n_clients < 1 or shards_per_client < 1:
        raise DataError(f"num_clients={n_clients} and shards_per_client={shards_per_client} must be at least 1")
    if n_shards > len(labels):
        raise DataError(f"{n_clients} clients x {shards_per_client} shards = {n_shards} shards is more than the "
                        f"{len(labels)} samples available")
    size = len(labels) // n_shards
    order = np.argsort(labels, kind="stable")[: n_shards * size].reshape(n_shards, size)
    assigned = rng.permutation(n_shards).reshape(n_clients, shards_per_client)
    return [np.sort(order[s].ravel()) for s in assigned]


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


def _first_pass(q: np.ndarray, need: np.ndarray, prior: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """Counts [B, C] that clients with label mixes ``q`` [B, C] and sizes ``need`` [B] ask of the open pools:
    need * q renormalised over the open classes (``prior`` [C] instead where q is 0 on all of them),
    rounded by largest remainder."""
    w = np.where(open_, q, 0.0)
    dead = ~(w.sum(1) > 0)
    w[dead] = np.where(open_, prior, 0.0)
    tot = w.sum(1, keepdims=True)  # 0 only once every pool is empty, and then need is 0
    share = np.divide(need[:, None] * w, tot, out=np.zeros_like(w), where=tot > 0)
    return _round_rows(share, need, open_)


def _fill_one(q: np.ndarray, need: int, prior: np.ndarray, avail: np.ndarray) -> np.ndarray:
    """One client's counts [C], taken from ``avail`` (updated in place): ask as in ``_first_pass``, take
    what the pools hold, and ask again for the rest over the pools still open."""
    got = np.zeros(len(avail), np.int64)
    for _ in range(len(avail) + 1):  # each pass fills the client or empties at least one pool
        if need == 0:
            break
        open_ = avail > 0
        t = np.minimum(_first_pass(q[None], np.array([need]), prior, open_)[0], avail)
        got += t
        avail -= t
        need -= int(t.sum())
    while need > 0:  # only if rounding went astray: take from the largest pools
        c = int(np.argmax(avail))
        t = min(need, int(avail[c]))
        got[c] += t
        avail[c] -= t
        need -= t
    return got


CLIENT_SIZES = ("equal", "lognormal")


def client_sizes(n_samples: int, n_clients: int, rng: np.random.Generator, *, sizes: str = "equal",
                 sigma: float = 0.5, min_size: int = 1) -> np.ndarray:
    """Client sizes s [N] that sum to ``n_samples``, each >= ``min_size``: equal or log-normal.

    ``equal``: s_i = floor(n / N), plus one for the first n mod N clients (no randomness used).
    ``lognormal``: w_i = exp(z_i), z_i ~ N(0, sigma^2); s_i proportional to w_i, i.e. s_i = n w_i / sum w,
    except that a client whose share falls below ``min_size`` is held at ``min_size`` and the rest is
    shared in proportion to w over the other clients (repeated until none falls below); the real shares are
    then rounded by largest remainder. sigma = 0 gives equal sizes (up to which clients get the remainder).
    """
    _check_counts(n_samples, n_clients)
    if sizes not in CLIENT_SIZES:
        raise DataError(f"unknown client sizes {sizes!r}; valid: {', '.join(CLIENT_SIZES)}")
    if not (isinstance(sigma, (int, float, np.number)) and math.isfinite(sigma) and sigma >= 0):
        raise DataError(f"sigma={sigma!r} must be a finite number >= 0 (log-normal client sizes)")
    _check_min_size(min_size, n_clients, n_samples)
    if sizes == "equal":
        s = np.full(n_clients, n_samples // n_clients, np.int64)
        s[: n_samples % n_clients] += 1
        return s
    z = rng.normal(0.0, float(sigma), n_clients)
    w = np.exp(z - z.max())
    held = np.zeros(n_clients, bool)
    while True:
        share = np.where(held, float(min_size),
                         (n_samples - min_size * held.sum()) * w / w[~held].sum())
        low = ~held & (share < min_size)
        if not low.any():  # some client always stays free, as min_size * N <= n
            break
        held |= low
    return _round_rows(share[None], n_samples)[0]


def dirichlet_quantity(labels, n_clients: int, alpha: float, rng: np.random.Generator, *,
                       sizes: str = "equal", sigma: float = 0.5, min_size: int = 1) -> list[np.ndarray]:
    """Quantity-controlled label skew: client sizes first, then each client's labels q_i ~ Dir(alpha p).

    1. Sizes s_i from ``client_sizes`` (``sizes="equal"``: differ by at most one; ``"lognormal"``:
       s_i proportional to exp(N(0, sigma^2)), each >= ``min_size``); they sum to all the samples.
    2. Label mix q_i ~ Dir(alpha * p) for every client, p_c = n_c / n the global class frequency (Hsu et
       al. 2019, "Measuring the effects of non-identical data distribution"; FedLab's balanced/unbalanced
       Dirichlet partitions). ``alpha`` is the total concentration: alpha -> 0 gives one class per client,
       alpha -> inf gives every client the global mix p. With C balanced classes Dir(alpha p) is
       Dir(alpha / C) per class, so the same alpha is more skewed here than in ``dirichlet``.
    3. Clients, in a random order, fill greedily without replacement from shuffled per-class pools: client
       i asks for s_i q_ic samples of class c (largest-remainder rounding over the classes still open);
       when a pool runs out, it takes what is left of it and the remainder of s_i is asked again with q_i
       renormalised over the classes that remain (p renormalised over them if q_i is 0 on all of them).
    Every sample is assigned exactly once and client i gets exactly s_i samples. DataError for alpha <= 0,
    sigma < 0, an unknown ``sizes``, or min_size * n_clients > n. Cost O(N C^2) at worst.
    """
    labels = np.asarray(labels)
    n = len(labels)
    _check_counts(n, n_clients)
    if not (isinstance(alpha, (int, float, np.number)) and math.isfinite(alpha) and alpha > 0):
        raise DataError(f"dirichlet_alpha={alpha!r} must be a finite number > 0")
    s = client_sizes(n, n_clients, rng, sizes=sizes, sigma=sigma, min_size=min_size)
    classes, inv = np.unique(labels, return_inverse=True)
    pools = [rng.permutation(np.flatnonzero(inv == c)) for c in range(len(classes))]
    avail = np.array([len(p) for p in pools], np.int64)
    prior = avail / n
    q = rng.dirichlet(float(alpha) * prior, size=n_clients)  # [N, C]
    q[~np.isfinite(q)] = 0.0
    counts = np.zeros((len(classes), n_clients), np.int64)
    order = rng.permutation(n_clients)
    pos = 0
    while pos < n_clients:
        # First pass of every client left, as if no pool ran out: exact up to the first client whose pass
        # empties a pool (kept) or asks for more than a pool holds (filled by _fill_one, which renormalises).
        open_ = avail > 0
        rows = order[pos:]
        t = _first_pass(q[rows], s[rows], prior, open_)
        cum = np.cumsum(t, axis=0)
        hit = np.flatnonzero(((cum >= avail) & open_).any(1))
        h = int(hit[0]) if len(hit) else len(rows)
        over = h < len(rows) and bool((cum[h] > avail).any())
        k = h if over or h == len(rows) else h + 1
        counts[:, rows[:k]] = t[:k].T
        avail -= t[:k].sum(0)
        pos += k
        if over:
            counts[:, rows[h]] = _fill_one(q[rows[h]], int(s[rows[h]]), prior, avail)
            pos += 1
    return _parts_from_counts(pools, counts)


PARTITIONS = ("iid", "dirichlet", "shards", "dirichlet_quantity")


def partition(kind: str, labels, n_clients: int, rng: np.random.Generator, *, alpha: float = 0.5,
              classes_per_client: int = 2, min_size: int = 1, sizes: str = "equal",
              sigma: float = 0.5) -> list[np.ndarray]:
    """Dispatch to ``iid``, ``dirichlet``, ``shards`` or ``dirichlet_quantity`` by name.

    ``sizes`` and ``sigma`` (client sizes: equal | lognormal, and its sigma) apply to ``dirichlet_quantity``
    only; ``alpha`` to both Dirichlet kinds, ``min_size`` too; ``classes_per_client`` to ``shards``.
    """
    from ..errors import check_choice
    check_choice("partition", kind, PARTITIONS)
    if kind == "iid":
        return iid(labels, n_clients, rng)
    if kind == "dirichlet":
        return dirichlet(labels, n_clients, alpha, rng, min_size=min_size)
    if kind == "dirichlet_quantity":
        return dirichlet_quantity(labels, n_clients, alpha, rng, sizes=sizes, sigma=sigma, min_size=min_size)
    return shards(labels, n_clients, classes_per_client, rng)
