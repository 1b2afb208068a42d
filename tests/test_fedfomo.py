"""FedFomo (first-order model optimization): its weights, combination, epsilon-greedy choice and split against
their definitions, round 0 as local training on the training split, a client's round 1 by hand, the server's
table and affinities, and the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import (assert_cli_runs, assert_trees_close, info, make_data, make_trainer, rounding_tolerance,
                      run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import ce_loss
from jaxfl.algorithms.fedfomo import epsilon_greedy, fomo_combination, fomo_weights, reordered, split_rows
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn

COUNTS = (20, 30, 15, 25)
ROOT = jax.random.key(3)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def setup(**options):
    data = make_data(list(COUNTS))
    alg = build_algorithm("fedfomo", model(), make_trainer(), RunContext(num_clients=4), **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 4)
    return alg, data, server, clients


def test_weights_and_combination_follow_the_definition():
    w = fomo_weights(1.0, jnp.array([0.5, 1.5, 0.8, 0.1]), jnp.array([2.0, 1.0, 4.0, 1.0]),
                     jnp.array([True, True, True, False]))
    np.testing.assert_allclose(w, [0.5 / (2 + 1e-5), -0.5 / (1 + 1e-5), 0.2 / (4 + 1e-5), 0.0], rtol=1e-5)
    cands = {"a": jnp.arange(8.0).reshape(4, 2)}
    base = {"a": jnp.array([-1.0, -1.0])}
    out = fomo_combination(w, cands, base)
    pos = np.maximum(np.asarray(w), 0)
    np.testing.assert_allclose(out["a"], (pos[:, None] * np.arange(8.0).reshape(4, 2)).sum(0) / pos.sum(), rtol=1e-6)
    np.testing.assert_array_equal(fomo_combination(-jnp.abs(w), cands, base)["a"], base["a"])  # none helps


def test_epsilon_greedy_picks_distinct_eligible_clients():
    affinity = jnp.array([0.5, 3.0, -1.0, 2.0, 1.0, 0.0])
    eligible = jnp.array([True, True, True, False, True, True])
    ids, valid = epsilon_greedy(jax.random.key(0), affinity, eligible, 3, 0.0)
    np.testing.assert_array_equal(ids, [1, 4, 0])  # greedy: the highest affinities among the eligible
    assert bool(valid.all())
    for seed in range(5):
        ids, valid = epsilon_greedy(jax.random.key(seed), affinity, eligible, 5, 1.0)
        assert bool(valid.all()) and len(set(np.asarray(ids).tolist())) == 5 and 3 not in np.asarray(ids)
    ids, valid = epsilon_greedy(jax.random.key(0), affinity, jnp.array([False, True] + [False] * 4), 3, 0.5)
    np.testing.assert_array_equal(valid, [True, False, False])
    assert int(ids[0]) == 1


def test_split_holds_out_a_fixed_fraction_of_real_samples():
    order, n_train = split_rows(jax.random.key(1), jnp.int32(15), 20, 0.2)
    assert int(n_train) == 12
    assert set(np.asarray(order[:15]).tolist()) == set(range(15))  # the real samples come first


def test_rounds_against_hand_computations():
    alg, data, server, clients = setup()
    trainer, loss = make_trainer(), ce_loss(model())
    # round 0: nobody has uploaded, each client trains the initial model on its training split
    i, key = 1, jax.random.key(7)
    c = jax.tree_util.tree_map(lambda a: a[i], clients)
    row = data.take(i)
    trained, _ = jax.jit(alg.local_update)(server, c, row, key, info(0, i))
    order, n_train = split_rows(jax.random.fold_in(jax.random.key(0), i), row.count, row.y.shape[0], 0.2)
    init = c["base"]
    split = reordered(row, order, n_train)
    by_hand = jax.jit(lambda params, stats: trainer.run(loss, params, stats, trainer.tx.init(params), split, key)[0])
    # another program: equal up to float32 rounding of the hand-made training run
    assert_trees_close(trained["params"], by_hand(init["params"], init["batch_stats"]),
                       atol=rounding_tolerance(by_hand, init["params"], init["batch_stats"]), rtol=0)
    # after a round every model is in the table; round 1 of client 1 by hand (greedy: epsilon 0 once decayed)
    s1, c1, _ = run_rounds(alg, data, server, clients, ROOT, rounds=1)
    assert bool(s1["uploaded"].all())
    c = jax.tree_util.tree_map(lambda a: a[i], c1)
    trained, metrics = jax.jit(alg.local_update)(s1, c, row, key, info(6, i))  # eps = max(0.3 - 0.3, 0) = 0
    ids = np.asarray(trained["ids"])[:4]  # its own model and the 3 others; M = 4 leaves one slot empty
    assert ids[0] == i and sorted(ids[1:].tolist()) == [0, 2, 3] and float(trained["d_affinity"][4]) == 0.0
    x, y = row.x[order] / 255.0 * 2 - 1, row.y[order]
    val = slice(int(n_train), int(row.count))
    mdl = model()

    def vloss(v):
        logits = mdl.apply(v, x[val])
        return float(-jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), y[val]]))
    base = c["base"]
    table = [jax.tree_util.tree_map(lambda t: t[j], s1["models"]) for j in ids]
    d = [sum(float(jnp.abs(a - b).sum()) for a, b in zip(jax.tree_util.tree_leaves(t["params"]),
                                                          jax.tree_util.tree_leaves(base["params"]))) for t in table]
    w = np.array([(vloss(base) - vloss(t)) / (dd + 1e-5) for t, dd in zip(table, d)])
    assert (w > 0).any()
    pos = np.maximum(w, 0) / np.maximum(w, 0).sum()
    start = jax.tree_util.tree_map(lambda *leaves: sum(p * leaf for p, leaf in zip(pos, leaves)), *table)
    assert_trees_close(trained["base"], start, atol=1e-5)
    np.testing.assert_allclose(trained["d_affinity"][:4], w / abs(w.sum()), rtol=1e-3, atol=1e-6)
    assert float(metrics["helpers"]) == float((w > 0).sum())
    # the server writes the row and the affinities; a padded row (weight 0) writes nothing
    rows = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), trained)
    s2, kept = alg.aggregate(s1, rows, jnp.array([1.0, 0.0]), info(1, [i, i]))
    assert_trees_close(jax.tree_util.tree_map(lambda t: t[i], s2["models"]),
                       {"params": trained["params"], "batch_stats": trained["batch_stats"]}, atol=0, rtol=0)
    np.testing.assert_allclose(s2["affinity"][i, ids] - s1["affinity"][i, ids], trained["d_affinity"][:4], rtol=1e-6)
    np.testing.assert_allclose(alg.predict(s2, kept, x[:3], i), mdl.apply(table[0] | {
        "params": trained["params"], "batch_stats": trained["batch_stats"]}, x[:3]), rtol=1e-6)


def test_the_cli_runs_fedfomo(tmp_path):
    assert_cli_runs("fedfomo", tmp_path, "--fedfomo.num-update-clients", "2")
