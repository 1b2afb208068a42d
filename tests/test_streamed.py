"""The streamed backend: the population on the host, each cohort's samples sent as one flat store and trained in
one jitted call. It gives the stacked backend's numbers (up to float reassociation), compiles one program per
store size chosen up front (and one more for each rare cohort past it), and keeps the states in a device or
host store."""
import jax
import numpy as np
import pytest
from conftest import assert_trees_close, bit_identity, make_trainer, traces

from jaxfl.algorithms import build_algorithm
from jaxfl.core.backends import Stacked, Streamed, cohort_sample_index
from jaxfl.core.buckets import cohort_samples_bound, grid_ceil
from jaxfl.core.cohort import Chunked
from jaxfl.data.ragged import RaggedClients
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn

ROOT = jax.random.key(5)


def population(counts, seed=0):
    rng = np.random.default_rng(seed)
    return RaggedClients.from_clients([(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
                                        rng.integers(0, 4, n).astype(np.int32)) for n in counts])


def algorithm(name):
    return build_algorithm(name, small_cnn(num_classes=4, width=4), make_trainer())


def run(cls, alg, data, rounds, **kw):
    engine = cls(alg, data, batch_size=8, num_rounds=rounds, **kw)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    ms = []
    for r in range(rounds):
        server, m = engine.round(server, store, r, ROOT)
        ms.append(m)
    return server, store, ms, engine


def test_the_cohorts_samples_are_gathered_client_after_client():
    data = population([3, 0, 5, 2])
    idx = cohort_sample_index(data, np.array([2, 0, 1, 3]))
    np.testing.assert_array_equal(idx, [3, 4, 5, 6, 7, 0, 1, 2, 8, 9])
    assert len(cohort_sample_index(data, np.array([1]))) == 0


@pytest.mark.parametrize("name,strategy,kw", [("fedbn", "vmap", {}), ("fedbn", "map", {}),
                                              ("fedavg", Chunked(2), {}),
                                              ("fedbn", "vmap", {"client_store": "host"}),
                                              ("fedavg", "vmap", {"sampling": "poisson"}),
                                              ("fedavg", "map", {"sampling": "poisson"})])
def test_streamed_rounds_equal_the_stacked_rounds(name, strategy, kw):
    alg, data = algorithm(name), population([24, 3, 17, 9, 40, 1, 30, 12])
    stacked_kw = {k: v for k, v in kw.items() if k != "client_store"}
    s_ref, c_ref, m_ref, _ = run(Stacked, alg, data, 3, clients=strategy, cohort_size=4, **stacked_kw)
    s, c, m, engine = run(Streamed, alg, data, 3, clients=strategy, cohort_size=4, **kw)
    for a, b in zip(m, m_ref):
        np.testing.assert_array_equal(a["client_id"], b["client_id"])
        np.testing.assert_array_equal(a["steps"], b["steps"])
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
        assert a["padded_work"] == pytest.approx(b["padded_work"])
    # the same per-client programs on other array layouts: equal up to float reassociation (the tolerance of the
    # stacked and ragged backends' agreement, tests/test_simulation.py)
    assert_trees_close(s, s_ref, atol=2e-5, rtol=1e-4)
    assert_trees_close(jax.device_get(c.state), jax.device_get(c_ref.state), atol=2e-5, rtol=1e-4)
    assert c.placement == kw.get("client_store", "device")  # (auto: a small store stays on the device)
    assert (engine.rows_buffer is not None) == (strategy == "map")  # (map: the trained rows kept between rounds)


def test_a_run_compiles_one_program_when_its_cohorts_fit_the_store_sized_up_front():
    # 40 clients of 5..60 samples, 8 a round for 12 rounds: the cohorts' sample counts vary (~90..330); the
    # store is sized once (mean + 4 std of a cohort's samples), so every round runs the same program
    counts = np.random.default_rng(1).integers(5, 61, 40)
    alg, data = algorithm("fedavg"), population(counts)
    engine = Streamed(alg, data, batch_size=8, num_rounds=12, clients="vmap", cohort_size=8)
    assert engine.store_samples == cohort_samples_bound(counts, cohort=8)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    traced, sums = 0, set()
    for r in range(12):
        sums.add(int(counts[engine.draw(r, ROOT)].sum()))
        with traces() as new:
            server, m = engine.round(server, store, r, ROOT)
        traced += len(new)
        assert m["compiled_shapes"] == 1
    assert traced == 1 and len(sums) > 3 and max(sums) <= engine.store_samples, (traced, sums)


