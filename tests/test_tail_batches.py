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
from jaxfl.core.buckets import padded_work, tails_used
from jaxfl.core.trainer import draws_from_key, jaxpr_primitives, tail_sizes
from jaxfl.models import cnn_dropout, small_cnn
from jaxfl.ops.augment import make_augment
from jaxfl.run.build import tail_batch_sizes
from jaxfl.run.config import RunConfig

COUNTS = (37, 70, 5, 64, 1, 33)  # partial last batches of every size class at B = 8 and B = 32


def test_tail_sizes_are_the_eighths_of_b_down_to_two():
    assert tail_sizes(32) == (4, 8, 12, 16, 20, 24, 28, 32)
    assert tail_sizes(64) == (8, 16, 24, 32, 40, 48, 56, 64)
    assert tail_sizes(10) == (2, 3, 4, 5, 7, 8, 9, 10)
    assert tail_sizes(3) == (2, 3)
    assert tail_sizes(1) == (1,)
    for b in range(1, 300):  # what the docstring promises of every last batch of r real samples
        sizes = np.asarray(tail_sizes(b))
        assert sizes[-1] == b and np.all(np.diff(sizes) > 0)
        for r in range(1, b + 1):
            computed = sizes[np.searchsorted(sizes, r)]
            assert computed - r < max(-(-b // 8), 2), (b, r, computed)


def test_tails_used_are_the_sizes_the_last_batches_take():
    # at B = 32: 37 -> a last batch of 5 (at 8), 70 -> 6 (8), 5 (8), 64 (none), 1 (4), 33 -> 1 (4), 0 (none)
    assert tails_used([37, 70, 5, 64, 1, 33, 0], 32, tail_sizes(32)) == (4, 8, 32)
    assert tails_used([100] * 9, 64, tail_sizes(64)) == (40, 64)  # the digits clients at B = 64: 36 real of 40
    assert tails_used([64, 128, 0], 64, tail_sizes(64)) == ()  # no partial batch
    assert tails_used([63], 64, tail_sizes(64)) == ()  # a last batch only B holds
    rng = np.random.default_rng(0)
    for b in (7, 10, 32, 64):
        counts = rng.integers(0, 500, 200)
        used = tails_used(counts, b, tail_sizes(b))
        # the same work as the whole ladder, from only the sizes some last batch takes
        assert padded_work([], counts, b, per_client_trips=True, tail_sizes=used) == \
            padded_work([], counts, b, per_client_trips=True, tail_sizes=tail_sizes(b))
        for size in used[:-1]:  # and each of them is taken: without it some last batch computes more
            assert padded_work([], counts, b, per_client_trips=True, tail_sizes=tuple(s for s in used if s != size)) > \
                padded_work([], counts, b, per_client_trips=True, tail_sizes=used)


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


def test_last_batches_outside_the_chosen_sizes_run_at_the_next_larger_one():
    # the sizes client 0's last batch takes (37 at B = 8: 5 real -> (5, 8)); the others' (6, 5, 1 and 1 real)
    # run at 5 or at B, as a client outside the population the sizes were chosen from would
    model, data = small_cnn(num_classes=4, width=4, hidden=(8,)), make_data(list(COUNTS), m=72)
    base = make_trainer(batch_size=8, epochs=2)
    used = tails_used(COUNTS[:1], 8, tail_sizes(8))
    assert used == (5, 8)
    tail = dataclasses.replace(base, tail_sizes=used, tail_log=[])
    want, got = _train(base, model, data), _train(tail, model, data)
    assert tail.tails_in_use() == used
    tol = rounding_tolerance(lambda p, s: _train(base, model, data, (p, s))[:2], *_init(model, data))
    assert_trees_close(got[:2], want[:2], atol=tol, rtol=0)
    for k in ("seen", "steps"):
        np.testing.assert_array_equal(got[2][k], want[2][k])


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
    assert tail_batch_sizes(cfg, uneven) == (4, 8, 32)  # only the sizes the last batches take, B last
    assert tail_batch_sizes(cfg, even) is None
    assert tail_batch_sizes(dataclasses.replace(cfg, tail_batches="on"), uneven + [50]) == (4, 8, 20, 32)
    assert tail_batch_sizes(dataclasses.replace(cfg, tail_batches="on"), even) is None  # no last batch to cut
    assert tail_batch_sizes(dataclasses.replace(cfg, tail_batches="off"), uneven) is None
    assert tail_batch_sizes(dataclasses.replace(cfg, rounds=500), uneven) == (4, 8, 32)  # whatever the length
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


# ---- evaluation: a client's partial last test batch at a smaller size (``make_predict``'s tail_sizes) ----

def _small_predict(m=24, counts=(24, 17, 9, 1), **kw):
    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.evaluate import make_predict
    from jaxfl.core.step import init_state
    from jaxfl.core.types import RunContext
    model, data = small_cnn(num_classes=4, width=4, hidden=(8,)), make_data(list(counts), m=m)
    alg = build_algorithm("fedbn", model, make_trainer(), RunContext(num_clients=len(counts)))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(counts))
    predict = jax.jit(make_predict(alg, eval_batch_size=8, preprocess=make_trainer().preprocess, **kw))
    return predict, server, clients, data


@pytest.mark.parametrize("strategy,m", [("map", 24), ("vmap", 24), ("map", 8)])
def test_a_smaller_last_test_batch_predicts_as_the_full_one_up_to_rounding(strategy, m):
    # under vmap every branch of the switch runs (selected): the same numbers, only slower; m = 8: one test
    # batch a client, which takes the switch alone (no loop over full batches)
    counts = (24, 17, 9, 1) if m == 24 else (8, 5, 3, 1)
    full, server, clients, data = _small_predict(m=m, counts=counts, clients=strategy)
    tails = _small_predict(m=m, counts=counts, clients=strategy, tail_sizes=tail_sizes(8))[0]
    want, got = full(server, clients, data), tails(server, clients, data)
    tol = rounding_tolerance(lambda s, c: full(s, c, data), server, clients)
    real = np.asarray(data.sample_mask()) > 0
    for w, g, t in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tol)):
        np.testing.assert_allclose(np.asarray(g)[real], np.asarray(w)[real], atol=t, rtol=0)


