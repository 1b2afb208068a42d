"""Server optimizers (FedOpt): each update against a hand computation, the plain mean as the reduction
(SGD at server lr 1, bitwise), and the run option through the CLI's path (state checkpointed, bad input)."""
import json

import jax
import numpy as np
import pytest
from conftest import assert_trees_close, make_data, make_trainer, run_step, bit_identity

from jaxfl.algorithms import build_algorithm
from jaxfl.core.server_opt import STATE_KEY, server_optimizer, server_step, with_server_optimizer
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn
from jaxfl.run.cli import main
from jaxfl.run.config import RunConfig
from jaxfl.run.runner import Experiment

TINY = dict(dataset="default", model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30,
            batch_size=16, eval_batch_size=32, lr=0.05)


def _trees(seed, steps=3):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    means = [jax.tree_util.tree_map(lambda p: (p + rng.normal(size=p.shape) * 0.3).astype(np.float32), x)
             for _ in range(steps)]
    return x, means


def _hand(kind, x, means, lr, b1=0.9, b2=0.99, tau=1e-3, momentum=0.0):
    """Reddi et al. Algorithm 2 in numpy, leaf by leaf, with Delta = mean - x and v_{-1} = tau^2."""
    out = {}
    for k in x:
        p = x[k].astype(np.float64)
        m, v, buf = np.zeros_like(p), np.full_like(p, tau * tau), np.zeros_like(p)
        for mean in means:
            d = mean[k] - p
            if kind == "sgd":
                buf = momentum * buf + d
                p = p + lr * buf
                continue
            m = b1 * m + (1 - b1) * d
            if kind == "adagrad":
                v = v + d * d
            elif kind == "adam":
                v = b2 * v + (1 - b2) * d * d
            else:
                v = v - (1 - b2) * d * d * np.sign(v - d * d)
            p = p + lr * m / (np.sqrt(v) + tau)
        out[k] = p
    return out


@pytest.mark.parametrize("kind,lr,momentum", [("adam", 0.01, 0.0), ("yogi", 0.01, 0.0), ("adagrad", 0.1, 0.0),
                                              ("sgd", 0.7, 0.9), ("sgd", 1.0, 0.0)])
def test_server_step_matches_the_papers_updates(kind, lr, momentum):
    x, means = _trees(1)
    tx = server_optimizer(kind, lr, momentum=momentum)
    step = jax.jit(lambda p, mean, s: server_step(tx, p, mean, s))
    params, state = x, tx.init(x)
    for mean in means:  # each round's aggregate is taken as given (the step does not change the mean)
        params, state = step(params, mean, state)
    want = _hand(kind, x, means, lr, momentum=momentum)
    for k in x:
        np.testing.assert_allclose(np.asarray(params[k]), want[k], rtol=2e-5, atol=2e-6)
    if kind == "sgd" and lr == 1.0 and not momentum:  # the reduction: the new model is the mean, bitwise
        assert all(np.array_equal(np.asarray(params[k]), means[-1][k]) for k in x)


def test_a_leaf_the_algorithm_did_not_aggregate_does_not_move():
    x, _ = _trees(2, 1)
    tx = server_optimizer("adam", 0.5)
    new, _ = server_step(tx, x, x, tx.init(x))  # mean == x: g = 0 (a personal leaf)
    assert_trees_close(new, x, atol=0, rtol=0)


