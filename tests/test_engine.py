import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, bit_identity, make_trainer, rounding_tolerance, rounds_tolerance,
                      setup_algorithm)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import is_batchnorm
from jaxfl.core.cohort import client_keys, client_map, device_balanced_order, map_clients, sample_cohort
from jaxfl.core.evaluate import make_evaluate
from jaxfl.core.step import cohort_train, init_state, make_step
from jaxfl.core.trainer import epoch_permutation, permutation_lengths
from jaxfl.core.trees import leaf_paths
from jaxfl.data.clients import ClientData
from jaxfl.models import small_cnn


ROOT = jax.random.key(7)


def setup(name="fedbn", counts=(24, 17, 9), m=None, **trainer_kw):
    return setup_algorithm(name, small_cnn(num_classes=4, width=4), counts, m, **trainer_kw)


def run_rounds(alg, data, server, states, rounds=2, **kw):
    return conftest.run_rounds(alg, data, server, states, ROOT, rounds, **kw)


@pytest.mark.parametrize("name", ["fedavg", "fedbn", "local"])
def test_strategies_give_same_numbers(name):
    alg, data, server, clients = setup(name)
    ref = run_rounds(alg, data, server, clients, clients="vmap")
    # other programs for the same math: equal up to float32 rounding of the two rounds
    server_tol, client_tol, metric_tol = rounds_tolerance(alg, data, server, clients, ROOT, rounds=2)
    for strategy, chunk in [("map", 8), ("chunked", 1), ("chunked", 2), ("chunked", 3)]:
        out = run_rounds(alg, data, server, clients, clients=client_map(strategy, chunk))
        assert_trees_close(out[:2], ref[:2], atol=(server_tol, client_tol), rtol=0)
        np.testing.assert_allclose(out[2]["loss"], ref[2]["loss"], atol=metric_tol["loss"], rtol=0)


def test_one_client_alone_equals_same_client_in_stack():
    alg, data, server, clients = setup("local")
    _, stacked, _ = run_rounds(alg, data, server, clients)
    # Client 1 alone: a stack of one, but it must keep its client id (its PRNG stream) -> run its
    # local_update directly with the key the engine gives client 1.
    one = jax.tree_util.tree_map(lambda a: a[1], clients)
    row = data.take(1)
    row_of = lambda t: {k: t[k] for k in ("params", "batch_stats")}  # (no optimizer state is stored)

    @jax.jit
    def alone(server, one):
        for r in range(2):
            one, _ = alg.local_update(server, one, row, client_keys(ROOT, r, jnp.array([1]))[0], conftest.info(r, 1))
        return row_of(one)
    # another program: equal up to float32 rounding of the client's two updates
    tol = rounding_tolerance(alone, server, one)
    assert_trees_close(row_of(jax.tree_util.tree_map(lambda a: a[1], stacked)), alone(server, one), atol=tol, rtol=0)


def test_padding_changes_nothing():
    counts = (24, 17, 9)
    alg, data, server, clients = setup("fedbn", counts)
    # Same real samples, 16 more padded rows, and every padded position filled with garbage (255, label
    # 3): loss, gradients, BN statistics and metrics must ignore all of it.
    x = np.full((3, 40) + data.x.shape[2:], 255, np.uint8)
    y = np.full((3, 40), 3, np.int32)
    for i, c in enumerate(counts):
        x[i, :c], y[i, :c] = data.x[i, :c], data.y[i, :c]
    padded = ClientData(jnp.asarray(x), jnp.asarray(y), data.count)
    a = conftest.run_step(alg, data, server, clients, ROOT, rounds=2)  # the step both backends run
    b = conftest.run_step(alg, padded, server, clients, ROOT, rounds=2)
    # another program (40 rows a client): equal up to float32 rounding of the unpadded step's two rounds
    server_tol, client_tol, metric_tol = rounds_tolerance(alg, data, server, clients, ROOT, rounds=2)
    assert_trees_close(b[:2], a[:2], atol=(server_tol, client_tol), rtol=0)
    np.testing.assert_allclose(b[2]["loss"], a[2]["loss"], atol=metric_tol["loss"], rtol=0)
    evaluate = make_evaluate(alg, eval_batch_size=8)
    ea = jax.jit(evaluate)(a[0], a[1], data)
    eb = jax.jit(evaluate)(b[0], b[1], padded)
    np.testing.assert_allclose(ea["accuracy"], eb["accuracy"])
    # the losses of states equal up to rounding: float32 rounding of the unpadded rounds and evaluation together
    step = make_step(alg)
    rounds_then_evaluate = jax.jit(lambda s, c: evaluate(*conftest.step_rounds(step, data, s, c, ROOT, 2)[:2], data))
    loss_tol = rounding_tolerance(rounds_then_evaluate, server, clients)["loss"]
    np.testing.assert_allclose(eb["loss"], ea["loss"], atol=loss_tol, rtol=0)


