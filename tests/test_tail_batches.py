"""Partial last batches at a smaller size (``LocalTrainer.tail_sizes``, ``--tail-batches``): the same local
training up to float rounding, the padded work counted, and the cases that must keep every step at B."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_data, make_trainer, rounding_tolerance

from jaxfl.algorithms._common import ce_loss
from jaxfl.core.buckets import padded_work
from jaxfl.core.trainer import draws_from_key, tail_sizes
from jaxfl.models import cnn_dropout, small_cnn
from jaxfl.ops.augment import make_augment
from jaxfl.run.build import tail_batch_sizes
from jaxfl.run.config import RunConfig

COUNTS = (37, 70, 5, 64, 1, 33)  # partial last batches of every size class at B = 8 and B = 32


def test_tail_sizes_are_b_and_its_halvings_down_to_two():
    assert tail_sizes(32) == (4, 8, 16, 32)
    assert tail_sizes(10) == (2, 3, 5, 10)
    assert tail_sizes(3) == (2, 3)
    assert tail_sizes(1) == (1,)


def test_padded_work_counts_each_last_batch_at_the_smallest_size_that_holds_it():
    counts = np.array([37, 70, 5, 64, 1, 33, 0])
    full, real = padded_work([], counts, 32, per_client_trips=True)
    assert (full, real) == ((2 + 3 + 1 + 2 + 1 + 2) * 32, 210)
    cut, _ = padded_work([], counts, 32, per_client_trips=True, tail_sizes=(4, 8, 16, 32))
    # 37 = 32 + 5 -> 8; 70 = 64 + 6 -> 8; 5 -> 8; 64 = 2 full; 1 -> 4; 33 = 32 + 1 -> 4; 0: no step
    assert cut == (32 + 8) + (64 + 8) + 8 + 64 + 4 + (32 + 4)


def _init(model, data, seed=0):
    variables = model.init(jax.random.key(seed), data.x[0, :1] / 255.0)
    return variables["params"], variables.get("batch_stats", {})


def _train(trainer, model, data, start=None):
    """Each client's local training from ``start`` (params, BN statistics; default ``_init``), one client at a
    time (``lax.map``) under jit: (params, state, metrics) stacked over the clients."""
    params, state = _init(model, data) if start is None else start
    loss = ce_loss(model)

    def one(p0, s0, d, key):
        p, s, _, m = trainer.run(loss, p0, s0, trainer.tx.init(p0), d, key)
        return p, s, m
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.arange(data.count.shape[0]))
    return jax.jit(lambda p, s, d, k: jax.lax.map(lambda a: one(p, s, *a), (d, k)))(params, state, data, keys)


@pytest.mark.parametrize("batch", [8, 32])
def test_a_smaller_last_batch_trains_as_the_full_one_up_to_rounding(batch):
    # small_cnn has BatchNorm: its statistics over the real samples only must not change either
    model, data = small_cnn(num_classes=4, width=4, hidden=(8,)), make_data(list(COUNTS), m=72)
    base = make_trainer(batch_size=batch, epochs=2)
    tail = dataclasses.replace(base, tail_sizes=tail_sizes(batch), tail_log=[])
    want, got = _train(base, model, data), _train(tail, model, data)
    assert tail.tails_in_use() == tail_sizes(batch)  # it did take the smaller sizes
    tol = rounding_tolerance(lambda p, s: _train(base, model, data, (p, s))[:2], *_init(model, data))
    assert_trees_close(got[:2], want[:2], atol=tol, rtol=0)
    for k in ("seen", "steps"):
        np.testing.assert_array_equal(got[2][k], want[2][k])
    np.testing.assert_allclose(got[2]["loss"], want[2]["loss"], rtol=1e-5)


def test_a_loss_that_draws_from_its_key_keeps_every_step_at_b():
    # dropout's masks are drawn with the batch's shape: a smaller batch would draw other masks
    data = make_data([13, 5], m=16, shape=(28, 28, 1))
    model = cnn_dropout(num_classes=4)
    base = make_trainer(batch_size=8)
    tail = dataclasses.replace(base, tail_sizes=tail_sizes(8), tail_log=[])
    assert draws_from_key(ce_loss(model), *_loss_args(model, data))
    want, got = _train(base, model, data), _train(tail, model, data)
    assert tail.tails_in_use() == ()
    assert_trees_close(got[:2], want[:2], atol=0, rtol=0)  # the same program: bit for bit


def test_augmentation_keeps_every_step_at_b():
    data, model = make_data([13, 5], m=16), small_cnn(num_classes=4, width=4)
    tail = dataclasses.replace(make_trainer(batch_size=8), tail_sizes=tail_sizes(8), tail_log=[],
                               augment=make_augment("flip"))
    _train(tail, model, data)
    assert tail.tails_in_use() == ()


def _loss_args(model, data):
    x = data.x[0, :8] / 255.0
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params, state = variables["params"], variables.get("batch_stats", {})
    return params, state, x, data.y[0, :8], jnp.ones(8), jax.random.key(2)


def test_draws_from_key_reads_the_jaxpr_of_a_loss_without_draws():
    data, model = make_data([13, 5], m=16), small_cnn(num_classes=4, width=4)
    assert not draws_from_key(ce_loss(model), *_loss_args(model, data))
    # a key used only by a draw whose value is dropped is dead code: still no draw
    loss = ce_loss(model)
    assert not draws_from_key(lambda *a: (jax.random.normal(a[-1]), loss(*a))[1], *_loss_args(model, data))
    assert draws_from_key(lambda *a: jax.tree_util.tree_map(lambda v: v + jax.random.normal(a[-1]), loss(*a)),
                          *_loss_args(model, data))


def test_the_run_takes_tail_sizes_only_under_map_without_augmentation_and_where_they_pay():
    uneven = [37, 70, 5, 64, 1, 33] * 10  # full batches: 576 x 10 samples; with tails: 432 x 10 (-25%)
    even = [64, 96, 128] * 10             # no partial batch: nothing to cut
    cfg = RunConfig(batch_size=32, rounds=2, strategy="map")
    assert tail_batch_sizes(cfg, uneven) == (4, 8, 16, 32)
    assert tail_batch_sizes(cfg, even) is None
    assert tail_batch_sizes(dataclasses.replace(cfg, tail_batches="on"), even) == (4, 8, 16, 32)
    assert tail_batch_sizes(dataclasses.replace(cfg, tail_batches="off"), uneven) is None
    assert tail_batch_sizes(dataclasses.replace(cfg, rounds=500), uneven) == (4, 8, 16, 32)  # whatever the length
    assert tail_batch_sizes(dataclasses.replace(cfg, strategy="vmap"), uneven) is None
    assert tail_batch_sizes(dataclasses.replace(cfg, augment="crop_flip"), uneven) is None


def test_the_cli_saves_the_choice_and_logs_the_work_it_computed(tmp_path):
    # 40 samples a client at B = 16: steps of 16, 16 and 8 (the last one at 8 with tail sizes)
    from jaxfl.run.cli import main
    tiny = ["--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size",
            "16", "--test-per-client", "30", "--strategy", "map", "--rounds", "1"]

    def run(out, *flags):
        assert main(["run", "--out", str(tmp_path / out), *tiny, *flags]) == 0
        config = json.loads((tmp_path / out / "config.json").read_text())
        work = [json.loads(line)["padded_work"] for line in (tmp_path / out / "metrics.jsonl").open()]
        return config["tail_batches"], work
    # auto takes them (a 17% cut); config.json says what was chosen, not "auto"
    assert run("auto") == ("on", [1.0])
    assert run("off", "--tail-batches", "off") == ("off", [48 / 40])
