"""DapperFL: masks per the spec's layer rules and kept-channel table, fusion schedule, recovery aggregation,
reduction to FedAvg, footprint counts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, info, make_data, make_trainer, rounds_tolerance, run_rounds

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._submodel import pruning_masks
from jaxfl.algorithms.dapperfl import bn_channel_masks, fusion_coefficient
from jaxfl.core.step import init_state
from jaxfl.core.trees import count_params
from jaxfl.models import resnet10, small_cnn


ROOT = jax.random.key(6)
COUNTS = (24, 17, 9)
KEPT = {64: (51, 38, 26, 13), 128: (102, 77, 51, 26), 256: (205, 154, 102, 51), 512: (410, 307, 205, 102)}


@pytest.fixture(scope="module")
def resnet_params():
    m = resnet10(10)
    return m.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)["params"]


@pytest.mark.parametrize("j,rho", list(enumerate((0.2, 0.4, 0.6, 0.8))))
def test_kept_channel_counts_match_the_spec_table(resnet_params, j, rho):
    masks = jax.jit(pruning_masks)(resnet_params, rho)
    enc = masks["encoder"]
    out_only = np.asarray(enc["layer1_0"]["conv1"]["kernel"])  # output channels only
    assert out_only[0, 0, 0].sum() == KEPT[64][j] and np.all(out_only == out_only[:1, :1, :1])
    short = np.asarray(enc["layer2_0"]["conv_shortcut"]["kernel"])  # first shortcut: output only
    assert short[0, 0, 0].sum() == KEPT[128][j] and short[0, 0, :, 0].min() == short[0, 0, :, 0].max()
    for layer, width in (("layer2_0", 128), ("layer3_0", 256), ("layer4_0", 512)):
        k = np.asarray(enc[layer]["conv2"]["kernel"])[0, 0]  # in x out
        assert (k.sum(0) > 0).sum() == KEPT[width][j] and (k.sum(1) > 0).sum() == KEPT[width][j]
        assert k.sum() == KEPT[width][j] ** 2
        assert np.asarray(enc[layer]["bn1"]["scale"]).sum() == KEPT[width][j]  # unstructured on gamma
        assert np.all(np.asarray(enc[layer]["bn1"]["bias"]) == 1)
    shortcut = np.asarray(enc["layer3_0"]["conv_shortcut"]["kernel"])[0, 0]  # later shortcuts: in x out
    assert shortcut.sum() == KEPT[128][j] * KEPT[256][j]
    fc = np.asarray(masks["head"]["fc1"]["linear"]["kernel"])  # input rows by L2 norm
    assert fc.sum() == KEPT[512][j] * 10 and np.all(fc == fc[:, :1])
    assert np.all(np.asarray(enc["conv_stem"]["kernel"]) == 1) and np.all(np.asarray(enc["bn_stem"]["scale"]) == 1)
    # output-only layers' kept parameter counts are exactly (1 - rho) x dense when rho n is whole
    n_out = 64
    assert count_params(resnet_params["encoder"]["layer1_0"]["conv1"], masks["encoder"]["layer1_0"]["conv1"]) == \
        out_only.size // n_out * KEPT[64][j]


def test_ratio_zero_keeps_everything_and_scores_pick_the_largest(resnet_params):
    masks = pruning_masks(resnet_params, 0.0)
    assert all(bool(jnp.all(m == 1)) for m in jax.tree_util.tree_leaves(masks))
    k = resnet_params["encoder"]["layer1_0"]["conv1"]["kernel"]
    m = pruning_masks(resnet_params, 0.5)["encoder"]["layer1_0"]["conv1"]["kernel"][0, 0, 0]
    l1 = np.abs(np.asarray(k)).sum((0, 1, 2))
    assert l1[np.asarray(m) == 1].min() >= l1[np.asarray(m) == 0].max()


def test_fusion_schedule():
    np.testing.assert_allclose([fusion_coefficient(r) for r in range(11)],
                               [0.9, 0.72, 0.576, 0.4608, 0.36864, 0.294912, 0.2359296, 0.18874368,
                                0.150994944, 0.1207959552, 0.1], rtol=1e-5)


def setup(**opts):
    data = make_data(list(COUNTS))
    trainer = make_trainer(epochs=opts.pop("epochs", 1))
    alg = build_algorithm("dapperfl", small_cnn(num_classes=4, width=4, hidden=(8,)), trainer, **opts)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    return alg, data, server, clients, trainer


def test_ratio_zero_gamma_zero_without_fusion_is_fedavg():
    alg, data, server, clients, trainer = setup(device_ratios=(0.0,), gamma=0.0, use_fusion=False)
    avg = build_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), trainer)
    s_avg, c_avg = init_state(avg, jax.random.key(0), data.x[0], len(COUNTS))
    a = run_rounds(alg, data, server, clients, ROOT, rounds=2)
    b = run_rounds(avg, data, s_avg, c_avg, ROOT, rounds=2)
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds
    tol = rounds_tolerance(avg, data, s_avg, c_avg, ROOT, rounds=2)[0]
    assert_trees_close(a[0]["params"], b[0]["params"], atol=tol["params"], rtol=0)
    assert_trees_close(a[0]["batch_stats"], b[0]["batch_stats"], atol=tol["batch_stats"], rtol=0)


def test_positions_pruned_everywhere_keep_the_previous_global_value():
    alg, data, server, clients, _ = setup()
    g = {"w": jnp.array([1.0, 2.0, 3.0])}
    x = jnp.array([[5.0, 6.0, 7.0], [9.0, 10.0, 11.0]])
    mask = jnp.array([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    srv = {"params": g, "batch_stats": {}}
    cl = {"params": {"w": x}, "mask": {"w": mask}, "batch_stats": {}}
    new, kept = alg.aggregate(srv, cl, jnp.array([1.0, 3.0]), info(0, [0, 1]))
    assert kept == {}  # a client keeps nothing: its device level follows from its id
    # entry 0: kept by both -> W + .25 (5 - 1) + .75 (9 - 1); entry 1: pruned by all -> 2; entry 2: only
    # client 0 keeps it -> W + .25 (7 - 3), not renormalised
    np.testing.assert_allclose(new["params"]["w"], [1 + 1 + 6, 2, 3 + 1])
    zero_alg = build_algorithm("dapperfl", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(),
                               recover_mode="zero")
    new0, _ = zero_alg.aggregate(srv, cl, jnp.array([1.0, 3.0]), info(0, [0, 1]))
    np.testing.assert_allclose(new0["params"]["w"], [0.25 * 5 + 0.75 * 9, 0.0, 0.25 * 7])


def test_clients_train_heterogeneous_masks_in_one_jit():
    alg, data, server, clients, _ = setup(epochs=2)
    s, c, m = run_rounds(alg, data, server, clients, ROOT, rounds=2)
    np.testing.assert_allclose(m["ratio"], [0.0, 0.2, 0.4])
    assert m["kept_fraction"][0] == 1.0 and m["kept_fraction"][0] > m["kept_fraction"][1] > m["kept_fraction"][2]
    assert np.all(np.isfinite(m["loss"]))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="device_ratios"):
        build_algorithm("dapperfl", small_cnn(4), make_trainer(), device_ratios=(0.2, 1.5))
    with pytest.raises(ValueError, match="recover_mode"):
        build_algorithm("dapperfl", small_cnn(4), make_trainer(), recover_mode="mean")


def test_bn_channel_masks_follow_the_feeding_conv_output_channels(resnet_params):
    m = resnet10(10)
    stats = m.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)["batch_stats"]
    masks = pruning_masks(resnet_params, 0.4)
    live = bn_channel_masks(masks, stats)
    enc, lenc = masks["encoder"], live["encoder"]
    for layer, conv, bn in (("layer1_0", "conv1", "bn1"), ("layer2_0", "conv2", "bn2"),
                            ("layer2_0", "conv_shortcut", "bn_shortcut"), ("layer3_0", "conv1", "bn1")):
        expect = np.asarray(enc[layer][conv]["kernel"]).any(axis=(0, 1, 2))
        for stat in ("mean", "var"):
            np.testing.assert_array_equal(np.asarray(lenc[layer][bn][stat]), expect.astype(np.float32))
        assert 0 < expect.sum() < expect.size
    assert np.all(np.asarray(lenc["bn_stem"]["mean"]) == 1)  # the stem is never pruned


def test_bn_statistics_of_a_pruned_channel_follow_the_weights_rule():
    """Client 1 pruned output channel 0 of conv1: under recovery it contributes the previous global
    statistics of that channel (as it does its weights); unmasked, its near-zero statistics enter the mean."""
    alg, data, server, clients, _ = setup()
    k = server["params"]["encoder"]["conv1"]["kernel"]
    c = k.shape[-1]
    mask = jax.tree_util.tree_map(lambda x: jnp.ones((2,) + x.shape), server["params"])
    mask["encoder"]["conv1"]["kernel"] = mask["encoder"]["conv1"]["kernel"].at[1, ..., 0].set(0.0)
    g = {"encoder": {"bn1": {"mean": jnp.full((c,), 1.0), "var": jnp.full((c,), 2.0)}}}
    s = {"encoder": {"bn1": {"mean": jnp.array([[3.0] * c, [0.0] * c]), "var": jnp.array([[4.0] * c, [0.0] * c])}}}
    params = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), server["params"])
    srv = {"params": server["params"], "batch_stats": g}
    cl = {"params": params, "mask": mask, "batch_stats": s}
    w = jnp.array([1.0, 3.0])
    new, _ = alg.aggregate(srv, cl, w, info(0, [0, 1]))
    # channel 0: G + .25 (s_0 - G) (client 1 recovered); the others: the plain weighted mean .25 s_0 + .75 s_1
    np.testing.assert_allclose(new["batch_stats"]["encoder"]["bn1"]["mean"], [1 + 0.25 * 2] + [0.75] * (c - 1))
    np.testing.assert_allclose(new["batch_stats"]["encoder"]["bn1"]["var"], [2 + 0.25 * 2] + [1.0] * (c - 1))
    old = build_algorithm("dapperfl", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(),
                          bn_stats="unmasked")
    new_u, _ = old.aggregate(srv, cl, w, info(0, [0, 1]))
    np.testing.assert_allclose(new_u["batch_stats"]["encoder"]["bn1"]["mean"], [0.75] * c)
    zero = build_algorithm("dapperfl", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(),
                           recover_mode="zero")
    new_z, _ = zero.aggregate(srv, cl, w, info(0, [0, 1]))  # pruned statistics averaged as zeros
    np.testing.assert_allclose(new_z["batch_stats"]["encoder"]["bn1"]["var"], [0.25 * 4] + [1.0] * (c - 1))