@bit_identity("a weighted mean of one client with weight 1 is that client's state exactly")
def test_fedavg_one_client_equals_local():
    alg_avg, data, server, clients = setup("fedavg", counts=(20,))
    alg_loc = build_algorithm("local", small_cnn(num_classes=4, width=4), make_trainer())
    a = run_rounds(alg_avg, data, server, clients, rounds=3)
    s, c = init_state(alg_loc, jax.random.key(0), data.x[0], 1)
    b = run_rounds(alg_loc, data, s, c, rounds=3)
    # FedAvg's model of the single client = its own params after each round (averaging one client is exact)
    assert_trees_close(a[0]["params"], jax.tree_util.tree_map(lambda x: x[0], b[1]["params"]), atol=0, rtol=0)


def test_fedbn_keeps_batchnorm_per_client_and_averages_the_rest():
    alg, data, server, clients = setup("fedbn")
    s, c, _ = run_rounds(alg, data, server, clients, rounds=1)
    # The persistent client state is exactly the BatchNorm leaves (scale/bias and statistics), one row each.
    kept = leaf_paths(c)
    assert kept and all(is_batchnorm(p) for p in kept)
    assert len([p for p in leaf_paths(s["params"]) if is_batchnorm(p)]) + len(leaf_paths(s["batch_stats"])) == len(kept)
    for leaf in jax.tree_util.tree_leaves(c):
        assert leaf.shape[0] == 3 and not np.allclose(leaf[0], leaf[1])
    # Every other parameter is the server's; its running statistics are never averaged (initial values).
    assert_trees_close(s["batch_stats"], server["batch_stats"], atol=0, rtol=0)
    assert not np.allclose(c["batch_stats"]["encoder"]["bn1"]["mean"][0], c["batch_stats"]["encoder"]["bn1"]["mean"][1])


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_fedavg_keeps_no_client_state(name):
    alg, data, server, clients = setup(name)
    assert jax.tree_util.tree_leaves(clients) == []
    s, c, _ = run_rounds(alg, data, server, clients, rounds=1)
    assert jax.tree_util.tree_leaves(c) == []
    assert not np.allclose(s["params"]["head"]["fc1"]["linear"]["kernel"],
                           server["params"]["head"]["fc1"]["linear"]["kernel"])


def test_fedavg_server_is_sample_weighted_mean_of_clients():
    alg, data, server, clients = setup("fedavg")
    # One round of local training without aggregation = the 'local' algorithm's client rows.
    loc = build_algorithm("local", small_cnn(num_classes=4, width=4), make_trainer())
    _, c_local, _ = run_rounds(loc, data, *init_state(loc, jax.random.key(0), data.x[0], 3), rounds=1)
    s, _, _ = run_rounds(alg, data, server, clients, rounds=1)
    w = np.array([24, 17, 9], np.float32) / 50
    expected = jax.tree_util.tree_map(lambda x: np.tensordot(w, np.asarray(x), 1), c_local["params"])
    tol = rounds_tolerance(alg, data, server, clients, ROOT)[0]["params"]  # (float32 rounding of the round)
    assert_trees_close(s["params"], expected, atol=tol, rtol=0)


@pytest.mark.parametrize("backend", conftest.BACKENDS)
def test_partial_participation_trains_only_the_cohort(backend):
    alg, data, server, clients = setup("local", counts=(24, 17, 9, 12, 20))
    _, c, m = run_rounds(alg, data, server, clients, rounds=1, cohort_size=2, backend=backend)
    ids = np.asarray(m["client_id"])
    assert len(ids) == 2 and len(set(ids.tolist())) == 2
    for i in range(5):
        same = np.allclose(c["params"]["head"]["fc1"]["linear"]["kernel"][i],
                           clients["params"]["head"]["fc1"]["linear"]["kernel"][i])
        assert same == (i not in ids)
    np.testing.assert_array_equal(ids, sample_cohort(ROOT, 0, 5, 2))


def floyd_numpy(root, t, n, k):
    """Floyd's algorithm in numpy on the engine's documented random draws."""
    key = jax.random.fold_in(jax.random.fold_in(root, 1), t)
    chosen = []
    for i in range(k):
        j = n - k + i
        r = int(jax.random.randint(jax.random.fold_in(key, i), (), 0, j + 1))
        chosen.append(j if r in chosen else r)
    return np.sort(chosen)


