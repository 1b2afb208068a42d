"""core.cost: the FLOP count of a training step, the padding of each backend, and the backend choice it drives
on an accelerator (the CPU's choice is unchanged)."""
import numpy as np
import optax
import pytest

from jaxfl.algorithms import build_algorithm
from jaxfl.core import cost
from jaxfl.core.trainer import LocalTrainer, normalizer
from jaxfl.core.types import RunContext
from jaxfl.data.ragged import RaggedClients
from jaxfl.models import build_model
from jaxfl.run import runner
from jaxfl.run.config import RunConfig, validate


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


def test_cohort_padding_by_hand():
    counts = np.array([10, 10, 40])  # steps 1, 1, 4 at batch 10; 60 real samples
    # stacked: 3 lanes run the longest client's 4 steps: 120 / 60; ragged (vmap): a bucket of the 4-step client,
    # one of the two 1-step clients: 60 / 60; map: every client its own steps in both
    assert cost.cohort_padding(counts, 10, 3, strategy="vmap", chunk_size=8) == (2.0, 1.0)
    assert cost.cohort_padding(counts, 10, 3, strategy="map", chunk_size=8) == (1.0, 1.0)
    # a partial last batch is computed whole: 3 clients of 15 samples at batch 10 run 2 steps each
    assert cost.cohort_padding(np.array([15, 15, 15]), 10, 3, strategy="vmap", chunk_size=8) == (60 / 45, 60 / 45)


@pytest.mark.parametrize("workload, stacked_padding, ragged_padding, flops, sample_bytes, stacked_won", [
    # one H200 (benchmarks/RESULTS.md, sessions 18-19): measured paddings, this module's FLOPs, uint8 inputs
    ("logreg cohort 100", 2.134, 1.275, 3.14e4, 788, True),      # stacked 3.5M vs ragged 0.86M samples/s
    ("2nn cohort 1000", 3.101, 1.303, 8.81e5, 788, True),        # 1.95M vs 1.21M
    ("femnist_cnn cohort 100", 2.380, 1.344, 1.03e8, 788, False),  # 50k vs 62k
    ("char_lstm cohort 100", 8.886, 1.576, 2.31e8, 324, False),  # 6.8k vs 9.7k
])
def test_the_balance_picks_the_backend_that_won_on_the_h200(workload, stacked_padding, ragged_padding, flops,
                                                            sample_bytes, stacked_won):
    extra = cost.stacked_extra_flops_per_byte(stacked_padding, ragged_padding, flops, sample_bytes)
    assert extra == pytest.approx((stacked_padding - ragged_padding) * flops / sample_bytes)
    assert cost.stacked_is_cheaper(stacked_padding, ragged_padding, flops, sample_bytes) == stacked_won
    assert cost.stacked_is_cheaper(stacked_padding, ragged_padding, flops, sample_bytes, balance=extra)  # <=


def uneven_population(n=40, seed=0):
    counts = np.maximum(1, np.random.default_rng(seed).lognormal(np.log(30), 1.0, n).astype(np.int64))
    total = int(counts.sum())
    x = np.zeros((total, 28, 28, 1), np.uint8)
    return RaggedClients(x, np.zeros(total, np.int32), np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)


@pytest.mark.parametrize("model_name, on_accelerator, expected", [
    ("logreg", True, "stacked"),        # padding a tiny model's steps is cheaper than moving its data
    ("femnist_cnn", True, "ragged"),    # a CNN's padded steps cost more than the transfers
    ("logreg", False, "ragged"),        # on the CPU: uneven clients under vmap -> ragged, as before
])
def test_choose_backend_on_uneven_clients(monkeypatch, model_name, on_accelerator, expected):
    monkeypatch.setattr(runner, "platform", lambda: "gpu" if on_accelerator else "cpu")
    train = uneven_population()
    steps = -(-train.counts // 10)
    assert steps.max() > 1.25 * steps.mean()  # too uneven for the plain rule
    cfg = validate(RunConfig(algorithm="fedavg", batch_size=10, strategy="vmap"))
    model = build_model(model_name, 62 if model_name == "femnist_cnn" else 10)
    trainer = LocalTrainer(optax.sgd(0.1), 10, 1, normalizer())
    alg = build_algorithm(cfg.algorithm_options(), model, trainer, RunContext(num_clients=40, num_rounds=1))
    choice = runner.choose_backend(cfg, train, alg, train.x[:1], model, normalizer(), cohort=20)
    assert choice == expected


@pytest.mark.parametrize("model_name", ["vit_tiny", "resnet10_slim"])
def test_train_flops_of_models_with_dropout_or_batchnorm(model_name):
    # dropout needs its own key in train mode; BatchNorm's statistics are updated state: both are lowered
    one = cost.train_flops_per_sample(build_model(model_name, 10), np.zeros((1, 32, 32, 3), np.uint8), 2, normalizer())
    two = cost.train_flops_per_sample(build_model(model_name, 10), np.zeros((1, 32, 32, 3), np.uint8), 4, normalizer())
    assert one > 1e6 and two == pytest.approx(one, rel=0.05)  # per sample: independent of the batch
