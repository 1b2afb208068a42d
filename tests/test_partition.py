"""Partitions that always succeed: ``dirichlet`` with its repair, and the quantity-controlled
``dirichlet_quantity`` (client sizes first, then each client's labels from Dir(alpha p))."""
import time

import numpy as np
import pytest

from jaxfl.data.partition import (PARTITIONS, _repair, client_sizes, dirichlet, dirichlet_quantity, iid, label_shards,
                                  partition)
from jaxfl.errors import ConfigError, DataError


BIG = np.repeat(np.arange(10), 5000)  # 50,000 samples, 10 classes x 5,000
SMALL = np.repeat(np.arange(10), 50)  # 500 samples


def _check_partition(parts, n, n_clients, min_size):
    sizes = np.array([len(p) for p in parts])
    allidx = np.concatenate(parts)
    assert len(parts) == n_clients
    assert sizes.min() >= min_size
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))  # disjoint and covering
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    return sizes


def _top_share(parts, labels):
    """Mean over clients of the share of the client's most frequent class (1 = one class per client)."""
    return float(np.mean([np.bincount(labels[p]).max() / len(p) for p in parts if len(p)]))


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# ---- dirichlet: always a valid partition -------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_dirichlet_alpha01_1000_clients_always_succeeds(seed):
    t = time.perf_counter()
    parts = dirichlet(BIG, 1000, 0.1, np.random.default_rng(seed))
    elapsed = time.perf_counter() - t
    _check_partition(parts, 50000, 1000, 1)
    assert elapsed < 5.0  # ~0.15 s here: when none of the 100 draws gives every client a sample, one is repaired


def test_dirichlet_min_size_is_met_and_skew_survives():
    parts = dirichlet(BIG, 1000, 0.1, np.random.default_rng(7), min_size=20)
    sizes = _check_partition(parts, 50000, 1000, 20)
    assert sizes.max() > 60  # still unbalanced above the floor
    skewed = _top_share(parts, BIG)
    flat = _top_share(iid(BIG, 1000, np.random.default_rng(7)), BIG)
    assert flat < 0.35 and skewed > 0.6 and skewed > 2 * flat


def test_dirichlet_min_size_at_the_limit_gives_equal_sizes():
    # min_size * n_clients == n: every client gets exactly min_size, all by repair, skew still high
    parts = dirichlet(BIG, 1000, 0.1, np.random.default_rng(0), min_size=50)
    sizes = _check_partition(parts, 50000, 1000, 50)
    assert np.all(sizes == 50)
    assert _top_share(parts, BIG) > 0.6
    parts = dirichlet(SMALL, 20, 0.001, np.random.default_rng(0), min_size=25, max_retries=5)
    assert np.all(np.array([len(p) for p in parts]) == 25)
    _check_partition(parts, 500, 20, 25)


def test_dirichlet_deterministic_given_rng():
    a = dirichlet(BIG, 1000, 0.1, np.random.default_rng(11))
    assert _same(a, dirichlet(BIG, 1000, 0.1, np.random.default_rng(11)))
    assert not _same(a, dirichlet(BIG, 1000, 0.1, np.random.default_rng(12)))
    b = dirichlet(SMALL, 20, 0.5, np.random.default_rng(3), min_size=10, max_retries=0)  # repair at once
    assert _same(b, dirichlet(SMALL, 20, 0.5, np.random.default_rng(3), min_size=10, max_retries=0))
    _check_partition(b, 500, 20, 10)


def test_dirichlet_skew_grows_as_alpha_shrinks():
    shares = [_top_share(dirichlet(BIG, 100, a, np.random.default_rng(0)), BIG) for a in (100.0, 1.0, 0.1)]
    assert shares[0] < 0.2 < shares[1] < shares[2]
    assert shares[2] > 0.55


def test_dirichlet_bad_inputs():
    with pytest.raises(DataError, match="min_size=51 x num_clients=1000 exceeds the 50000 samples"):
        dirichlet(BIG, 1000, 0.1, np.random.default_rng(0), min_size=51)
    with pytest.raises(DataError, match="min_size=-1"):
        dirichlet(SMALL, 10, 0.1, np.random.default_rng(0), min_size=-1)
    with pytest.raises(ConfigError, match="dirichlet_alpha=-0.5"):
        dirichlet(SMALL, 10, -0.5, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="dirichlet_alpha=inf"):
        dirichlet(SMALL, 10, float("inf"), np.random.default_rng(0))