def test_cohorts_are_uniform_sorted_draws_without_replacement_keyed_by_round():
    for t in range(3):
        np.testing.assert_array_equal(sample_cohort(ROOT, t, 7, 3), floyd_numpy(ROOT, t, 7, 3))
    draw = jax.jit(jax.vmap(lambda t: sample_cohort(ROOT, t, 5, 2)))
    cohorts = np.asarray(draw(jnp.arange(2000)))
    assert np.all(cohorts[:, 0] < cohorts[:, 1]) and cohorts.min() >= 0 and cohorts.max() <= 4
    # each of the 10 pairs has probability 1/10: 200 expected in 2000 draws (std 13.4)
    pairs, freq = np.unique(cohorts, axis=0, return_counts=True)
    assert len(pairs) == 10 and freq.min() >= 150 and freq.max() <= 250, freq
    np.testing.assert_array_equal(sample_cohort(ROOT, 7, 5, 5), np.arange(5))  # a full cohort is everyone
    big = np.asarray(sample_cohort(ROOT, 0, 100_000, 100))
    assert len(np.unique(big)) == 100 and big.max() < 100_000


def test_device_balanced_order_deals_ranked_rows_to_the_devices_in_a_snake():
    work = jnp.array([1.0, 9.0, 4.0, 4.0, 7.0, 2.0, 0.0, 3.0])
    # ranked: 9 (row 1), 7 (4), 4 (2), 4 (3), 3 (7), 2 (5), 1 (0), 0 (6); laps 0, 2 go 0 -> 1, laps 1, 3 go 1 -> 0
    np.testing.assert_array_equal(device_balanced_order(work, 2), [1, 3, 7, 6, 4, 2, 5, 0])
    np.testing.assert_array_equal(jax.jit(device_balanced_order, static_argnums=1)(work, 2),
                                  device_balanced_order(work, 2))
    np.testing.assert_array_equal(device_balanced_order(work, 1), np.arange(8))
    rng = np.random.default_rng(0)
    for devices in (2, 3, 4):
        for _ in range(50):  # log-normal local steps, as clients' sizes are
            steps = np.ceil(rng.lognormal(2.0, 1.0, 12 * devices))
            order = device_balanced_order(steps, devices)  # (numpy in, numpy out: the host's plans)
            assert isinstance(order, np.ndarray)
            np.testing.assert_array_equal(order, device_balanced_order(jnp.asarray(steps), devices))  # jax's
            assert sorted(order) == list(range(len(steps)))  # a permutation
            totals = steps[order].reshape(devices, -1).sum(1)
            assert totals.max() - totals.min() <= steps.max()  # the docstring's bound
    with pytest.raises(ValueError, match="do not split"):
        device_balanced_order(jnp.ones(7), 2)


def test_client_keys_depend_on_id_not_position():
    k_all = client_keys(ROOT, 3, jnp.arange(5))
    k_sub = client_keys(ROOT, 3, jnp.array([1, 4]))
    np.testing.assert_array_equal(jax.random.key_data(k_all[jnp.array([1, 4])]), jax.random.key_data(k_sub))


def test_epoch_permutation_real_first_and_padding_invariant():
    key = jax.random.key(3)
    p1 = np.asarray(epoch_permutation(key, 10, 16))
    p2 = np.asarray(epoch_permutation(key, 10, 64))
    assert sorted(p1[:10]) == list(range(10))
    np.testing.assert_array_equal(p1[:10], p2[:10])
    assert not np.array_equal(p1[:10], np.asarray(epoch_permutation(jax.random.key(4), 10, 16))[:10])


