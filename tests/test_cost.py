"""core.cost: the FLOP count of a training step, the round-time model of each backend, and the backend choice it
drives on an accelerator (the CPU's choice is unchanged)."""
import os
import sys
from pathlib import Path

import numpy as np
import optax
import pytest

from jaxfl.algorithms import build_algorithm
from jaxfl.core import cost
from jaxfl.core.cohort import Chunked
from jaxfl.core.trainer import LocalTrainer, normalizer
from jaxfl.core.types import RunContext
from jaxfl.errors import ConfigError
from jaxfl.data.ragged import RaggedClients
from jaxfl.models import build_model
from jaxfl.run import build, runner
from jaxfl.run.config import RunConfig, validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import backend_model  # noqa: E402


IMAGE = np.zeros((1, 28, 28, 1), np.uint8)


def test_train_flops_of_a_linear_model_by_hand():
    # logreg 784 -> 10 on a batch B: forward x W (2 * 784 * 10 per sample) and dW = x^T g (the same again),
    # plus O(10) elementwise work per sample (bias, square, its gradient)
    f = cost.train_flops_per_sample(build_model("logreg", 10), IMAGE, 10, normalizer())
    assert 4 * 784 * 10 <= f <= 4 * 784 * 10 + 100
    # the 2NN 784-200-200-10: forward 2 * sum(in * out), weight gradients the same, input gradients of the two
    # hidden layers 2 * (200 * 200 + 200 * 10); elementwise work below 1%
    macs = 784 * 200 + 200 * 200 + 200 * 10
    f2 = cost.train_flops_per_sample(build_model("mlp_2nn", 10), IMAGE, 10, normalizer())
    hand = 4 * macs + 2 * (200 * 200 + 200 * 10)
    assert hand <= f2 <= 1.01 * hand


def test_calls_of_each_backend_by_hand():
    steps = [1, 1, 4]  # e.g. 10, 10 and 40 samples at batch 10
    # stacked: one call whose 3 lanes step until the longest client is done; map: each client its own steps
    assert cost.stacked_calls(steps, "vmap") == [(3, 4)]
    assert cost.stacked_calls(steps, "map") == [(1, 1), (1, 1), (1, 4)]
    assert cost.stacked_calls([5, 1, 4, 2], Chunked(2)) == [(2, 5), (2, 4)]  # cohort order
    # ragged: a bucket of the 4-step client, one of the two 1-step clients; sent: 1 x 4 + 2 x 1 sample slots
    assert cost.ragged_calls(steps, "vmap") == ([(1, 4), (2, 1)], 6)
    # map: one bucket padded to its longest client (3 x 4 slots sent), every client its own steps
    assert cost.ragged_calls(steps, "map") == ([(1, 1), (1, 1), (1, 4)], 12)
    # a bucket runs to its longest *real* client while its data is padded to the step grid (5 -> 6)
    assert cost.ragged_calls([5], "vmap") == ([(1, 5)], 6)


def test_round_seconds_by_hand():
    rates = cost.DeviceRates(flops_per_s=1e12, step_s=1e-3, host_bytes_per_s=1e6)
    # 4 steps of 3 lanes + 1 step of 2 lanes, 1 GFLOP a lane's step, 2 epochs, 1 MB sent
    t = cost.round_seconds([(3, 4), (2, 1)], 1e9, sent_bytes=1e6, epochs=2, rates=rates)
    assert t == pytest.approx(2 * (4 * (1e-3 + 3e-3) + 1 * (1e-3 + 2e-3)) + 1.0)
    # with no step cost and nothing sent, only FLOPs count: lanes x steps x step FLOPs / P
    assert cost.round_seconds([(3, 4)], 1e9, rates=cost.DeviceRates(1e12, 0.0, 1e6)) == pytest.approx(12e-3)


def test_backend_seconds_adds_up_the_calls_of_a_drawn_cohort():
    counts = np.array([10, 10, 40])  # the whole population in the cohort: every draw is the same
    s, r = cost.backend_seconds(counts, 10, 3, 1e8, 100.0, clients="vmap")
    step = 10 * 1e8
    assert s == pytest.approx(cost.round_seconds([(3, 4)], step))
    assert r == pytest.approx(cost.round_seconds([(1, 4), (2, 1)], step, sent_bytes=6 * 10 * 100.0))
    # map: the same calls on both backends, so stacked (nothing sent) is never slower
    s, r = cost.backend_seconds(counts, 10, 3, 1e8, 100.0, clients="map")
    assert r - s == pytest.approx(12 * 10 * 100.0 / cost.H200.host_bytes_per_s)


