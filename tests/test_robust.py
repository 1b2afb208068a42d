"""jaxfl.ops.robust against plain-NumPy transcriptions of each rule's definition, with padding rows (holding
NaN and huge values) that must change nothing, under jit and vmap."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfl.ops import robust

N, D, K = 9, 5, 7  # rows, coordinates, present rows (the last two are padding)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    x[K:] = np.nan  # padding rows hold garbage
    x[K - 1, 0] = 50.0 + seed  # a Byzantine-looking present row
    present = np.arange(N) < K
    return x, present


def np_median(x):
    return np.median(x, axis=0)


def np_trimmed(x, beta):
    k = len(x)
    b = int(np.floor(beta * k))
    s = np.sort(x, axis=0)
    return s[b:k - b].mean(axis=0)


def np_krum_scores(x, f):
    k = len(x)
    q = max(k - f - 2, 1)
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    return np.array([np.sort(np.delete(d[i], i))[:q].sum() for i in range(k)])


def np_geomed(x, iters=200):
    z = x.mean(0)
    for _ in range(iters):
        b = 1.0 / np.maximum(np.linalg.norm(x - z, axis=1), 1e-6)
        z = (b[:, None] * x).sum(0) / b.sum()
    return z


@pytest.mark.parametrize("seed", [0, 1])
def test_median_and_trimmed_mean_are_their_definitions_on_the_present_rows(seed):
    x, present = problem(seed)
    real = x[:K].astype(np.float64)
    median = jax.jit(robust.coordinate_median)(x, present)
    np.testing.assert_allclose(median, np_median(real), rtol=1e-6, atol=1e-6)
    for beta in (0.0, 0.15, 0.3):
        got = jax.jit(robust.trimmed_mean, static_argnums=2)(x, present, beta)
        np.testing.assert_allclose(got, np_trimmed(real, beta), rtol=1e-5, atol=1e-5)
    # an even number of present rows: the mean of the two middle values
    even = present & (np.arange(N) < K - 1)
    np.testing.assert_allclose(robust.coordinate_median(x, even), np.median(real[:K - 1], axis=0), rtol=1e-6)
    # the outlier moves the plain mean far, the median and the trimmed mean little
    assert abs(real[:, 0].mean() - np.median(real[:, 0])) > 5 and abs(float(median[0])) < 2


def test_kth_smallest_is_exact_and_ties_are_kept_whole():
    # radix selection over the float order: negatives, zeros, infinities, every rank; absent rows ignored
    rng = np.random.default_rng(5)
    x = rng.normal(size=(12, 6)).astype(np.float32) * 10
    x[0, 0], x[1, 1], x[2, 2], x[3, 3] = -np.inf, np.inf, -0.0, 0.0
    x[10:] = np.nan  # absent
    present = np.arange(12) < 10
    real = np.sort(x[:10], axis=0)
    for r in range(10):
        np.testing.assert_array_equal(jax.jit(robust.kth_smallest)(x, present, r), real[r])
    # near the top, by passes down from the largest: the same values (infinities, zeros and absent rows as above)
    top = jax.jit(robust.kth_largest_near_top, static_argnums=3)
    for t in range(4):
        np.testing.assert_array_equal(top(x, present, t, 4), real[9 - t])
    # many ties (small integers): median and trimmed mean still the definitions
    ties = rng.integers(-3, 4, size=(11, 40)).astype(np.float32)
    ones = np.ones(11, bool)
    np.testing.assert_array_equal(robust.coordinate_median(ties, ones), np.median(ties, axis=0))
    np.testing.assert_array_equal(robust.coordinate_median(ties[:10], ones[:10]), np.median(ties[:10], axis=0))
    for t in range(5):  # ties kept whole: the t-th largest of the sorted column, whatever repeats above it
        np.testing.assert_array_equal(top(ties, ones, t, 5), np.sort(ties, axis=0)[10 - t])
    # under vmap over problems, t per problem
    batch = jax.vmap(robust.kth_largest_near_top, in_axes=(0, None, 0, None))(jnp.stack([ties, -ties]), ones,
                                                                              jnp.array([1, 3]), 4)
    np.testing.assert_array_equal(batch, np.stack([np.sort(ties, axis=0)[9], np.sort(-ties, axis=0)[7]]))
    for beta in (0.1, 0.2, 0.45):
        np.testing.assert_allclose(robust.trimmed_mean(ties, ones, beta), np_trimmed(ties.astype(np.float64), beta),
                                   rtol=1e-6, atol=1e-6)


def test_krum_scores_and_multi_krum_select_the_central_rows():
    x, present = problem()
    real = x[:K].astype(np.float64)
    for f in (0, 1, 2):
        scores = jax.jit(robust.krum_scores, static_argnums=2)(x, present, f)
        np.testing.assert_allclose(scores[:K], np_krum_scores(real, f), rtol=1e-4)
        assert np.all(np.isinf(scores[K:]))
    scores = np_krum_scores(real, 1)
    agg, selected = jax.jit(robust.multi_krum, static_argnums=(2, 3))(x, present, 1, 3)
    best3 = np.argsort(scores, kind="stable")[:3]
    np.testing.assert_array_equal(np.flatnonzero(selected), np.sort(best3))
    np.testing.assert_allclose(agg, real[best3].mean(0), rtol=1e-5, atol=1e-6)
    assert not selected[K - 1]  # the outlier is never picked
    krum, one = robust.multi_krum(x, present, 1)
    np.testing.assert_allclose(krum, real[np.argmin(scores)], rtol=1e-6)
    assert int(one.sum()) == 1


def np_bulyan(x, f):
    k = len(x)
    theta, left, chosen = max(k - 2 * f, 1), list(range(k)), []
    for _ in range(theta):
        sub = x[left]
        scores = np_krum_scores(sub, f)
        best = left[int(np.argmin(scores))]
        chosen.append(best)
        left.remove(best)
    sel = x[sorted(chosen)]
    beta = max(theta - 2 * f, 1)
    med = np.median(sel, axis=0)
    order = np.argsort(np.abs(sel - med), axis=0, kind="stable")[:beta]
    return np.take_along_axis(sel, order, axis=0).mean(0), sorted(chosen)


@pytest.mark.parametrize("f", [0, 1])
def test_bulyan_is_its_definition_on_the_present_rows(f):
    x, present = problem(2)
    real = x[:K].astype(np.float64)
    agg, selected = jax.jit(robust.bulyan, static_argnums=2)(x, present, f)
    want, chosen = np_bulyan(real, f)
    np.testing.assert_array_equal(np.flatnonzero(selected), chosen)
    np.testing.assert_allclose(agg, want, rtol=1e-5, atol=1e-6)
    if f:  # one attacker assumed: the outlier row is left out and does not move the aggregate
        assert not selected[K - 1] and abs(float(agg[0])) < 5


def test_geometric_median_norm_bound_and_centered_clip():
    x, present = problem()
    real = x[:K].astype(np.float64)
    gm = jax.jit(robust.geometric_median, static_argnames="iters")(x, present, iters=200)
    np.testing.assert_allclose(gm, np_geomed(real), rtol=1e-3, atol=1e-3)
    # the geometric median minimises the sum of distances: any nudge increases it
    cost = lambda z: np.linalg.norm(real - z, axis=1).sum()
    assert all(cost(np.asarray(gm)) <= cost(np.asarray(gm) + e) + 1e-4 for e in 0.01 * np.eye(D))
    w = np.linspace(1, 2, N).astype(np.float32)
    bound = 1.0
    got = robust.norm_bounded_mean(x, present, bound, w)
    clipped = real * np.minimum(1, bound / np.linalg.norm(real, axis=1))[:, None]
    np.testing.assert_allclose(got, (w[:K, None] * clipped).sum(0) / w[:K].sum(), rtol=1e-5, atol=1e-6)
    tau, v = 0.5, np.zeros(D)
    for _ in range(3):
        d = real - v
        v = v + (d * np.minimum(1, tau / np.linalg.norm(d, axis=1))[:, None]).mean(0)
    np.testing.assert_allclose(robust.centered_clip(x, present, tau, iters=3), v, rtol=1e-5, atol=1e-6)
    # a huge tau is the plain mean after one step from 0
    np.testing.assert_allclose(robust.centered_clip(x, present, 1e9), real.mean(0), rtol=1e-5, atol=1e-6)


def test_vmap_over_problems_and_trees():
    xs, ps = zip(*(problem(s) for s in range(3)))
    xs, ps = jnp.stack(xs), jnp.stack(ps)
    batched = jax.vmap(robust.coordinate_median)(xs, ps)
    for i in range(3):
        np.testing.assert_allclose(batched[i], robust.coordinate_median(xs[i], ps[i]), rtol=1e-6)
    # a pytree of stacked leaves: one flattened update per row, the result shaped like a row
    x, present = problem()
    tree = {"w": jnp.asarray(x[:, :3]).reshape(N, 3, 1), "b": jnp.asarray(x[:, 3:])}
    out = robust.tree_robust(robust.coordinate_median, tree, present)
    assert out["w"].shape == (3, 1) and out["b"].shape == (2,)
    np.testing.assert_allclose(jnp.concatenate([out["w"].ravel(), out["b"]]),
                               robust.coordinate_median(jnp.concatenate([x[:, :3], x[:, 3:]], 1), present), rtol=1e-6)
    agg, selected = robust.tree_robust(robust.multi_krum, tree, present, 1, 2)
    assert agg["b"].shape == (2,) and int(selected.sum()) == 2