@pytest.mark.parametrize("m", [16, 200, 1000])
def test_epoch_permutation_with_a_bound_is_the_same_permutation(m):
    # a bound >= every lane's count sorts the shortest of permutation_lengths(m) holding it and appends the
    # positions past it in order: the same integers as sorting all m, jitted, under vmap with the bound shared
    key = jax.random.key(5)
    counts = sorted({min(c, m) for c in (0, 1, 7, 63, 64, 65, m // 3, m // 2, m - 1, m)})
    full = np.asarray(jax.vmap(lambda c: epoch_permutation(key, c, m))(jnp.asarray(counts)))
    for bound in counts:
        lanes = [i for i, c in enumerate(counts) if c <= bound]
        got = jax.jit(jax.vmap(lambda c: epoch_permutation(key, c, m, bound)))(jnp.asarray(counts)[np.asarray(lanes)])
        np.testing.assert_array_equal(got, full[lanes])


def test_epoch_permutation_bound_picks_one_sort_not_all():
    # unbatched under vmap, the bound selects one branch (a cond); a batched one would compute every length
    assert permutation_lengths(1000) == (125, 250, 500, 1000) and permutation_lengths(16) == (16,)
    perm = lambda c: epoch_permutation(jax.random.key(0), c, 1000, jnp.int32(300))
    assert "cond[" in str(jax.make_jaxpr(jax.vmap(perm))(jnp.arange(4)))


@pytest.mark.parametrize("strategy", ["vmap", "map", "chunked"])
def test_map_clients_passes_the_largest_bound_of_the_clients_run_together(strategy):
    counts = jnp.asarray([3, 9, 4, 1])
    out = map_clients(lambda c, bound: jnp.stack([c, bound]), strategy, 2, bound_arg=0)(counts)
    np.testing.assert_array_equal(out[:, 0], counts)
    np.testing.assert_array_equal(out[:, 1], counts if strategy == "map" else 9)


@pytest.mark.parametrize("strategy", ["vmap", "map", "chunked"])
def test_apply_into_gives_what_apply_gives_whatever_the_buffer_held(strategy):
    # Map writes each client's outputs into its row of the buffer; the others return new outputs
    m = client_map(strategy, 2)
    counts, x = jnp.asarray([3, 9, 4, 1]), jnp.arange(8.0).reshape(4, 2)

    def fn(c, v, bound):
        return {"sum": v.sum() * c, "pair": jnp.stack([c, bound]).astype(jnp.float32)}
    want = m.apply(fn, bound_arg=0)(counts, x)
    out = {"sum": jnp.full((4,), jnp.nan), "pair": jnp.full((4, 2), jnp.nan)}
    into = jax.jit(m.apply_into(fn, bound_arg=0), donate_argnums=(0,) if strategy == "map" else ())
    got = into(out, counts, x)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    if strategy == "map":  # (donated: written in place)
        assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(out))
    shared = jax.jit(m.over(lambda k, c, v, bound=None: fn(c, v * k, bound), bound_arg=0, into=True))
    again = shared(2.0, {"sum": jnp.zeros(4), "pair": jnp.zeros((4, 2))}, counts, x)
    np.testing.assert_array_equal(np.asarray(again["sum"]), 2 * np.asarray(want["sum"]))


@pytest.mark.parametrize("strategy", ["map", "vmap"])
def test_clients_beyond_their_data_skip_steps(strategy):
    # Client 1 has 9 samples: with batch 8 it takes 2 steps. Trained beside a client of 24 (the stack runs 3
    # steps, its rows padded to 24) it must end where it ends trained alone on exactly its 9 samples.
    alg, data, server, clients = setup("local", counts=(24, 9))
    train = jax.jit(cohort_train(alg, clients=strategy))
    in_stack, m = train(server, clients, data, jnp.arange(2), 0, ROOT)
    alone_data = jax.tree_util.tree_map(lambda a: a[1:2, :9] if a.ndim > 1 else a[1:2], data)
    alone, _ = train(server, jax.tree_util.tree_map(lambda a: a[1:2], clients), alone_data, jnp.array([1]), 0, ROOT)
    np.testing.assert_array_equal(np.asarray(m["steps"]), [3, 2])
    # another program (a stack of 24-sample rows): equal up to float32 rounding of the lone client's training
    tol = rounding_tolerance(lambda s, c: train(s, c, alone_data, jnp.array([1]), 0, ROOT)[0], server,
                             jax.tree_util.tree_map(lambda a: a[1:2], clients))
    assert_trees_close(jax.tree_util.tree_map(lambda a: a[1:2], in_stack), alone, atol=tol, rtol=0)


@pytest.mark.parametrize("strategy", ["map", "vmap"])
def test_each_client_takes_only_its_own_steps(strategy):
    # batch 8: 24 samples -> 3 steps per epoch, 3 samples -> 1 step (not the largest client's 3), two epochs
    alg, data, server, clients = setup("local", counts=(24, 3), epochs=2)
    _, _, m = run_rounds(alg, data, server, clients, rounds=1, clients=strategy)
    np.testing.assert_array_equal(np.asarray(m["steps"]), [6, 2])
    np.testing.assert_array_equal(np.asarray(m["seen"]), [48, 6])


def test_map_clients_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="vmap, map, chunked"):
        map_clients(lambda x: x, "pmap")


@pytest.mark.parametrize("strategy", ["map", "vmap"])
def test_evaluation_runs_only_the_batches_that_hold_real_samples(strategy):
    # a client with 3 test samples beside one with 20, batches of 4: the small client runs 1 batch, not 5
    # (under vmap the group runs the largest client's 5, but each client's real rows are the same)
    from jaxfl.core.evaluate import make_predict
    alg, _, server, clients = setup_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), [8, 8])
    data = conftest.make_data([3, 20], m=20)
    logits, _ = jax.jit(make_predict(alg, eval_batch_size=4, clients=strategy))(server, clients, data)
    one = jax.tree_util.tree_map(lambda a: a[0], clients)
    from jaxfl.core.trainer import normalizer
    by_hand = jax.jit(alg.predict)
    args = (server, one, normalizer()(data.x[0, :3]))
    # another program (batches of 4, a group of clients): equal up to float32 rounding of the lone prediction
    np.testing.assert_allclose(np.asarray(logits[0, :3]), np.asarray(by_hand(*args)),
                               atol=rounding_tolerance(by_hand, *args), rtol=0)
    if strategy == "map":  # batches past the client's own never ran: their outputs are the zero fill
        assert np.all(np.asarray(logits[0, 4:]) == 0) and np.any(np.asarray(logits[1, 4:]) != 0)
    ev = jax.jit(make_evaluate(alg, eval_batch_size=4, clients=strategy))(server, clients, data)
    assert np.all(np.isfinite(np.asarray(ev["loss"]))) and ev["count"].tolist() == [3, 20]