def test_repair_takes_from_the_largest_and_keeps_held_classes():
    # client 0 holds 15 of class 0 and 5 of class 1; client 1 holds nothing; client 2 holds 1 of class 1.
    counts = np.array([[15, 0, 0], [5, 0, 1]])
    out = _repair(counts.copy(), 3)
    # client 2 takes class 1 (which it holds), client 1 (empty) takes the donor's largest class
    assert out.tolist() == [[12, 3, 0], [3, 0, 3]]
    # the held class is gone at the donor: the receiver takes what the donor has
    out = _repair(np.array([[12, 0, 1], [0, 0, 3]]), 5)
    assert out.tolist() == [[6, 5, 2], [0, 0, 3]]
    # donors give down to a common level, the largest first: sizes 10, 8, 0 -> 7, 7, 4
    out = _repair(np.array([[10, 0, 0], [0, 8, 0]]), 4)
    assert out.sum(0).tolist() == [7, 7, 4] and out.sum() == 18
    # a tie at the level: the lower-index donor gives the extra unit (as one-at-a-time from the largest),
    # so the receiver gets one sample of its class 1 and the rest of class 0
    out = _repair(np.array([[10, 0, 0], [0, 10, 1]]), 4)
    assert out.tolist() == [[8, 0, 2], [0, 9, 2]]


# ---- client sizes and the quantity-controlled variant -----------------------------------------------

def test_client_sizes_equal_and_lognormal():
    s = client_sizes(1003, 10, np.random.default_rng(0))
    assert s.sum() == 1003 and s.max() - s.min() == 1 and sorted(set(s.tolist())) == [100, 101]
    cv = []
    for sigma in (0.0, 0.5, 1.0, 2.0):
        s = client_sizes(50000, 1000, np.random.default_rng(0), sizes="lognormal", sigma=sigma, min_size=5)
        assert s.sum() == 50000 and s.min() >= 5
        cv.append(s.std() / s.mean())
    assert cv[0] < 0.01 < cv[1] < cv[2] < cv[3]
    assert 0.4 < cv[1] < 0.65  # sd/mean of exp(N(0, 0.25)) is sqrt(e^0.25 - 1) = 0.53
    s = client_sizes(50000, 1000, np.random.default_rng(1), sizes="lognormal", sigma=2.0, min_size=40)
    assert s.sum() == 50000 and s.min() == 40 and s.max() > 500


def test_dirichlet_quantity_equal_sizes_are_exact():
    parts = dirichlet_quantity(BIG, 1000, 0.1, np.random.default_rng(0))
    sizes = _check_partition(parts, 50000, 1000, 1)
    assert np.all(sizes == 50)
    labels = np.repeat(np.arange(7), 143)  # 1001 samples over 10 clients
    sizes = _check_partition(dirichlet_quantity(labels, 10, 1.0, np.random.default_rng(0)), 1001, 10, 1)
    assert sizes.sum() == 1001 and sizes.max() - sizes.min() == 1


def test_dirichlet_quantity_lognormal_sizes():
    for seed in (0, 1):
        for sigma in (0.5, 1.5):
            rng_args = dict(sizes="lognormal", sigma=sigma, min_size=3)
            parts = dirichlet_quantity(BIG, 1000, 0.3, np.random.default_rng(seed), **rng_args)
            sizes = _check_partition(parts, 50000, 1000, 3)
            # the sizes are exactly the ones drawn first, from the same rng
            assert np.array_equal(sizes, client_sizes(50000, 1000, np.random.default_rng(seed), **rng_args))
    spread = [np.std([len(p) for p in dirichlet_quantity(BIG, 200, 0.3, np.random.default_rng(0),
                                                           sizes="lognormal", sigma=s)]) for s in (0.0, 0.5, 1.0)]
    assert spread[0] < 1 < spread[1] < spread[2]


