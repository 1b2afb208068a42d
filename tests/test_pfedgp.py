"""pFedGP: its class tree, its held-out split, prediction from a client's own training set, and a run."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import evaluator, make_trainer

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.pfedgp import class_tree, predict_half, two_means_split
from jaxfl.core.evaluate import make_evaluate
from jaxfl.data.clients import ClientData
from jaxfl.models import small_cnn
from jaxfl.run.reliability import reliability_report


FAST = dict(train_draws=4, test_draws=6, gibbs_steps=3)


def brute_force_split(means, members):
    idx = [i for i in range(len(members)) if members[i]]
    best, best_left = np.inf, None
    for r in range(1, len(idx)):
        for left in itertools.combinations(idx, r):
            right = [i for i in idx if i not in left]
            cost = sum(((means[s] - means[s].mean(0)) ** 2).sum() for s in (list(left), right))
            if cost < best - 1e-9:
                best, best_left = cost, set(left)
    return best_left if min(idx) in best_left else set(idx) - best_left


@pytest.mark.parametrize("seed", range(5))
def test_two_means_split_is_the_exact_optimum(seed):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(7, 3)).astype(np.float32)
    members = rng.random(7) < 0.8
    members[:3] = True
    got = np.asarray(jax.jit(two_means_split)(jnp.asarray(means), jnp.asarray(members)))
    assert set(np.flatnonzero(got)) == brute_force_split(means.astype(np.float64), members)


def test_two_means_split_beyond_the_exact_range_is_a_proper_split_of_separated_groups():
    rng = np.random.default_rng(0)
    means = np.concatenate([rng.normal(size=(8, 2)) + 10, rng.normal(size=(8, 2)) - 10]).astype(np.float32)
    members = np.ones(16, bool)
    members[[3, 12]] = False
    got = np.asarray(two_means_split(jnp.asarray(means), jnp.asarray(members)))  # 16 classes: Lloyd
    np.testing.assert_array_equal(got, (np.arange(16) < 8) & members)


def test_class_tree_splits_groups_first_and_has_one_node_per_present_class_but_one():
    # classes 0, 1 near each other, 3, 4 near each other, far apart; class 2 absent
    means = np.array([[10, 0], [10, 1], [0, 0], [-10, 0], [-10, 1]], np.float32)
    present = np.array([1, 1, 0, 1, 1], bool)
    members, left, active = jax.jit(class_tree)(jnp.asarray(means), jnp.asarray(present))
    members, left, active = map(np.asarray, (members, left, active))
    assert active.sum() == 3
    np.testing.assert_array_equal(members[0], present)
    np.testing.assert_array_equal(left[0], [1, 1, 0, 0, 0])  # the lower group goes left
    children = {tuple(np.flatnonzero(m)) for m in members[1:3]}
    assert children == {(0, 1), (3, 4)}
    for i in (1, 2):
        assert left[i].sum() == 1 and left[i][np.flatnonzero(members[i])[0]]  # two classes: the lower left
    # two slots: the second group finds no slot and stays a leaf with both its classes
    members2, _, active2 = class_tree(jnp.asarray(means), jnp.asarray(present), 2)
    assert members2.shape == (2, 5) and int(jnp.sum(active2)) == 2
    np.testing.assert_array_equal(members2[1], [1, 1, 0, 0, 0])
    # a client with two classes: one node
    members, left, active = class_tree(jnp.asarray(means), jnp.asarray([0, 1, 0, 1, 0], bool))
    assert int(jnp.sum(active)) == 1
    np.testing.assert_array_equal(left[0], [0, 1, 0, 0, 0])


def test_predict_half_holds_out_floor_ratio_of_each_class_among_real_samples():
    y = jnp.asarray([0, 0, 0, 1, 1, 1, 1, 1, 2, 0, 1])
    w = jnp.asarray([1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], jnp.float32)  # the last two are padding
    for seed in range(3):
        held = np.asarray(predict_half(jax.random.key(seed), y, w, 0.5))
        assert not held[9:].any()
        assert [held[np.asarray(y) == c].sum() for c in range(3)] == [1, 2, 0]


def client(seed=0, m=24, classes=(0, 2)):
    """A client whose classes are separable in input space (a bright and a dark image class)."""
    rng = np.random.default_rng(seed)
    y = np.asarray(classes)[np.arange(m) % len(classes)]
    x = rng.uniform(0, 60, size=(m, 8, 8, 3)) + 150 * (y == classes[0])[:, None, None, None]
    return x.astype(np.float32), y.astype(np.int32)


def test_a_client_predicts_its_own_classes_from_its_training_set_and_padding_changes_nothing():
    alg = build_algorithm("pfedgp", small_cnn(num_classes=4, width=4), make_trainer(), **FAST)
    x, y = client()
    server, state = alg.init(jax.random.key(0), jnp.asarray(x))
    xt, yt = client(seed=1, m=16)
    train = ClientData(jnp.asarray(x)[None], jnp.asarray(y)[None], jnp.asarray([24]))
    test = ClientData(jnp.asarray(xt)[None], jnp.asarray(yt)[None], jnp.asarray([16]))
    evaluate = jax.jit(make_evaluate(alg, eval_batch_size=8))
    ev = evaluate(server, {}, test, train=train)
    assert float(ev["accuracy"][0]) >= 0.9  # an untrained network still separates these; the GP does the rest
    with pytest.raises(ValueError, match="training set"):
        make_evaluate(alg, eval_batch_size=8)(server, {}, test)
    rep = reliability_report(evaluator(alg, test, train), server, {}, jax.random.key(2))
    np.testing.assert_allclose(rep["accuracy"][0], float(ev["accuracy"][0]), atol=1 / 16 + 1e-6)
    assert np.isfinite(rep["ece"][0]) and len(rep["u_clean"][0]) == 16
    # the probabilities: absent classes 0, the client's two sum to 1
    prepare, predict = jax.jit(alg.prepare_predict), jax.jit(alg.predict)  # one compilation each, not op by op
    view = prepare(server, state, ClientData(jnp.asarray(x) / 255.0, jnp.asarray(y), jnp.asarray(24)),
                   jax.random.key(1))
    probs = np.exp(np.asarray(predict(server, view, jnp.asarray(xt) / 255.0)))
    np.testing.assert_allclose(probs[:, [1, 3]], 0.0, atol=1e-20)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    # one GP node is all a two-class client needs: max_nodes=1 predicts the same
    one = build_algorithm("pfedgp", small_cnn(num_classes=4, width=4), make_trainer(), max_nodes=1, **FAST)
    view1 = jax.jit(one.prepare_predict)(server, state, ClientData(jnp.asarray(x) / 255.0, jnp.asarray(y),
                                                                   jnp.asarray(24)), jax.random.key(1))
    np.testing.assert_allclose(np.exp(np.asarray(jax.jit(one.predict)(server, view1, jnp.asarray(xt) / 255.0))),
                               probs, rtol=1e-5, atol=1e-7)
    # padding the training set with garbage rows changes no prediction
    pad = np.concatenate([x, np.full((8,) + x.shape[1:], 255.0, np.float32)]) / 255.0
    y_pad = np.concatenate([y, np.full(8, 3, np.int32)])
    view2 = prepare(server, state, ClientData(jnp.asarray(pad), jnp.asarray(y_pad), jnp.asarray(24)),
                    jax.random.key(1))
    probs2 = np.exp(np.asarray(predict(server, view2, jnp.asarray(xt) / 255.0)))
    assert np.abs(probs2 - probs).max() < 0.1  # other Gibbs draws (the chains' shapes differ), same posterior
    np.testing.assert_array_equal(probs2.argmax(1), probs.argmax(1))


def test_cli_runs_pfedgp(tmp_path, capsys):
    from jaxfl.run.cli import main
    cfg = tmp_path / "run.toml"
    cfg.write_text('algorithm = "pfedgp"\nrounds = 1\nmodel = "small_cnn"\nimage_size = 12\n'
                   'samples_per_client = 20\ntest_per_client = 16\nbatch_size = 16\neval_batch_size = 16\n'
                   '[pfedgp]\ntrain_draws = 4\ntest_draws = 4\ngibbs_steps = 2\nmax_nodes = 2\n')
    code = main(["run", "--config", str(cfg), "--out", str(tmp_path / "run")])
    assert code == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_experiment_reports_pfedgp_reliability_from_each_clients_training_set(tmp_path):
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    exp = Experiment(RunConfig(algorithm="pfedgp", rounds=1, model="small_cnn", image_size=12, samples_per_client=20,
                               test_per_client=16, batch_size=16, eval_batch_size=16, out=str(tmp_path / "run"),
                               options={"pfedgp": {"train_draws": 4, "test_draws": 4, "gibbs_steps": 2,
                                           "max_nodes": 2}}))
    result = exp.run()
    rep = exp.reliability(result.server, result.clients, jax.random.key(3))
    np.testing.assert_allclose(np.mean(rep["accuracy"]), result.history[-1]["mean_accuracy"], atol=0.1)
    assert len(rep["accuracy"]) == exp.test_data.num_clients and all(np.isfinite(rep["auroc_noisy"]))