def test_a_client_without_test_samples_has_no_metrics_and_counts_in_no_mean():
    # NaN (a mean over no sample), not 0; metrics.jsonl lists it as null and its means leave it out
    from jaxfl.run.runner import eval_record
    alg, _, server, clients = setup_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), [8, 8, 8])
    data = conftest.make_data([3, 0, 5], m=8)
    ev = jax.device_get(jax.jit(make_evaluate(alg, eval_batch_size=4, clients="map"))(server, clients, data))
    assert np.isnan(ev["accuracy"][1]) and np.isnan(ev["loss"][1])
    assert np.all(np.isfinite(ev["loss"][[0, 2]])) and ev["count"].tolist() == [3, 0, 5]
    rec = eval_record(ev)
    assert rec["test_accuracy"][1] is None and rec["test_loss"][1] is None
    acc = ev["accuracy"]
    assert rec["mean_accuracy"] == pytest.approx((acc[0] + acc[2]) / 2)
    assert rec["weighted_accuracy"] == pytest.approx((3 * acc[0] + 5 * acc[2]) / 8)
    empty = eval_record(dict(ev, count=np.zeros(3, np.int32)))
    assert empty["mean_accuracy"] is None and empty["weighted_accuracy"] is None


def test_batchnorm_local_training_runs_with_64_bit_types_enabled():
    # under jax_enable_x64 a BatchNorm model's loss is float64: the step sums keep their float32 carry
    with jax.enable_x64(True):
        alg, data, server, clients = setup_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), [5, 9])
        trained, metrics = jax.jit(cohort_train(alg, clients="map"))(
            server, clients, data, jnp.arange(2), 0, jax.random.key(0))
    assert np.all(np.isfinite(np.asarray(metrics["loss"]))) and metrics["seen"].tolist() == [5, 9]


def test_the_evaluation_loss_is_each_clients_mean_cross_entropy_of_its_predictions():
    """``make_evaluate``'s loss over stacked clients [k, M] against the formula in float64 from the same
    predictions: each client's mean over its real samples of -log softmax(z)[y] (and the accuracy likewise)."""
    from jaxfl.core.evaluate import make_predict
    data = conftest.make_data([5, 7, 3], m=8)
    alg = build_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer())
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    ev = jax.jit(make_evaluate(alg, eval_batch_size=8))(server, clients, data)
    logits = np.asarray(jax.jit(make_predict(alg, eval_batch_size=8))(server, clients, data)[0], np.float64)
    y, w, n = np.asarray(data.y), np.asarray(data.sample_mask()), np.asarray(data.count)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
    # a log-softmax and a mean of at most 8 terms in float32: a few eps32 of the largest term
    np.testing.assert_allclose(ev["loss"], (w * ce).sum(-1) / n, rtol=0, atol=32 * np.finfo(np.float32).eps * ce.max())
    np.testing.assert_allclose(ev["accuracy"], (w * (logits.argmax(-1) == y)).sum(-1) / n, rtol=0, atol=1e-6)