def test_dirichlet_quantity_skew_grows_as_alpha_shrinks():
    shares = [_top_share(dirichlet_quantity(BIG, 1000, a, np.random.default_rng(0)), BIG)
              for a in (1000.0, 10.0, 1.0, 0.1)]
    assert shares[0] < 0.2 < shares[1] < shares[2] < shares[3]
    assert shares[3] > 0.85


def _quantity_reference(labels, n_clients, alpha, rng, **kw):
    """The documented algorithm, one client and one pass at a time (no batching)."""
    n = len(labels)
    s = client_sizes(n, n_clients, rng, **kw)
    classes, inv = np.unique(labels, return_inverse=True)
    pools = [list(rng.permutation(np.flatnonzero(inv == c))) for c in range(len(classes))]
    prior = np.array([len(p) for p in pools]) / n
    q = rng.dirichlet(alpha * prior, size=n_clients)
    counts = np.zeros((len(classes), n_clients), int)
    for i in rng.permutation(n_clients):
        need = int(s[i])
        while need:
            avail = np.array([len(p) for p in pools]) - counts.sum(1)
            w = np.where(avail > 0, q[i], 0.0)
            if not w.sum() > 0:
                w = np.where(avail > 0, prior, 0.0)
            share = need * w / w.sum()
            t = np.floor(share).astype(int)
            frac = np.where(avail > 0, share - t, -1.0)
            t[np.argsort(-frac, kind="stable")[: need - t.sum()]] += 1
            t = np.minimum(t, avail)
            counts[:, i] += t
            need -= int(t.sum())
    return counts


# (50.0, "equal", 100, 3): a pool empties exactly at one client's first pass, and the next clients must
# see it closed
@pytest.mark.parametrize("alpha,sizes,n_clients,seed", [(0.001, "equal", 150, 4), (0.1, "lognormal", 150, 4),
                                                        (1.0, "equal", 150, 4), (50.0, "lognormal", 150, 4),
                                                        (50.0, "equal", 100, 3)])
def test_dirichlet_quantity_matches_the_documented_algorithm(alpha, sizes, n_clients, seed):
    labels = np.repeat(np.arange(6), [400, 250, 150, 100, 60, 40])
    kw = dict(sizes=sizes, sigma=1.0)
    parts = dirichlet_quantity(labels, n_clients, alpha, np.random.default_rng(seed), **kw)
    want = _quantity_reference(labels, n_clients, alpha, np.random.default_rng(seed), **kw)
    got = np.array([np.bincount(labels[p], minlength=6) for p in parts]).T
    assert np.array_equal(got, want)


def test_dirichlet_quantity_follows_the_global_prior():
    # imbalanced classes (50/30/20 %), alpha large: every client's mix is close to the global one
    labels = np.repeat(np.arange(3), [5000, 3000, 2000])
    parts = dirichlet_quantity(labels, 20, 1e5, np.random.default_rng(0))
    mixes = np.array([np.bincount(labels[p], minlength=3) / len(p) for p in parts])
    assert np.abs(mixes - [0.5, 0.3, 0.2]).max() < 0.03


def test_dirichlet_quantity_deterministic_and_any_label_values():
    kw = dict(sizes="lognormal", sigma=1.0)
    a = dirichlet_quantity(BIG, 300, 0.5, np.random.default_rng(5), **kw)
    assert _same(a, dirichlet_quantity(BIG, 300, 0.5, np.random.default_rng(5), **kw))
    assert not _same(a, dirichlet_quantity(BIG, 300, 0.5, np.random.default_rng(6), **kw))
    labels = np.array([3, 42, 7])[np.arange(600) % 3]
    _check_partition(dirichlet_quantity(labels, 12, 0.2, np.random.default_rng(0)), 600, 12, 1)
    _check_partition(dirichlet(labels, 12, 0.2, np.random.default_rng(0), min_size=5), 600, 12, 5)