def test_a_client_with_one_test_batch_runs_it_through_the_switch_alone():
    # XLA hoists a loop body whose slice does not depend on the loop index (one batch: the whole array) out of
    # the loop, so a loop over the full batches would run its body at B even for zero trips: with one batch a
    # client the loop is left out (the evaluation of a label-skewed population at B = 256 ran 2.2x slower with it)
    loops = {}
    for m, counts in ((8, (8, 5, 3, 1)), (24, (24, 17, 9, 1))):
        predict, server, clients, data = _small_predict(m=m, counts=counts, clients="map", tail_sizes=tail_sizes(8))
        prims = list(jaxpr_primitives(jax.make_jaxpr(predict)(server, clients, data).jaxpr))
        # (a cond selected by platform_index is ``conv2d``'s choice by platform, resolved when lowering)
        loops[m] = (prims.count("while"), prims.count("cond") - prims.count("platform_index"))
    assert loops == {8: (0, 1), 24: (1, 1)}, loops


def test_tail_sizes_must_ascend_to_the_evaluation_batch():
    with pytest.raises(ValueError, match="must ascend and end with eval_batch_size 8"):
        _small_predict(tail_sizes=(2, 4, 16))


def test_draws_random_finds_a_draw_anywhere_in_the_jaxpr():
    from jaxfl.core.trainer import draws_random
    x = jnp.ones(4)
    assert not draws_random(lambda x: jnp.tanh(x) * 2, x)
    assert draws_random(lambda x: x + jax.random.normal(jax.random.key(0), x.shape), x)
    assert draws_random(lambda x: x + jax.random.normal(jax.random.PRNGKey(0), x.shape), x)  # raw uint32 keys
    inside = lambda x: jax.lax.cond(x[0] > 0, lambda v: v + jax.random.uniform(jax.random.key(1), v.shape),  # noqa: E731
                                    lambda v: v, x)
    assert draws_random(inside, x)
    assert draws_random(lambda x: jax.lax.fori_loop(0, 2, lambda i, v: v * jax.random.uniform(jax.random.key(i)), x), x)


def test_a_transform_that_draws_keeps_every_test_batch_at_b():
    # input noise drawn with the batch's shape: the smaller batches would draw other noise, so B is kept (the
    # same program: bit for bit)
    noise = lambda x, key: x + 0.1 * jax.random.normal(key, x.shape)  # noqa: E731
    full, server, clients, data = _small_predict(transform=noise)
    tails = _small_predict(transform=noise, tail_sizes=tail_sizes(8))[0]
    key = jax.random.key(4)
    assert_trees_close(tails(server, clients, data, key), full(server, clients, data, key), atol=0, rtol=0)


