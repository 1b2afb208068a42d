"""The evaluation protocols: --eval-model, --eval-clients, --new-clients (``jaxfl.run.evaluation``)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bit_identity, make_separable, make_trainer, ragged, rounding_tolerance, setup_algorithm

from jaxfl.algorithms import REGISTRY, build_algorithm
from jaxfl.core.evaluate import Evaluator
from jaxfl.core.step import cohort_train
from jaxfl.core.types import RunContext
from jaxfl.data.federated import FederatedDataset
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn, vit_small
from jaxfl.run.cli import main
from jaxfl.run.config import RunConfig, validate
from jaxfl.run.evaluation import InitialStates, held_out, on_rows, prefixed, split_clients
from jaxfl.run.runner import Experiment, eval_record, summarize

COUNTS = (24, 17, 9, 30, 12)


def test_held_out_clients_are_a_seeded_sorted_subset():
    a = held_out(0, 50, 7)
    assert len(a) == 7 and len(set(a.tolist())) == 7 and np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 50
    np.testing.assert_array_equal(a, held_out(0, 50, 7))  # the seed fixes it
    assert any(not np.array_equal(a, held_out(s, 50, 7)) for s in (1, 2, 3))
    assert len(held_out(0, 50, 0)) == 0
    # uniform: over many seeds every client is held out about k/N of the time
    freq = np.bincount(np.concatenate([held_out(s, 10, 3) for s in range(300)]), minlength=10) / 300
    np.testing.assert_allclose(freq, 0.3, atol=0.1)


def test_split_clients_partitions_names_and_both_splits_in_order():
    ds = FederatedDataset("toy", [f"c{i}" for i in range(5)], [(np.full((i + 1, 2), i), np.arange(i + 1))
                                                               for i in range(5)],
                          [(np.full((2, 2), 10 + i), np.arange(2)) for i in range(5)], num_classes=3)
    train, new = split_clients(ds, np.array([1, 3]))
    assert train.client_names == ["c0", "c2", "c4"] and new.client_names == ["c1", "c3"]
    assert [t[0][0, 0] for t in train.train] == [0, 2, 4] and [t[0][0, 0] for t in new.test] == [11, 13]
    assert new.num_classes == 3 and train.name == "toy"


def test_rows_not_evaluated_are_null_and_out_of_the_means():
    m = {"accuracy": np.array([0.5, 1.0]), "loss": np.array([1.0, 2.0]), "count": np.array([4, 6])}
    full = on_rows(m, np.array([3, 0]), 5)
    np.testing.assert_array_equal(full["count"], [6, 0, 0, 4, 0])
    rec = eval_record(full)
    assert rec["test_accuracy"] == [1.0, None, None, 0.5, None]
    assert rec["mean_accuracy"] == pytest.approx(0.75)
    assert rec["weighted_accuracy"] == pytest.approx((0.5 * 4 + 1.0 * 6) / 10)
    assert set(prefixed(rec, "new_")) == {"new_" + k for k in rec}
    # the summary's per-client best and means skip a client never evaluated
    hist = [dict(rec, round=1), dict(eval_record(on_rows(m, np.array([1, 3]), 5)), round=2)]
    s = summarize(hist, [f"c{i}" for i in range(5)])
    assert s["best_per_client"]["accuracy"] == [1.0, 0.5, None, 1.0, None]
    assert s["best_per_client"]["mean_accuracy"] == pytest.approx(2.5 / 3)


def evaluator(alg, test, train, **kw):
    return Evaluator(alg, ragged(test), eval_batch_size=8, preprocess=make_trainer().preprocess, train=ragged(train),
                     **kw)


def test_an_evaluation_of_some_rows_equals_those_rows_of_the_full_one():
    alg, data, server, clients = setup_algorithm("fedrep", small_cnn(num_classes=4, width=4, hidden=(8,)), COUNTS)
    clients = jax.tree_util.tree_map(  # different heads per client, so that a row mix-up shows
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(1), a.shape), clients)
    test = make_separable(COUNTS, m=16, seed=1)
    whole = evaluator(alg, test, data)
    full = lambda s, c: {k: whole.metrics(s, c)[k] for k in ("accuracy", "loss")}  # noqa: E731 (one compiled program)
    want, tol = full(server, clients), rounding_tolerance(full, server, clients)
    some = evaluator(alg, test, data, block=2).metrics(server, clients, rows=[4, 1, 2])
    for k in ("accuracy", "loss"):  # another program (blocks of 2): equal up to float32 rounding of the full one
        np.testing.assert_allclose(some[k], want[k][[4, 1, 2]], atol=tol[k], rtol=0)
    np.testing.assert_array_equal(some["count"], whole.metrics(server, clients)["count"][[4, 1, 2]])


def test_the_global_model_of_a_method_without_client_state_is_its_personal_model():
    alg, data, server, clients = setup_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), COUNTS)
    test = make_separable(COUNTS, m=16, seed=1)
    ev = evaluator(alg, test, data)
    np.testing.assert_array_equal(ev.metrics(server, clients)["accuracy"],
                                  ev.metrics(server, InitialStates(alg.init(jax.random.key(0), data.x[0])[1]))[
                                      "accuracy"])


def test_a_local_update_before_evaluating_uses_each_clients_own_key_whatever_the_blocks():
    alg, data, server, clients = setup_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), COUNTS)
    test = make_separable(COUNTS, m=16, seed=1)
    train = jax.jit(cohort_train(alg, num_rounds=3))
    root = jax.random.key(5)
    tune = lambda s, c, d, ids: train(s, c, d, ids, 2, root)[0]  # noqa: E731
    initial = InitialStates(alg.init(jax.random.key(0), data.x[0])[1])
    one = evaluator(alg, test, data, first_id=7).metrics(server, initial, "trained", tune=tune)
    blocks = evaluator(alg, test, data, first_id=7, block=2).metrics(server, initial, "trained", tune=tune)
    for k in ("accuracy", "loss"):
        np.testing.assert_allclose(one[k], blocks[k], rtol=1e-4, atol=1e-5)
    untuned = evaluator(alg, test, data).metrics(server, initial)
    assert not np.allclose(one["loss"], untuned["loss"])  # the update ran
    # the ids the update saw are first_id + row: other ids, other keys, other minibatch orders
    other = evaluator(alg, test, data, first_id=0).metrics(server, initial, "trained", tune=tune)
    assert not np.allclose(one["loss"], other["loss"])


def algorithm_model(name):
    if name == "fedtp":
        return vit_small(num_classes=4, depth=1, dim=16, heads=2, dim_head=8, mlp_dim=16)
    return small_cnn(num_classes=4, width=4, hidden=(8,))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_server_client_rows_is_set_exactly_where_the_server_state_grows_with_the_population(name):
    """The claim ``Options.server_client_rows`` makes (which --new-clients refuses) against the server state's
    shapes for populations of 3 and 5 clients."""
    opts = dict(embed_dim=4, hyper_hidden=8, hyper_layers=1) if name == "fedtp" else {}

    def server_shapes(n):
        alg = build_algorithm(name, algorithm_model(name), make_trainer(), RunContext(num_clients=n, num_rounds=4),
                              **opts)
        server, _ = jax.eval_shape(alg.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1), jnp.uint8))
        return [leaf.shape for leaf in jax.tree_util.tree_leaves(server)]
    assert (server_shapes(3) != server_shapes(5)) == REGISTRY[name].options.server_client_rows


TINY = dict(dataset="default", model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30,
            batch_size=16, eval_batch_size=32, lr=0.05)


def test_the_protocol_options_are_checked():
    with pytest.raises(ConfigError, match="unknown eval_model 'best'; valid: personal, global, both"):
        validate(RunConfig(eval_model="best"))
    with pytest.raises(ConfigError, match="unknown eval_clients 'some'"):
        validate(RunConfig(eval_clients="some"))
    with pytest.raises(ConfigError, match="new_clients=-1 must be an integer >= 0"):
        validate(RunConfig(new_clients=-1))
    with pytest.raises(ConfigError, match="--new-clients 1: pfedhn's server keeps a row per training client.*fedavg"):
        validate(RunConfig(algorithm="pfedhn", new_clients=1))
    with pytest.raises(ConfigError, match="--dataset default has 3 clients, and at least one must train; hold out "
                                          "at most 2"):
        Experiment(RunConfig(new_clients=3, **TINY))


def test_cli_new_clients_global_model_and_cohort_evaluation(tmp_path, capsys):
    """The CLI's path: 6 clients (3 domains split in 2), 2 held out, 2 of the 4 others a round. metrics.jsonl:
    the personal and global models of the 2 clients of the evaluated round (the others null), the held-out
    clients with the global model and after one local update; summary.json names the held-out clients; compare
    reads the new fields."""
    out = tmp_path / "run"
    args = ["run", "--algorithm", "fedper", "--clients-per-domain", "2", "--clients-per-round", "2", "--rounds", "2",
            "--new-clients", "2", "--eval-model", "both", "--eval-clients", "cohort", "--model", "small_cnn",
            "--image-size", "12", "--samples-per-client", "40", "--test-per-client", "30", "--batch-size", "16",
            "--lr", "0.05", "--out", str(out)]
    assert main(args) == 0
    assert "new, tuned" in capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    names = summary["clients"]
    assert len(names) == 4 and len(summary["new_clients"]) == 2 and not set(names) & set(summary["new_clients"])
    for r in recs:
        for prefix in ("", "global_"):
            acc = r[prefix + "test_accuracy"]
            assert len(acc) == 4 and sum(a is not None for a in acc) == 2  # the round's cohort only
            assert r[prefix + "mean_accuracy"] == pytest.approx(np.mean([a for a in acc if a is not None]))
        for prefix in ("new_", "new_tuned_"):
            assert len(r[prefix + "test_accuracy"]) == 2 and None not in r[prefix + "test_accuracy"]
    assert {"global", "new", "new_tuned"} <= set(summary)
    capsys.readouterr()
    assert main(["compare", str(out), "--key", "new_tuned_mean_accuracy"]) == 0
    tuned = 100 * recs[-1]["new_tuned_mean_accuracy"]
    assert f"{tuned:.2f}" in capsys.readouterr().out


def test_a_personalized_method_beats_its_global_model_on_its_clients_and_a_local_update_helps_new_ones():
    """FedPer on domain clients: each client's own head beats the global model (the shared body with the
    initial head) on the training clients; on clients held out of training the global model is as poor, and one
    local update from it (training the head on the client's data) recovers most of the personal accuracy."""
    cfg = RunConfig(algorithm="fedper", clients_per_domain=4, rounds=6, new_clients=3, eval_model="both",
                    local_epochs=3, **dict(TINY, samples_per_client=60))  # (personal 0.40, global 0.11, new 0.11,
    #                                                                       tuned 0.38 on an EPYC)
    last = Experiment(cfg).run().history[-1]
    assert last["mean_accuracy"] > last["global_mean_accuracy"] + 0.2, last
    assert last["new_tuned_mean_accuracy"] > last["new_mean_accuracy"] + 0.2, last


@bit_identity("the resumed run evaluates the same states with the same programs as the uninterrupted one")
def test_a_run_with_new_clients_resumes_to_the_same_evaluations(tmp_path):
    cfg = RunConfig(algorithm="fedavg", clients_per_domain=2, rounds=3, new_clients=2, eval_model="both", **TINY)
    full = Experiment(cfg).run().history
    Experiment(cfg.replace(rounds=2, out=str(tmp_path), checkpoint_every=1)).run()
    resumed = Experiment(cfg.replace(out=str(tmp_path), checkpoint_every=1, resume=True)).run().history
    for key in ("new_tuned_test_accuracy", "new_test_accuracy", "global_test_accuracy", "test_accuracy"):
        assert resumed[-1][key] == full[-1][key], key  # the same programs on the same states: bit for bit


@pytest.mark.parametrize("name, holds", [("fedavg", True), ("ditto", True), ("fedper", True), ("fedbn", True),
                                         ("fedproto", False), ("pfedhn", False)])
def test_holds_model_tells_a_server_that_keeps_a_whole_model(name, holds):
    from jaxfl.core.trainer import normalizer
    from jaxfl.run.evaluation import holds_model
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    alg = build_algorithm(name, model, make_trainer(), RunContext(num_clients=3, num_rounds=4))
    x = jnp.zeros((1, 12, 12, 3), jnp.uint8)
    assert holds_model(jax.eval_shape(alg.init, jax.random.key(0), x)[0], model, normalizer()(x)) == holds


def test_the_global_model_is_the_servers_whatever_the_clients_hold():
    """Ditto keeps a whole personal model per client; its global model is the server's FedAvg model (not a
    client's initial personal model), so it learns; FedAvg's global and personal models are one."""
    ditto = Experiment(RunConfig(algorithm="ditto", clients_per_domain=2, rounds=4, eval_model="both", **TINY))
    last = ditto.run().history[-1]
    initial = Experiment(RunConfig(algorithm="ditto", clients_per_domain=2, rounds=1, eval_model="both",
                                   **TINY)).run().history[0]
    assert last["global_mean_accuracy"] > initial["global_mean_accuracy"] + 0.1
    fedavg = Experiment(RunConfig(algorithm="fedavg", rounds=2, eval_model="both", **TINY)).run().history[-1]
    # the global evaluation applies the server's parameters, the personal one each client's copy of them: other
    # programs, equal up to float32 rounding, which can flip a prediction whose two largest logits tie to within
    # it: at most a sample of a client's 30 (``TINY``'s test_per_client); the losses, means of 30
    # cross-entropies, agree to float32 rounding
    np.testing.assert_allclose(fedavg["global_test_accuracy"], fedavg["test_accuracy"], atol=1 / 30 + 1e-9, rtol=0)
    np.testing.assert_allclose(fedavg["global_test_loss"], fedavg["test_loss"], rtol=64 * np.finfo(np.float32).eps)
    with pytest.raises(ConfigError, match="--eval-model global: fedproto's server holds no whole small_cnn"):
        Experiment(RunConfig(algorithm="fedproto", eval_model="global", **TINY))


def test_new_client_steps_caps_the_held_out_clients_update(capsys):
    from jaxfl.core.types import RoundInfo
    from jaxfl.data.clients import ClientData
    cfg = RunConfig(algorithm="fedavg", clients_per_domain=2, rounds=1, new_clients=2, new_client_steps=3,
                    local_epochs=2, **TINY)
    exp = Experiment(cfg)
    assert exp.tuner.local_update is not exp.algorithm.local_update
    server, _ = exp.init()
    x, y = exp.new_dataset.train[0]
    data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.int32(len(y)))  # 40 samples, batch 16: 3 steps an epoch
    _, m = exp.tuner.local_update(server, exp._tune_start.client, data, jax.random.key(0),
                                  RoundInfo(jnp.int32(0), jnp.int32(6), 1))
    assert float(m["steps"]) == 3  # (2 epochs would be 6)
    with pytest.raises(ConfigError, match="--new-client-steps 3: no client is held out"):
        validate(RunConfig(new_client_steps=3))
    with pytest.raises(ConfigError, match="new_client_steps=0 must be an integer >= 1"):
        validate(RunConfig(new_clients=1, new_client_steps=0))
    last = exp.run().history[-1]
    assert len(last["new_tuned_test_accuracy"]) == 2


def test_compare_names_the_held_out_clients_for_their_columns(tmp_path, capsys):
    cfg = RunConfig(algorithm="fedavg", clients_per_domain=2, rounds=1, new_clients=2, out=str(tmp_path / "r"),
                    **TINY)
    result = Experiment(cfg).run()
    held = json.loads((tmp_path / "r" / "summary.json").read_text())["new_clients"]
    assert held == result.new_clients and len(held) == 2
    assert main(["compare", str(tmp_path / "r"), "--key", "new_mean_accuracy", "--per-client"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert all(name in head for name in held) and not any(name in head for name in result.client_names)