def test_dirichlet_quantity_bad_inputs():
    rng = np.random.default_rng(0)
    for alpha in (0.0, -1.0, float("inf")):
        with pytest.raises(DataError, match=f"dirichlet_alpha={alpha!r}"):
            dirichlet_quantity(SMALL, 10, alpha, rng)
    with pytest.raises(DataError, match="sigma=-0.5"):
        dirichlet_quantity(SMALL, 10, 0.5, rng, sizes="lognormal", sigma=-0.5)
    with pytest.raises(DataError, match="unknown client sizes 'zipf'; valid: equal, lognormal"):
        dirichlet_quantity(SMALL, 10, 0.5, rng, sizes="zipf")
    with pytest.raises(DataError, match="min_size=60 x num_clients=10 exceeds the 500 samples"):
        dirichlet_quantity(SMALL, 10, 0.5, rng, min_size=60)
    with pytest.raises(DataError, match="num_clients=501"):
        dirichlet_quantity(SMALL, 501, 0.5, rng)


# ---- dispatch -----------------------------------------------------------------------------------------

def test_partition_dispatch():
    assert "dirichlet_quantity" in PARTITIONS
    got = partition("dirichlet_quantity", BIG, 100, np.random.default_rng(2), alpha=0.3, sizes="lognormal",
                    sigma=0.8, min_size=5)
    want = dirichlet_quantity(BIG, 100, 0.3, np.random.default_rng(2), sizes="lognormal", sigma=0.8, min_size=5)
    assert _same(got, want)
    # the existing call sites keep working, and the new keywords do not change the other kinds
    got = partition("dirichlet", SMALL, 20, np.random.default_rng(0), alpha=0.1, classes_per_client=2)
    assert _same(got, dirichlet(SMALL, 20, 0.1, np.random.default_rng(0)))
    assert _same(partition("dirichlet", SMALL, 20, np.random.default_rng(0), alpha=0.1, sizes="lognormal"), got)
    assert len(partition("shards", SMALL, 10, np.random.default_rng(0), classes_per_client=2)) == 10
    with pytest.raises(ConfigError, match="dirichlet_quantity"):
        partition("quantity", SMALL, 10, np.random.default_rng(0))


# ---- label shards (McMahan et al.'s pathological non-IID split) ----------------------------------------

def test_label_shards_sorted_shards_two_per_client():
    labels = np.array([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])  # 12 samples, 3 classes x 4
    parts = label_shards(labels, 3, 2, np.random.default_rng(0))
    # sorted by label (ties by index): 0: [1 3 7 9], 1: [2 5 6 10], 2: [0 4 8 11]; 6 shards of 2
    shards_ = [[1, 3], [7, 9], [2, 5], [6, 10], [0, 4], [8, 11]]
    perm = np.random.default_rng(0).permutation(6).reshape(3, 2)
    want = [sorted(shards_[a] + shards_[b]) for a, b in perm]
    assert [p.tolist() for p in parts] == want
    _check_partition(parts, 12, 3, 4)


def test_label_shards_mnist_sized_split():
    labels = np.repeat(np.arange(10), 6000)  # 60,000 samples, 100 clients x 2 shards of 300
    parts = label_shards(labels, 100, 2, np.random.default_rng(1))
    sizes = _check_partition(parts, 60000, 100, 600)
    assert np.all(sizes == 600)
    n_classes = np.array([len(np.unique(labels[p])) for p in parts])
    assert n_classes.max() == 2 and n_classes.min() == 1  # each shard holds one class (6000 = 20 x 300)
    assert _same(parts, label_shards(labels, 100, 2, np.random.default_rng(1)))
    assert not _same(parts, label_shards(labels, 100, 2, np.random.default_rng(2)))


def test_label_shards_drops_the_remainder_and_checks_inputs():
    parts = label_shards(np.arange(7) % 2, 3, 1, np.random.default_rng(0))  # 3 shards of 2, one sample left
    assert sorted(len(p) for p in parts) == [2, 2, 2]
    assert len(np.unique(np.concatenate(parts))) == 6
    with pytest.raises(DataError, match="shards_per_client=0"):
        label_shards(SMALL, 10, 0, np.random.default_rng(0))
    with pytest.raises(DataError, match="1002 shards is more than the 500 samples"):
        label_shards(SMALL, 501, 2, np.random.default_rng(0))