def test_a_cohort_past_the_store_runs_with_its_rounded_count_and_the_same_numbers():
    # a store too small for most cohorts: each such round runs with its sample count rounded up to the grid,
    # one program per rounded count; the numbers are the stacked backend's
    counts = np.random.default_rng(1).integers(5, 61, 40)
    alg, data = algorithm("fedavg"), population(counts)
    _, _, m_ref, _ = run(Stacked, alg, data, 6, clients="vmap", cohort_size=8)
    engine = Streamed(alg, data, batch_size=8, num_rounds=6, clients="vmap", cohort_size=8, store_samples=150)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    sizes = set()
    for r in range(6):
        n = int(counts[engine.draw(r, ROOT)].sum())
        sizes.add(150 if n <= 150 else grid_ceil(n))
        server, m = engine.round(server, store, r, ROOT)
        assert m["compiled_shapes"] == len(sizes)
        np.testing.assert_allclose(m["loss"], m_ref[r]["loss"], rtol=1e-4)
    assert len(sizes) > 1
    with pytest.raises(ConfigError, match="store_samples=0"):
        Streamed(alg, data, batch_size=8, store_samples=0)


def test_the_store_bound_is_the_cohort_sums_mean_plus_4_std_capped_at_the_largest_sum():
    counts = np.array([10, 20, 30, 40, 100])
    # fixed cohorts of 2 of 5: mean 2 * 40, variance 2 * 1000 * 3 / 4 = 1500
    assert cohort_samples_bound(counts, cohort=2, sigmas=1) == int(np.ceil(80 + np.sqrt(1500)))
    assert cohort_samples_bound(counts, cohort=2) == 140  # capped: the two largest
    assert cohort_samples_bound(counts, cohort=5) == 200  # every client: no spread
    # Poisson, q = 0.4: mean 0.4 * 200, variance 0.4 * 0.6 * 13000
    assert cohort_samples_bound(counts, rate=0.4, sigmas=1) == int(np.ceil(80 + np.sqrt(0.24 * 13000)))
    assert cohort_samples_bound(counts, rate=0.4) == 200  # capped: every sample
    # the sample mean and variance of many draws agree with the formulas
    rng = np.random.default_rng(0)
    sums = np.array([counts[rng.choice(5, 2, replace=False)].sum() for _ in range(20000)])
    assert abs(sums.mean() - 80) < 4 * np.sqrt(1500 / 20000) and abs(sums.var() / 1500 - 1) < 0.05
    with pytest.raises(ValueError, match="exactly one"):
        cohort_samples_bound(counts)


def test_the_streamed_backend_runs_one_round_per_call():
    alg, data = algorithm("fedavg"), population([8, 8])
    with pytest.raises(ConfigError, match="one round per call"):
        Streamed(alg, data, batch_size=8, rounds_per_call=2)


def test_the_evaluation_hook_sees_the_trained_rows_of_the_cohort():
    alg, data = algorithm("fedbn"), population([24, 3, 17, 9, 40, 1])
    engine = Streamed(alg, data, batch_size=8, num_rounds=2, clients="vmap", cohort_size=3)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    seen = {}
    server_a, m = engine.round(server, store, 0, ROOT, before_aggregate=lambda s, t, ids: seen.update(ids=ids, t=t))
    np.testing.assert_array_equal(seen["ids"], m["client_id"])
    assert jax.tree_util.tree_leaves(seen["t"])[0].shape[0] == 3
    server_b, _ = Streamed(alg, data, batch_size=8, num_rounds=2, clients="vmap", cohort_size=3).round(
        server, engine.init(jax.random.key(0), data.x[:1])[1], 0, ROOT)
    assert_trees_close(server_a, server_b, atol=2e-6, rtol=1e-5)  # one call or two around the hook


@bit_identity("a resumed run runs the same round programs on the same inputs as the uninterrupted one")
def test_a_streamed_run_resumes_bit_for_bit(tmp_path):
    """Checkpoint after round 2, resume to 4: the same states as 4 rounds at once (the host store's states are
    saved and restored as they are)."""
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    tiny = dict(algorithm="fedbn", backend="streamed", client_store="host", clients_per_round=2,
                model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30, batch_size=16,
                eval_batch_size=32, lr=0.05)
    full = Experiment(RunConfig(rounds=4, **tiny)).run()
    Experiment(RunConfig(rounds=2, out=str(tmp_path), checkpoint_every=1, **tiny)).run()
    resumed = Experiment(RunConfig(rounds=4, out=str(tmp_path), checkpoint_every=1, resume=True, **tiny)).run()
    assert_trees_close(full.server, resumed.server, atol=0, rtol=0)
    assert_trees_close(jax.device_get(full.clients), jax.device_get(resumed.clients), atol=0, rtol=0)
