"""Heterogeneous-capacity baselines (DapperFL's comparison): FedDrop, FedMP, HeteroFL, NeFL. Reductions to FedAvg,
kept units per layer at each ratio, untouched entries, the aggregations against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, info, rounding_tolerance, run_rounds, setup_algorithm

from jaxfl.algorithms._submodel import forward_layers, pruning_masks, width_masks
from jaxfl.algorithms.feddrop import random_units
from jaxfl.algorithms.nefl import submodel_of_level
from jaxfl.core.step import cohort_train
from jaxfl.models import resnet10_slim, small_cnn


ROOT = jax.random.key(4)
COUNTS = (24, 17, 9)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


@pytest.fixture(scope="module")
def resnet():
    m = resnet10_slim(4)
    x = jnp.zeros((1, 8, 8, 3))
    shapes = jax.eval_shape(lambda k: m.init(k, x, train=False), jax.random.key(0))  # width masks need shapes
    v = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return forward_layers(m, x), v["params"], v["batch_stats"]


def test_heterofl_clips_every_steps_gradient_norm_as_its_released_code():
    # one client of 8 samples, batch 8: one step from the server's model, the first of momentum SGD, so
    # p1 = p0 - lr g min(1, c / ||g||_2) with g the sub-model's gradient (zero outside the client's mask)
    lr, opts = 0.05, dict(device_ratios=(0.5,))
    alg, data, server, clients, free = setup_rows("heterofl", counts=(8,), grad_clip=0.0, **opts)
    step = jax.tree_util.tree_map(lambda p0, p1: p1[0] - p0, server["params"], free["params"])  # -lr g
    norm = float(np.sqrt(sum(np.sum(np.square(d)) for d in jax.tree_util.tree_leaves(step)))) / lr
    assert norm > 0.2
    # the clipped step is another program than the free one it is built from: equal up to float32 rounding of the
    # free step (scaled by at most 1)
    free_step = jax.jit(lambda s, c: trained_rows(alg, data, s, c, ROOT)["params"])
    tol = rounding_tolerance(free_step, server, clients)
    for c in (0.5 * norm, 0.1 * norm, 2.0 * norm):
        clipped = setup_rows("heterofl", counts=(8,), grad_clip=c, **opts)[4]
        expect = jax.tree_util.tree_map(lambda p0, d: p0 + d * min(1.0, c / norm), server["params"], step)
        assert_trees_close(jax.tree_util.tree_map(lambda a: a[0], clipped["params"]), expect, atol=tol, rtol=0)


def trained_rows(alg, data, server, clients, root):
    """Every client's trained row of round 0 (jitted: the engine's cohort update, before aggregation)."""
    update = jax.jit(cohort_train(alg, clients="vmap"))
    return update(server, clients, data, jnp.arange(data.num_clients), 0, root)[0]


_SETUPS = {}


def setup_rows(name, counts=COUNTS, **opts):
    """(alg, data, server, clients, trained rows), built once per configuration."""
    key = (name, counts, tuple(sorted(opts.items())))
    if key not in _SETUPS:
        alg, data, server, clients = setup_algorithm(name, model(), counts, options=opts)
        _SETUPS[key] = (alg, data, server, clients, trained_rows(alg, data, server, clients, ROOT))
    return _SETUPS[key]


@pytest.fixture(scope="module")
def fedavg_after_two_rounds():
    ref, data, s_ref, c_ref = setup_algorithm("fedavg", model(), COUNTS)
    return run_rounds(ref, data, s_ref, c_ref, ROOT, 2)[0]


REDUCE = {"feddrop": dict(device_ratios=(0.0,)), "fedmp": dict(device_ratios=(0.0,)),
          "heterofl": dict(device_ratios=(0.0,), label_mask=False, uniform=False, grad_clip=0.0),
          "nefl": dict(device_ratios=(0.0,), uniform=False)}


@pytest.mark.parametrize("name", sorted(REDUCE))
def test_ratio_zero_everywhere_is_fedavg(name, fedavg_after_two_rounds):
    alg, data, server, clients = setup_algorithm(name, model(), COUNTS, options=REDUCE[name])
    s, _, m = run_rounds(alg, data, server, clients, ROOT, 2)
    s_ref = fedavg_after_two_rounds
    assert_trees_close((s["params"], s["batch_stats"]), (s_ref["params"], s_ref["batch_stats"]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(m["kept_fraction"]), 1.0)


def kept(mask):
    return int(np.asarray(mask).sum())


@pytest.mark.parametrize("rho", (0.0, 0.2, 0.4, 0.6, 0.8))
def test_width_and_dropout_keep_the_rule_per_layer(resnet, rho):
    layers, params, stats = resnet
    w = jax.jit(lambda r: width_masks(layers, params, stats, r))(1.0 - rho)
    units = random_units(layers, jax.random.key(1), rho)
    ceil = lambda c: int(np.ceil((1 - rho) * c - 1e-4))
    keep = lambda c: c - int(round(rho * c))
    enc = w["params"]["encoder"]
    k = np.asarray(enc["layer2_0"]["conv1"]["kernel"])[0, 0]  # [16 in, 32 out]: the first ceil(r C) of each
    assert k.sum(1).nonzero()[0].tolist() == list(range(ceil(16))) and kept(k.sum(0) > 0) == ceil(32)
    assert kept(enc["conv_stem"]["kernel"][0, 0, :, 0]) == 3  # image channels never cut
    assert kept(w["batch_stats"]["encoder"]["layer3_0"]["bn2"]["var"]) == ceil(64)
    head = np.asarray(w["params"]["head"]["fc1"]["linear"]["kernel"])  # classes never cut
    assert kept(head[:, 0]) == ceil(128) and np.all(head[: ceil(128)] == 1)
    by_path = {layer.path: j for j, layer in enumerate(layers)}
    for path, c in ((("encoder", "layer1_0", "conv1"), 16), (("encoder", "layer4_0", "conv2"), 128)):
        assert kept(units[by_path[path]]) == keep(c)
    # one residual stream, one draw: stem, layer1 conv2 share units; layer2 conv2 and its shortcut share
    np.testing.assert_array_equal(units[by_path[("encoder", "conv_stem")]],
                                  units[by_path[("encoder", "layer1_0", "conv2")]])
    np.testing.assert_array_equal(units[by_path[("encoder", "layer2_0", "conv2")]],
                                  units[by_path[("encoder", "layer2_0", "conv_shortcut")]])


def test_small_cnn_flatten_and_client_levels():
    alg, data, server, clients, rows = setup_rows("heterofl", label_mask=False)
    fc1 = np.asarray(rows["mask"]["params"]["head"]["fc1"]["linear"]["kernel"])  # [16 positions x 4 ch, 8]
    for i, (ch, hid) in enumerate(((4, 8), (4, 7), (3, 5))):  # rates 1, 0.8, 0.6
        rows_kept = fc1[i].sum(1) > 0
        np.testing.assert_array_equal(rows_kept, np.tile(np.arange(4) < ch, 16))  # channel = index mod 4
        assert kept(fc1[i].sum(0) > 0) == hid
    _, _, s_mp, _, rows_mp = setup_rows("fedmp")
    m = rows_mp["mask"]
    for i, rho in enumerate((0.0, 0.2, 0.4)):  # FedMP prunes the global model at the client's level
        assert_trees_close(jax.tree_util.tree_map(lambda a: a[i], m), pruning_masks(s_mp["params"], rho), atol=0)
    assert submodel_of_level((0.04, 0.16, 0.36, 0.64, 1.0), (0.0, 0.2, 0.4, 0.6, 0.8)) == (4, 3, 2, 1, 0)


def stacked_rows(alg, server, masks, seed=0):
    rng = np.random.default_rng(seed)
    noise = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=(3,) + a.shape), a.dtype), t)
    return {"params": noise(server["params"]), "batch_stats": noise(server["batch_stats"]), "mask": masks}


def test_aggregations_match_numpy():
    weights = jnp.asarray([3.0, 1.0, 2.0])
    for name, uniform in (("heterofl", True), ("feddrop", False)):
        alg, data, server, clients, trained = setup_rows(name)
        masks = trained["mask"]
        rows = stacked_rows(alg, server, masks)
        new, _ = jax.jit(alg.aggregate)(server, rows, weights, info(0, [0, 1, 2]))
        c = np.ones(3) if uniform else np.asarray(weights)
        for part in ("params", "batch_stats"):
            for x, m, prev, out in zip(*(jax.tree_util.tree_leaves(t) for t in
                                         (rows[part], masks[part], server[part], new[part]))):
                x, m, prev = np.asarray(x), np.broadcast_to(np.asarray(m), x.shape), np.asarray(prev)
                cm = c.reshape((3,) + (1,) * prev.ndim) * m
                tot = cm.sum(0)
                want = np.where(tot > 0, (cm * x).sum(0) / np.where(tot > 0, tot, 1), prev)
                np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    # an entry no client holds keeps its global value: every client at rate 0.6 cuts channel 3 of conv1
    alg, data, server, clients, trained = setup_rows("heterofl", device_ratios=(0.4,))
    rows = stacked_rows(alg, server, trained["mask"])
    new, _ = jax.jit(alg.aggregate)(server, rows, weights, info(0, [0, 1, 2]))
    np.testing.assert_array_equal(new["params"]["encoder"]["conv1"]["kernel"][..., 3],
                                  server["params"]["encoder"]["conv1"]["kernel"][..., 3])
    assert not np.allclose(new["params"]["encoder"]["conv1"]["kernel"][..., :3],
                           server["params"]["encoder"]["conv1"]["kernel"][..., :3])
    # FedMP: R2SP, W + sum_i p_i M_i (w_i - W)
    alg, data, server, clients, trained = setup_rows("fedmp")
    masks = trained["mask"]
    rows = stacked_rows(alg, server, masks)
    new, _ = jax.jit(alg.aggregate)(server, rows, weights, info(0, [0, 1, 2]))
    p = np.asarray(weights) / 6.0
    for x, m, g, out in zip(*(jax.tree_util.tree_leaves(t) for t in
                              (rows["params"], masks, server["params"], new["params"]))):
        x, m, g = np.asarray(x), np.asarray(m), np.asarray(g)
        want = g + (p.reshape((3,) + (1,) * g.ndim) * m * (x - g)).sum(0)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_heterofl_label_mask_keeps_absent_classes_out():
    alg, data, server, clients = setup_algorithm("heterofl", model(), COUNTS, options=dict(device_ratios=(0.0,)))
    y = np.asarray(data.y).copy()
    y[0, :24] = np.where(y[0, :24] == 3, 1, y[0, :24])  # client 0 never sees class 3
    data = type(data)(data.x, jnp.asarray(y), data.count)
    m = trained_rows(alg, data, server, clients, ROOT)["mask"]["params"]["head"]["fc2"]["linear"]
    np.testing.assert_array_equal(np.asarray(m["bias"][0]), [1, 1, 1, 0])
    assert np.all(np.asarray(m["kernel"][0][:, 3]) == 0) and np.all(np.asarray(m["bias"][1]) == 1)


def test_nefl_batchnorm_is_kept_per_submodel():
    alg, data, server, clients = setup_algorithm("nefl", model(), COUNTS)  # clients 0, 1, 2: submodels 4, 3, 2
    s, _, _ = run_rounds(alg, data, server, clients, ROOT, 1)
    table = s["bn"]["params"]["head/bn1/scale"]
    init = np.asarray(server["bn"]["params"]["head/bn1/scale"])
    np.testing.assert_array_equal(np.asarray(table[:2]), init[:2])  # submodels nobody trained keep their copy
    for k in (2, 3, 4):
        assert not np.array_equal(np.asarray(table[k]), init[k])
    width = {2: 5, 3: 7, 4: 8}  # ceil(sqrt(p) 8): channels past a submodel's width keep its copy
    for k, c in width.items():
        np.testing.assert_array_equal(np.asarray(table[k][c:]), init[k][c:])
    np.testing.assert_array_equal(np.asarray(s["params"]["head"]["bn1"]["scale"]), np.asarray(table[4]))
    # the consistent parameters are shared: channel 4 of conv1 is held by submodels 3 and 4 only
    conv = s["params"]["encoder"]["conv1"]["kernel"]
    assert conv.shape == server["params"]["encoder"]["conv1"]["kernel"].shape
