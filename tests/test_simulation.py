"""The two backends: Ragged (ragged data, bucketed cohorts, the per-client store) gives Stacked's numbers (the
whole population on the device, one jit per round)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_trainer

from jaxfl.algorithms import build_algorithm
from jaxfl.core.backends import ClientStore, Ragged, Stacked
from jaxfl.core.buckets import grid_ceil, lane_sizes, padded_work, plan_buckets
from jaxfl.core.cohort import client_map
from jaxfl.data.ragged import RaggedClients
from jaxfl.errors import DeviceMemoryError
from jaxfl.models import small_cnn


ROOT = jax.random.key(5)
COUNTS = (24, 3, 17, 9, 40, 1)


def ragged(counts=COUNTS, seed=0):
    rng = np.random.default_rng(seed)
    return RaggedClients.from_clients([(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
                                        rng.integers(0, 4, n).astype(np.int32)) for n in counts])


def algorithm(name, epochs=1):
    return build_algorithm(name, small_cnn(num_classes=4, width=4), make_trainer(epochs=epochs))


def reference(alg, data, rounds, cohort):
    """Stacked: one jit per round over the whole population on the device."""
    engine = Stacked(alg, data, batch_size=8, clients="map", cohort_size=cohort)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    for r in range(rounds):
        server, m = engine.round(server, store, r, ROOT)
    return server, store.state, m


def simulate(alg, data, rounds, cohort, **kw):
    sim = Ragged(alg, data, batch_size=8, cohort_size=cohort, **kw)
    server, store = sim.init(jax.random.key(0), data.x[:1])
    for r in range(rounds):
        server, m = sim.round(server, store, r, ROOT)
    return server, store, m, sim


@pytest.mark.parametrize("name,strategy,chunk", [("fedbn", "map", 8), ("fedbn", "vmap", 8), ("fedbn", "chunked", 2),
                                                 ("local", "vmap", 8), ("fedavg", "chunked", 2)])
def test_buckets_and_store_equal_the_stacked_round(name, strategy, chunk):
    alg, data = algorithm(name), ragged()
    s_ref, c_ref, m_ref = reference(alg, data, 3, 4)
    s, store, m, _ = simulate(alg, data, 3, 4, clients=client_map(strategy, chunk))
    np.testing.assert_array_equal(m["client_id"], m_ref["client_id"])
    np.testing.assert_array_equal(m["steps"], m_ref["steps"])
    assert_trees_close(s, s_ref, atol=2e-5, rtol=1e-4)
    assert_trees_close(store.state, c_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(m["loss"], m_ref["loss"], rtol=1e-4)


def test_a_bucket_out_of_device_memory_is_retrained_in_smaller_buckets():
    # the GPU suite's 1,000-lane FedAvg CNN bucket ran out of memory on an H200: the round is retrained in
    # buckets of at most half as many lanes (here the fake device holds 1 lane), with the same numbers
    alg, data = algorithm("fedbn"), ragged()
    s_ref, c_ref, m_ref = reference(alg, data, 2, None)
    sim = Ragged(alg, data, batch_size=8, clients="vmap")
    real, lanes_run = sim._train_into, []

    def small_device(buffer, server, clients, d, ids, *rest):
        lanes = ids.shape[0]
        if lanes > 1:
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory ({lanes} lanes)")
        lanes_run.append(lanes)
        return real(buffer, server, clients, d, ids, *rest)

    sim._train_into = small_device
    server, store = sim.init(jax.random.key(0), data.x[:1])
    with pytest.warns(UserWarning,
                      match="out of device memory training 2 clients in one call; buckets are capped at 1"):
        for r in range(2):
            server, m = sim.round(server, store, r, ROOT)
    assert sim.lane_cap == 1 and set(lanes_run) == {1}  # buckets of 2 lanes ran as 1 + 1
    assert m["buckets"] == 6
    assert_trees_close(server, s_ref, atol=2e-5, rtol=1e-4)
    assert_trees_close(store.state, c_ref, atol=2e-5, rtol=1e-4)
    sim._train_into = lambda *a: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL: not memory"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # other runtime errors are not retried
        sim.round(server, store, 2, ROOT)


def test_a_stacked_round_out_of_device_memory_is_one_line_naming_the_options():
    alg, data = algorithm("fedavg"), ragged()
    engine = Stacked(alg, data, batch_size=8, clients="vmap", cohort_size=4)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    engine._round = lambda *a: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    with pytest.raises(DeviceMemoryError, match=r"^out of device memory training 4 clients in one call "
                       r"\(JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\); --backend ragged") as err:
        engine.round(server, store, 0, ROOT)
    assert err.value.exit_code == 1 and "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["map", "vmap"])
def test_stacked_round_reads_rows_instead_of_copying_the_padded_cohort(strategy):
    # the cohort's data is never gathered as [cohort, longest client, ...]: minibatches read their rows from the
    # flat store (a copy of cohort x longest client was 40% of a logistic-regression round of FEMNIST-sized clients)
    alg, data = algorithm("fedavg"), ragged()
    engine = Stacked(alg, data, batch_size=8, clients=strategy, cohort_size=4)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    hlo = engine._round.lower(server, store.state, engine.data, 0, ROOT).compile().as_text()
    assert engine.length == 48
    assert "[4,48,8,8,3]" not in hlo and "[48,8,8,3]" not in hlo
    assert re.search(r"[\[,]8,8,8,3\]", hlo)  # a minibatch of 8 samples (per client, or [4, 8, ...] under vmap)


def stacked_rounds(name, rounds=3, per_call=1, **kw):
    alg, data = algorithm(name), ragged()
    engine = Stacked(alg, data, batch_size=8, clients="map", cohort_size=4, rounds_per_call=per_call, **kw)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    if per_call > 1:
        server, ms = engine.run_rounds(server, store, 0, rounds, ROOT)
    else:
        ms = []
        for r in range(rounds):
            server, m = engine.round(server, store, r, ROOT)
            ms.append(m)
    return engine, server, store.state, ms


@pytest.mark.parametrize("name", ["fedavg", "fedbn"])
def test_map_rounds_write_their_trained_rows_into_the_rows_of_the_round_before(name):
    # the rows' buffer is kept between rounds (no [cohort, model] output zero-filled a call); what it held changes
    # nothing: the rounds equal rounds with a new buffer each call, in one call a round or three rounds a call
    engine, s_new, c_new, m_new = stacked_rounds(name, keep_rows=False)
    assert not engine.keeps_rows and engine.rows_buffer is None
    for per_call in (1, 3):
        engine, s, c, ms = stacked_rounds(name, per_call=per_call)
        assert engine.keeps_rows and engine.rows_buffer is not None
        assert_trees_close(s, s_new, atol=2e-5, rtol=1e-4)
        assert_trees_close(c, c_new, atol=2e-5, rtol=1e-4)
        for m, want in zip(ms, m_new):
            np.testing.assert_array_equal(m["client_id"], want["client_id"])
            np.testing.assert_allclose(m["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    # the buffer is donated to the round (written in place, not copied) and holds this round's rows afterwards
    data = ragged()
    engine = Stacked(algorithm(name), data, batch_size=8, clients="map", cohort_size=4)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    server, _ = engine.round(server, store, 0, ROOT)
    engine.rows_buffer = jax.tree_util.tree_map(
        lambda a: jnp.full_like(a, jnp.nan) if a.dtype == jnp.float32 else a, engine.rows_buffer)
    poisoned = jax.tree_util.tree_leaves(engine.rows_buffer)
    _, m = engine.round(server, store, 1, ROOT)
    assert all(a.is_deleted() for a in poisoned)
    assert np.isfinite(m["loss"]).all() and m["finite"].all()
    trained, metrics = engine.rows_buffer
    np.testing.assert_array_equal(np.asarray(metrics["loss"]), m["loss"])

    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a: bool(jnp.isfinite(a).all()), trained))
    # rows donated to a call that did not return are made anew, not passed again
    jax.tree_util.tree_map(lambda a: a.delete(), engine.rows_buffer)
    _, again = engine.round(server, store, 2, ROOT)
    assert np.isfinite(again["loss"]).all()
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(engine.rows_buffer))


def test_map_trains_exactly_the_real_samples():
    alg, data = algorithm("local", epochs=2), ragged()
    _, _, m, _ = simulate(alg, data, 1, None, clients="map")
    counts = np.array(COUNTS)
    np.testing.assert_array_equal(m["seen"], 2 * counts)
    np.testing.assert_array_equal(m["steps"], 2 * -(-counts // 8))  # the 3-sample client: 1 step per epoch
    assert m["padded_work"] == pytest.approx(np.sum(-(-counts // 8) * 8) / counts.sum())
    assert m["buckets"] == 1


def test_vmap_buckets_group_similar_clients():
    alg, data = algorithm("local"), ragged()
    _, _, m, sim = simulate(alg, data, 1, None, clients="vmap")
    counts = np.array(COUNTS)
    np.testing.assert_array_equal(m["seen"], counts)
    # steps 3, 1, 3, 2, 5, 1 -> buckets {40}, {24, 17} , {9}, {3, 1} at grid lengths 6, 3, 2, 1
    assert m["buckets"] == 4 and m["compiled_shapes"] == 4
    assert m["padded_work"] == pytest.approx((5 + 2 * 3 + 2 + 2 * 1) * 8 / counts.sum())


def test_fedavg_store_is_empty_and_fedbn_store_holds_batchnorm_only():
    data = ragged()
    _, store, _, _ = simulate(algorithm("fedavg"), data, 1, 3)
    assert store.empty and jax.tree_util.tree_leaves(store.state) == []
    _, store, _, _ = simulate(algorithm("fedbn"), data, 1, 3)
    leaves = jax.tree_util.tree_leaves(store.state)
    assert leaves and all(a.shape[0] == len(COUNTS) for a in leaves)
    assert sum(a.size for a in leaves) == len(COUNTS) * 4 * 4  # one BN layer of width 4: scale, bias, mean, var


def test_host_and_device_stores_agree():
    alg, data = algorithm("fedbn"), ragged()
    a = simulate(alg, data, 2, 3, client_store="device")
    b = simulate(alg, data, 2, 3, client_store="host")
    assert isinstance(jax.tree_util.tree_leaves(b[1].state)[0], np.ndarray)
    assert isinstance(jax.tree_util.tree_leaves(a[1].state)[0], jax.Array)
    assert_trees_close(a[0], b[0], atol=0, rtol=0)
    assert_trees_close(a[1].state, b[1].state, atol=0, rtol=0)


def test_store_gather_and_scatter():
    store = ClientStore({"w": np.arange(12.0).reshape(6, 2)}, "host")
    np.testing.assert_array_equal(store.gather(np.array([4, 1]))["w"], [[8, 9], [2, 3]])
    store.scatter(np.array([1, 4]), {"w": jnp.array([[-1.0, -1.0], [-4.0, -4.0]])})
    np.testing.assert_array_equal(store.state["w"][[1, 4]], [[-1, -1], [-4, -4]])
    np.testing.assert_array_equal(store.state["w"][0], [0, 1])


def test_ragged_gather_pads_each_client_to_the_asked_length():
    data = ragged((3, 5))
    got = data.gather(np.array([1, -1, 0]), 8)
    assert got.x.shape == (3, 8, 8, 8, 3) and got.count.tolist() == [5, 0, 3]
    np.testing.assert_array_equal(got.x[0, :5], data.x[3:8])
    np.testing.assert_array_equal(got.y[2, :3], data.y[:3])
    assert data.nbytes < 2 * 5 * data.x[0].nbytes + 200  # stored once: no client x largest-client padding
    with pytest.raises(ValueError, match="shorter than a client's 5 samples"):
        data.gather(np.array([1]), 4)


def test_grid_and_lanes():
    assert [grid_ceil(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25, 100)] == \
        [1, 1, 2, 3, 4, 6, 6, 8, 12, 16, 24, 32, 128]
    assert lane_sizes(50) == [1, 2, 4, 8, 16, 32, 50] and lane_sizes(8, 2) == [2, 4, 8] and (
        lane_sizes(5, 2) == [2, 4, 6])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_lanes,multiple", [(1000, 1), (8, 1), (8, 2)])
def test_plan_covers_the_cohort_once_with_bounded_shapes(seed, max_lanes, multiple):
    rng = np.random.default_rng(seed)
    steps = np.maximum(1, rng.lognormal(2, 1.2, 300).astype(int))
    plan = plan_buckets(steps, max_lanes=max_lanes, lane_multiple=multiple)
    pos = np.concatenate([b.positions for b in plan])
    assert sorted(pos[pos >= 0].tolist()) == list(range(300))
    allowed = lane_sizes(max_lanes, multiple)
    for b in plan:
        present = b.positions[b.positions >= 0]
        assert b.lanes in allowed and b.steps == grid_ceil(b.steps) and np.all(steps[present] <= b.steps)
    done, real = padded_work(plan, steps * 10, 10, per_client_trips=False)
    assert real == steps.sum() * 10 and 1.0 <= done / real < 1.6


def test_the_library_entry_points_refuse_what_they_would_silently_misread():
    from jaxfl.core.evaluate import Evaluator
    from jaxfl.core.step import make_step
    from jaxfl.errors import ConfigError
    alg, data = algorithm("fedavg"), ragged()
    bad = [(lambda: make_step(alg, weighting="sample"), "unknown weighting 'sample'"),
           (lambda: Ragged(alg, data, batch_size=8, client_store="disk"), "unknown client_store 'disk'"),
           (lambda: Stacked(alg, data, batch_size=8, clients="pmap"), "unknown strategy 'pmap'"),
           (lambda: Stacked(alg, data, batch_size=0), "batch_size=0 must be an integer >= 1"),
           (lambda: Ragged(alg, data, batch_size=8, cohort_size=-2), "cohort_size=-2 must be an integer >= 1"),
           (lambda: Evaluator(alg, data, eval_batch_size=0, preprocess=None), "eval_batch_size=0 must be")]
    for build, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            build()
    engine = Ragged(alg, data, batch_size=8, cohort_size=2, num_rounds=3)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    for t in (-1, 3, 2 ** 31):
        with pytest.raises(ConfigError, match=re.escape(f"round index {t} is outside [0, 3) (num_rounds)")):
            engine.round(server, store, t, ROOT)
    evaluator = Evaluator(alg, data, eval_batch_size=8, preprocess=make_trainer().preprocess)
    with pytest.raises(ConfigError, match="unknown predict 'train'"):
        evaluator.metrics(server, store, predict="train")


def test_a_sample_of_another_shape_is_refused_before_it_sizes_the_model():
    from jaxfl.errors import ConfigError
    data = ragged()
    for sample in (data.x[0], data.x[:1, :4]):  # unbatched; another image size
        with pytest.raises(ConfigError, match=re.escape(f"sample_x has shape {tuple(sample.shape)}; the clients' "
                                                        f"inputs are (8, 8, 3) a sample")):
            Ragged(algorithm("fedavg"), data, batch_size=8).init(jax.random.key(0), sample)