def test_the_model_picks_the_backend_that_won_on_every_measured_gpu_pair(data_dir):
    # every stacked/ragged pair measured on the H200 (benchmarks/results/gpu_h200_*; the clients regenerated as
    # those runs drew them): the modelled faster backend is the measured one; without the per-step cost tau,
    # the FedAvg CNN at cohort 10 (padded lanes cheaper than ragged's extra sequential steps) goes wrong
    os.environ.setdefault("JAXFL_DATA_DIR", data_dir)
    pairs = backend_model.measured_pairs()
    rows = [backend_model.evaluate(pair) for pair in pairs]
    assert len(rows) == 10
    assert [r["pick"] for r in rows] == [r["measured"] for r in rows]
    wrong_without_tau = [(r["name"], r["cohort"]) for r in rows if r["pick_without_tau"] != r["measured"]]
    assert wrong_without_tau == [("fedavg_cnn (MNIST Dirichlet 0.3, 100 clients)", 10)]
    # H200's tau and P are what the grid choice makes on all ten; made without each pair, it still picks right
    held = backend_model.held_out(pairs)
    assert [r["pick"] for r in held] == [r["measured"] for r in held]
    assert {(r["tau"], r["flops_per_s"]) for r in held} == {(cost.H200.step_s, cost.H200.flops_per_s)}