def test_default_server_lrs_and_bad_input_through_the_cli(tmp_path, capsys):
    assert RunConfig(server_opt="adam").resolved().server_lr == 0.01
    assert RunConfig(server_opt="sgd").resolved().server_lr == 1.0
    cases = {("--algorithm", "fedselect", "--server-opt", "adam"):
             "jaxfl: error: --server-opt adam: fedselect's aggregate is not a mean of shared parameters; a server "
             "optimizer composes with: ",
             ("--server-opt", "lamb"): "jaxfl: error: unknown server_opt 'lamb'; valid: none, sgd, adagrad, adam, yogi",
             ("--server-opt", "adam", "--server-lr", "0"): "jaxfl: error: server_lr=0.0 is outside (0.0, inf]",
             ("--server-opt", "yogi", "--server-tau", "nan"): "jaxfl: error: server_tau=nan must be a finite number"}
    for args, message in cases.items():
        out = tmp_path / "run"
        assert main(["run", "--quiet", "--rounds", "1", "--out", str(out), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err
        assert not out.exists()


@bit_identity("server SGD at lr 1 without momentum returns the aggregate itself")
def test_sgd_at_server_lr_one_is_the_algorithm_itself_bitwise():
    plain = Experiment(RunConfig(algorithm="fedper", rounds=2, **TINY)).run()
    sgd = Experiment(RunConfig(algorithm="fedper", rounds=2, server_opt="sgd", server_lr=1.0, **TINY)).run()
    assert_trees_close(plain.server["params"], sgd.server["params"], atol=0, rtol=0)
    assert_trees_close(plain.clients, sgd.clients, atol=0, rtol=0)
    assert [h["test_accuracy"] for h in plain.history] == [h["test_accuracy"] for h in sgd.history]


@pytest.mark.parametrize("name", ["fedala", "feddbe"])
@bit_identity("server SGD at lr 1 without momentum returns the aggregate itself")
def test_sgd_at_server_lr_one_leaves_the_newer_averaging_methods_bitwise_unchanged(name):
    # two of the newer averaging methods whose server differs from FedAvg's (their first two rounds: FedDBE's
    # round 0 keeps the model, FedALA's server holds parameters only); the others' aggregate is FedAvg's mean
    data = make_data([12, 20, 7])
    alg = build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(),
                          RunContext(num_clients=3, num_rounds=4, cohort_size=3))
    wrapped = with_server_optimizer(alg, server_optimizer("sgd", 1.0))
    plain = run_step(alg, data, *init_state(alg, jax.random.key(0), data.x[0], 3), jax.random.key(3), rounds=2,
                     num_rounds=4)
    sgd = run_step(wrapped, data, *init_state(wrapped, jax.random.key(0), data.x[0], 3), jax.random.key(3),
                   rounds=2, num_rounds=4)
    assert_trees_close({k: v for k, v in sgd[0].items() if k != STATE_KEY}, plain[0], atol=0, rtol=0)
    assert_trees_close(sgd[1], plain[1], atol=0, rtol=0)


def test_fedadam_with_fedper_moves_the_shared_body_only_and_resumes_exactly(tmp_path):
    cfg = dict(algorithm="fedper", server_opt="adam", server_lr=0.01, **TINY)
    full = Experiment(RunConfig(rounds=3, **cfg)).run()
    init = Experiment(RunConfig(rounds=3, **cfg)).init()[0]
    # FedPer's head is personal: the server's copy of it gets g = 0 and stays where it started; the body moves
    assert sorted(full.server["params"]) == ["encoder", "head"]
    assert_trees_close(full.server["params"]["head"], init["params"]["head"], atol=0, rtol=0)
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(full.server["params"]["encoder"]),
                                                        jax.tree_util.tree_leaves(init["params"]["encoder"])))
    # the optimizer's state is part of the checkpoint: stopping after round 2 and resuming changes nothing
    out = tmp_path / "run"
    Experiment(RunConfig(rounds=2, out=str(out), checkpoint_every=1, **cfg)).run()
    assert json.loads((out / "config.json").read_text())["server_opt"] == "adam"
    resumed = Experiment(RunConfig(rounds=3, out=str(out), resume=True, **cfg)).run()
    assert_trees_close(full.server, resumed.server, atol=0, rtol=0)
    assert [h["test_accuracy"] for h in full.history] == [h["test_accuracy"] for h in resumed.history]
    with pytest.raises(ConfigError, match=r"the settings differ from the run.s .*config.json. in .*server_opt"):
        Experiment(RunConfig(rounds=4, out=str(out), resume=True, **dict(cfg, server_opt="yogi"))).run()