def test_the_run_evaluates_with_tail_sizes_only_under_map_and_where_they_pay():
    from jaxfl.run.build import eval_tail_sizes
    uneven = [37, 70, 5, 64, 1, 33] * 10  # test sets; at B = 32: 576 x 10 samples computed, with tails 432 x 10
    even = [64, 96, 128] * 10
    cfg = RunConfig(strategy="map")
    assert eval_tail_sizes(cfg, uneven, 32) == (4, 8, 32)
    assert eval_tail_sizes(cfg, even, 32) == ()
    assert eval_tail_sizes(dataclasses.replace(cfg, eval_tail_batches="on"), uneven + [50], 32) == (4, 8, 20, 32)
    assert eval_tail_sizes(dataclasses.replace(cfg, eval_tail_batches="on"), even, 32) == ()
    assert eval_tail_sizes(dataclasses.replace(cfg, eval_tail_batches="off"), uneven, 32) == ()
    assert eval_tail_sizes(dataclasses.replace(cfg, strategy="vmap"), uneven, 32) == ()
    assert eval_tail_sizes(cfg, [1, 1], 1) == ()  # B = 1: nothing smaller


def test_the_cli_saves_the_evaluation_choice_and_evaluates_the_same(tmp_path):
    # test sets of 30 samples at B = 12 (--eval-batch-size): batches of 12, 12 and 6, the last at 6 with tail sizes
    # (36 -> 30 computed samples, a 17% cut: auto takes them)
    from jaxfl.run.cli import main
    tiny = ["--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size",
            "16", "--test-per-client", "30", "--eval-batch-size", "12", "--strategy", "map", "--rounds", "2"]

    def run(out, *flags):
        assert main(["run", "--out", str(tmp_path / out), *tiny, *flags]) == 0
        config = json.loads((tmp_path / out / "config.json").read_text())
        logs = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").open()]
        return config["eval_tail_batches"], logs
    (chosen, auto), (off, full) = run("auto"), run("off", "--eval-tail-batches", "off")
    assert (chosen, off) == ("on", "off")  # config.json says what auto chose
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["eval_batch_size"] == 12
    # without --eval-batch-size, config.json saves the size the device's default gave (a resumed run keeps it)
    assert main(["run", "--out", str(tmp_path / "default"), *tiny[:-6], "--rounds", "1"]) == 0
    assert json.loads((tmp_path / "default" / "config.json").read_text())["eval_batch_size"] == 16
    for a, f in zip(auto, full):
        # the training is the same program; the evaluation the same up to rounding (a loss over 30 samples)
        assert a["train_loss"] == f["train_loss"]
        np.testing.assert_allclose(a["test_loss"], f["test_loss"], rtol=1e-5)
        assert a["test_accuracy"] == f["test_accuracy"]


def test_the_evaluation_batch_defaults_by_device_and_model_and_is_capped_by_the_largest_test_set(monkeypatch):
    from jaxfl.run import build
    cfg = RunConfig()
    assert cfg.eval_batch_size is None
    assert build.eval_batch_size(cfg, [30, 200]) == build.CPU_EVAL_BATCH == 16  # (the suite runs on a CPU)
    assert build.eval_batch_size(cfg, [5, 9]) == 9
    assert build.eval_batch_size(dataclasses.replace(cfg, eval_batch_size=64), [30, 200]) == 64
    assert build.eval_batch_size(dataclasses.replace(cfg, eval_batch_size=64), [30, 40]) == 40
    # the models whose large dense layers are read once a batch take a larger CPU default (measured per model)
    for model, size in (("femnist_cnn", 64), ("digits_cnn", 64), ("alexnet_bn", 128), ("fedavg_cnn", 16),
                        ("vit_small", 16)):
        assert build.eval_batch_size(dataclasses.replace(cfg, model=model), [30, 500]) == size, model
    assert build.eval_batch_size(dataclasses.replace(cfg, model="femnist_cnn"), [30, 40]) == 40
    assert build.eval_batch_size(dataclasses.replace(cfg, model="femnist_cnn", eval_batch_size=16), [30, 500]) == 16
    monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
    assert build.eval_batch_size(cfg, [30, 500]) == build.ACCELERATOR_EVAL_BATCH == 256
    assert build.eval_batch_size(dataclasses.replace(cfg, model="femnist_cnn"), [30, 500]) == 256