def test_run_seconds_and_programs_by_hand():
    rates = cost.DeviceRates(compile_s=3.0)
    assert cost.run_seconds(0.5, 10, 4, rates) == pytest.approx(10 * 0.5 + 4 * 3.0)
    steps = -(-uneven_population().counts // 10)
    # stacked: one round program; ragged: one per class of its bucket grid (at most 8), the grid it runs
    grid = cost.ragged_grid(steps, 20, "vmap")
    assert cost.backend_programs(steps, 20, "vmap") == (1, len(grid.classes))
    assert 1 < len(grid.classes) <= 8
    # map: one bucket a cohort padded to its longest client's grid length: at most one per grid length
    from jaxfl.core.buckets import grid_ceil_array
    assert cost.backend_programs(steps, 20, "map") == (1, len(set(grid_ceil_array(steps))))


def test_the_whole_run_model_picks_the_faster_measured_run(data_dir):
    # backend_choice.py's four MNIST pairs on the H200 (8 rounds, no compile cache): the whole run was faster
    # stacked on all four, although the FedAvg CNN's ragged rounds were faster at cohort 100; round time alone
    # picks ragged there, round time with each backend's programs to compile (c per program) picks stacked, with
    # H200's c and with c fitted on the other three pairs
    os.environ.setdefault("JAXFL_DATA_DIR", data_dir)
    rows = backend_model.compile_fit(backend_model.measured_pairs())
    assert len(rows) == 4 and {r["measured_run"] for r in rows} == {"stacked"}
    assert [r["run_pick"] for r in rows] == [r["measured_run"] for r in rows]
    assert [r["held_out_pick"] for r in rows] == [r["measured_run"] for r in rows]
    assert [r["round_pick"] for r in rows].count("ragged") == 1
    # H200's c is within 2x of every pair's fitted c (seconds per extra bucket program)
    assert all(0.5 <= r["c"] / cost.H200.compile_s <= 2.0 for r in rows)


def test_a_short_run_keeps_the_backend_that_compiles_less(monkeypatch):
    # the FedAvg-sized CNN on uneven clients, one vmap: the ragged backend's rounds are modelled faster, but
    # its bucket programs cost more to compile than a few rounds save
    monkeypatch.setattr(build, "platform", lambda: "gpu")
    train = uneven_population()
    model = build_model("femnist_cnn", 62)
    picks = {}
    for rounds in (1, 10_000):
        cfg = validate(RunConfig(algorithm="fedavg", batch_size=10, strategy="vmap", lane_segments=0, rounds=rounds))
        trainer = LocalTrainer(optax.sgd(0.1), 10, 1, normalizer())
        alg = build_algorithm(cfg.algorithm_options(), model, trainer, RunContext(num_clients=40, num_rounds=1))
        picks[rounds] = build.choose_backend(cfg, train, alg, train.x[:1], model, normalizer(), cohort=20)
    assert picks == {1: "stacked", 10_000: "ragged"}


def uneven_population(n=40, seed=0):
    counts = np.maximum(1, np.random.default_rng(seed).lognormal(np.log(30), 1.0, n).astype(np.int64))
    total = int(counts.sum())
    x = np.zeros((total, 28, 28, 1), np.uint8)
    return RaggedClients(x, np.zeros(total, np.int32), np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)


@pytest.mark.parametrize("model_name, on_accelerator, segments, expected", [
    ("logreg", True, 0, "stacked"),        # one vmap: padding a tiny model's steps is cheaper than moving its data
    ("femnist_cnn", True, 0, "ragged"),    # one vmap: a CNN's padded steps cost more than the transfers (and,
                                           # over a long run, than compiling the bucket programs)
    ("logreg", False, 0, "ragged"),        # one vmap on the CPU: uneven clients -> ragged
    ("femnist_cnn", True, 3, "stacked"),   # a lane plan runs uneven clients without padded lanes, in one program
    ("logreg", False, 3, "stacked"),
])
def test_choose_backend_on_uneven_clients(monkeypatch, model_name, on_accelerator, segments, expected):
    monkeypatch.setattr(build, "platform", lambda: "gpu" if on_accelerator else "cpu")
    train = uneven_population()
    steps = -(-train.counts // 10)
    assert steps.max() > 1.25 * steps.mean()  # too uneven for the plain rule
    cfg = validate(RunConfig(algorithm="fedavg", batch_size=10, strategy="vmap", lane_segments=segments,
                             rounds=10_000))
    model = build_model(model_name, 62 if model_name == "femnist_cnn" else 10)
    trainer = LocalTrainer(optax.sgd(0.1), 10, 1, normalizer())
    alg = build_algorithm(cfg.algorithm_options(), model, trainer, RunContext(num_clients=40, num_rounds=1))
    choice = build.choose_backend(cfg, train, alg, train.x[:1], model, normalizer(), cohort=20)
    assert choice == expected


@pytest.mark.parametrize("segments, store, expected", [
    (3, "auto", "streamed"),   # a lane plan runs the cohort in one call: the cohort streamed, one program a size
    (0, "auto", "ragged"),     # one vmap over uneven clients: buckets of similar clients instead
    (3, "host", "streamed"),   # the states on the host, asked for, although the population would fit
])
def test_choose_backend_for_a_population_on_the_host(monkeypatch, segments, store, expected):
    train = uneven_population()
    fits = store == "host"
    monkeypatch.setattr(build, "platform", lambda: "cpu")
    monkeypatch.setattr(build, "device_memory_bytes", lambda: 1 << 40 if fits else 4 * train.nbytes // 2)
    cfg = validate(RunConfig(algorithm="fedavg", batch_size=10, strategy="vmap", lane_segments=segments,
                             client_store=store))
    model = build_model("logreg", 10)
    alg = build_algorithm(cfg.algorithm_options(), model, LocalTrainer(optax.sgd(0.1), 10, 1, normalizer()),
                          RunContext(num_clients=40, num_rounds=1))
    assert build.choose_backend(cfg, train, alg, train.x[:1], model, normalizer(), cohort=20) == expected
    with pytest.raises(ConfigError, match="rounds_per_call=2 needs the population on the device"):
        build.choose_backend(cfg.replace(rounds_per_call=2), train, alg, train.x[:1], model, normalizer(), cohort=20)


@pytest.mark.parametrize("model_name", ["vit_tiny", "resnet10_slim"])
def test_train_flops_of_models_with_dropout_or_batchnorm(model_name):
    # dropout needs its own key in train mode; BatchNorm's statistics are updated state: both are lowered
    one = cost.train_flops_per_sample(build_model(model_name, 10), np.zeros((1, 32, 32, 3), np.uint8), 2, normalizer())
    two = cost.train_flops_per_sample(build_model(model_name, 10), np.zeros((1, 32, 32, 3), np.uint8), 4, normalizer())
    assert one > 1e6 and two == pytest.approx(one, rel=0.05)  # per sample: independent of the batch


def test_train_flops_refuses_a_missing_flop_count(monkeypatch):
    # a GPU plugin's Lowered.cost_analysis() returns None: read as 0 FLOPs it made every GPU run pick stacked
    import jax.stages
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    with pytest.raises(ValueError, match="no FLOP count"):
        cost.train_flops_per_sample(build_model("logreg", 10), IMAGE, 10, normalizer())


def test_the_lane_plan_overhead_is_computed_only_for_the_backends_that_plan_lanes(monkeypatch, tmp_path):
    # (an XLA cost analysis of the model on an accelerator: not for the ragged backend, which has no lane plan)
    calls = []
    real = build.lane_overhead
    monkeypatch.setattr(build, "lane_overhead", lambda *a: calls.append(1) or real(*a))
    base = dict(algorithm="fedavg", model="logreg", dataset="default", image_size=12, samples_per_client=40,
                test_per_client=30, batch_size=16, rounds=1, strategy="vmap")
    ragged = runner.Experiment(RunConfig(**base, backend="ragged", out=str(tmp_path / "r")))
    assert ragged.backend_name == "ragged" and calls == []
    stacked = runner.Experiment(RunConfig(**base, backend="stacked", out=str(tmp_path / "s")))
    assert stacked.backend_name == "stacked" and calls == [1]


def test_lane_overhead_is_the_launch_latency_in_lane_steps_up_to_its_cap():
    # tau P / (B f) by hand at the H200 constants (tau 0.2 ms, P 10 TFLOP/s), then the cap for small models
    rates = cost.H200
    assert cost.lane_overhead(1e8, 10) == pytest.approx(rates.step_s * rates.flops_per_s / 1e9)  # 2.0 lanes
    assert cost.lane_overhead(1e6, 10) == cost.MAX_LANE_OVERHEAD == 32.0  # uncapped: 200
    assert cost.lane_overhead(1e6, 10, cap=float("inf")) == pytest.approx(200.0)
    assert cost.lane_overhead(1e6, 10, cap=50.0) == 50.0
