"""jaxfl.ops.augment: each augmentation against its definition (numpy), under jit and vmap; the trainer applies it
to every training minibatch on its own key stream, and a run without it is unchanged."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_data, make_trainer, rounds_tolerance, run_rounds

from jaxfl.algorithms import REGISTRY, build_algorithm
from jaxfl.core.step import init_state
from jaxfl.core.types import RoundInfo, RunContext
from jaxfl.errors import ConfigError
from jaxfl.models import small_cnn
from jaxfl.ops import augment

IMAGES = np.random.default_rng(0).integers(0, 256, size=(6, 9, 9, 3)).astype(np.uint8)


def test_random_crop_is_a_window_of_the_zero_padded_image():
    key = jax.random.key(3)
    out = np.asarray(jax.jit(augment.random_crop, static_argnums=2)(key, IMAGES, 2))
    offsets = np.asarray(jax.random.randint(key, (6, 2), 0, 5))  # the draw the function makes
    padded = np.pad(IMAGES, ((0, 0), (2, 2), (2, 2), (0, 0)))
    for img, (dy, dx), got in zip(padded, offsets, out):
        np.testing.assert_array_equal(got, img[dy:dy + 9, dx:dx + 9])
    assert out.dtype == np.uint8 and len({tuple(o) for o in offsets}) > 1
    np.testing.assert_array_equal(augment.random_crop(key, IMAGES, 0), IMAGES)  # pad 0: the image itself


def test_random_flip_mirrors_about_half_the_images():
    out = np.asarray(jax.jit(augment.random_flip)(jax.random.key(1), np.repeat(IMAGES, 50, axis=0)))
    src = np.repeat(IMAGES, 50, axis=0)
    same = np.array([np.array_equal(o, s) for o, s in zip(out, src)])
    mirrored = np.array([np.array_equal(o, s[:, ::-1]) for o, s in zip(out, src)])
    assert np.all(same | mirrored) and 0.35 < mirrored.mean() < 0.65


def test_rotate_turns_counter_clockwise_about_the_centre_and_fills_zeros():
    # a quarter turn of a square image is exact on the pixel grid: numpy's rot90 (counter-clockwise)
    out = np.asarray(jax.jit(augment.rotate)(IMAGES[:2], jnp.array([np.pi / 2, 0.0])))
    np.testing.assert_array_equal(out[0], np.rot90(IMAGES[0], k=1, axes=(0, 1)))
    np.testing.assert_array_equal(out[1], IMAGES[1])
    # 45 degrees: the corners come from outside the image, so they are 0; the centre pixel stays
    tilted = np.asarray(augment.rotate(IMAGES[:1], jnp.array([np.pi / 4])))[0]
    assert np.all(tilted[0, 0] == 0) and np.all(tilted[-1, -1] == 0)
    np.testing.assert_array_equal(tilted[4, 4], IMAGES[0, 4, 4])


def test_random_rotation_draws_angles_in_range_and_zero_degrees_is_the_identity():
    np.testing.assert_array_equal(augment.random_rotation(jax.random.key(0), IMAGES, 0.0), IMAGES)
    key = jax.random.key(4)
    angles = np.asarray(jax.random.uniform(key, (6,), minval=-30.0, maxval=30.0)) * np.pi / 180
    np.testing.assert_array_equal(augment.random_rotation(key, IMAGES, 30.0), augment.rotate(IMAGES, angles))


@pytest.mark.parametrize("spec", ["flip", "crop_flip", "crop_flip:pad=1", "flip_rotate", "flip_rotate:degrees=10"])
def test_each_pipeline_keeps_shape_and_dtype_under_jit_and_vmap(spec):
    fn = augment.make_augment(spec)
    one = jax.jit(fn)(jax.random.key(0), IMAGES)
    assert one.shape == IMAGES.shape and one.dtype == IMAGES.dtype
    # clients on a leading axis, each its own key: the same as one call per client
    keys = jax.random.split(jax.random.key(1), 3)
    stacked = jax.vmap(fn)(keys, np.stack([IMAGES] * 3))
    for k, out in zip(keys, stacked):
        np.testing.assert_array_equal(out, fn(k, IMAGES))
    assert augment.make_augment("none") is None


def test_a_bad_augmentation_is_named_in_one_line():
    for spec, message in [("jitter", "'jitter' is not one of none, flip, crop_flip, flip_rotate"),
                          ("crop_flip:pad=-1", "pad=-1 must be an integer in [0, 64]"),
                          ("flip_rotate:angle=3", "'angle=3' is not a parameter of flip_rotate")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            augment.parse_augment(spec)


def setup(augment_fn=None):
    data = make_data([40, 24, 33], seed=2)
    trainer = make_trainer()
    trainer = trainer if augment_fn is None else dataclasses.replace(trainer, augment=augment_fn)
    alg = build_algorithm("fedavg", small_cnn(num_classes=4, width=4), trainer, RunContext(num_clients=3, num_rounds=2))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    return alg, data, server, clients


def test_the_trainer_augments_every_minibatch_and_leaves_a_run_without_it_as_it_was():
    root = jax.random.key(7)
    plain = run_rounds(*setup(), root, rounds=1)
    # an augmentation that returns its input computes the same round bit for bit (the same keys everywhere else)
    identity = run_rounds(*setup(lambda key, x: x), root, rounds=1)
    assert_trees_close(plain[:2], identity[:2], atol=0, rtol=0)
    # the minibatches the trainer sees are augmented: a constant image trains another model
    blank = run_rounds(*setup(lambda key, x: jnp.zeros_like(x)), root, rounds=1)
    assert not np.allclose(jax.tree_util.tree_leaves(plain[0])[0], jax.tree_util.tree_leaves(blank[0])[0])
    # the augmentation's key is a stream of its own: each client's draws do not depend on how clients are run
    # (two programs for the same math: equal up to the float32 rounding of the round)
    alg, data, server, clients = setup(augment.make_augment("crop_flip"))
    by_vmap = run_rounds(alg, data, server, clients, root, rounds=1, clients="vmap")
    by_map = run_rounds(alg, data, server, clients, root, rounds=1, clients="map")
    server_tol, client_tol, _ = rounds_tolerance(alg, data, server, clients, root, rounds=1)
    assert_trees_close(by_map[:2], by_vmap[:2], atol=(server_tol, client_tol), rtol=0)
    # and the augmented round is not the plain one
    assert not np.allclose(jax.tree_util.tree_leaves(plain[0])[0], jax.tree_util.tree_leaves(by_vmap[0])[0])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_augmentation_reaches_the_local_training_of_every_algorithm_that_does_not_refuse_it(name, monkeypatch):
    # an algorithm either trains through LocalTrainer.run (its minibatches augmented: the augmentation is traced
    # into its local update) or is marked Options.own_minibatches (--augment refused); never silently ignored
    import test_baselines
    seen = []

    def spy(key, x):
        seen.append(x.shape)
        return x
    real = test_baselines.setup_algorithm

    def with_spy(alg_name, model, counts, m=None, num_rounds=None, **kw):
        alg, data, server, clients = real(alg_name, model, counts, m, num_rounds, **kw)
        trainer = dataclasses.replace(make_trainer(), augment=spy)
        from jaxfl.algorithms import build_algorithm as build
        alg = build(alg_name, model, trainer, RunContext(num_clients=len(counts), num_rounds=num_rounds),
                    **kw.get("options", {}))
        return alg, data, server, clients
    monkeypatch.setattr(test_baselines, "setup_algorithm", with_spy)
    alg, data, server, clients = test_baselines.setup(name)
    row = jax.tree_util.tree_map(lambda a: a[0], data)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    info = RoundInfo(jnp.int32(0), jnp.int32(0), 2)
    jax.eval_shape(alg.local_update, server, client, row, jax.random.key(0), info)  # traces, compiles nothing
    assert bool(seen) != REGISTRY[name].options.own_minibatches, (name, seen)
