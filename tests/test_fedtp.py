"""FedTP: generated projection shapes, hypernetwork step = VJP of the weight changes, unsampled embeddings,
vanilla without personalization = FedAvg on the same ViT, new-client embedding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, info, make_data, make_trainer, rounding_tolerance, rounds_tolerance,
                      run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.fedtp import adapt_new_client, split_qkv
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn, vit_small
from jaxfl.ops.hypernet import generate, hypernet_grads, hypernetwork


ROOT = jax.random.key(4)
COUNTS = (24, 17, 9, 12)
HYPER = dict(embed_dim=4, hyper_hidden=8, hyper_layers=1)


def vit():
    return vit_small(num_classes=4, depth=2, dim=16, heads=2, dim_head=8, mlp_dim=32)


def setup(**opts):
    data = make_data(list(COUNTS))
    trainer = make_trainer(lr=0.05, momentum=0.5)
    alg = build_algorithm("fedtp", vit(), trainer, RunContext(num_clients=len(COUNTS)), **dict(HYPER, **opts))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    return alg, data, server, clients, trainer


def test_generated_projections_have_every_layers_shape_and_clients_predict_with_their_row():
    alg, data, server, clients, _ = setup()
    assert jax.tree_util.tree_leaves(clients) == []  # the row of Z is the client's id: nothing is stored
    hnet = hypernetwork({f"qkv{l}": (16, 48) for l in range(2)}, 4, 8, 1)
    out = generate(hnet.apply, server["hnet"], server["embeddings"], jnp.arange(len(COUNTS)))
    assert {k: v.shape for k, v in out.items()} == {"qkv0": (4, 16, 48), "qkv1": (4, 16, 48)}
    x = data.x[0, :5] / 255.0
    for i in range(len(COUNTS)):  # client i predicts with W generated from row i
        qkv = jnp.stack([out[f"qkv{l}"][i] for l in range(2)])
        expect = vit().apply({"params": server["params"]}, x, train=False, qkv=qkv)
        np.testing.assert_allclose(alg.predict(server, {}, x, jnp.int32(i)), expect, rtol=1e-5, atol=1e-6)
    same = generate(hnet.apply, server["hnet"], jnp.stack([server["embeddings"][0]] * 2), jnp.arange(2))
    np.testing.assert_array_equal(same["qkv0"][0], same["qkv0"][1])  # identical embeddings, identical weights
    assert "qkv" not in server["params"]["encoder"]["attn0"]  # the projections are never part of xi


def test_server_step_is_sgd_on_the_vjp_of_the_weight_changes_and_skips_unsampled_rows():
    alg, data, server, clients, trainer = setup(hyper_momentum=0.0)
    ids = jnp.array([1, 3])  # a cohort of two
    cohort = jax.tree_util.tree_map(lambda a: a[ids], clients)
    keys = [jax.random.key(7), jax.random.key(8)]
    trained = [alg.local_update(server, jax.tree_util.tree_map(lambda a: a[j], cohort), data.take(int(i)), k,
                                info(0, i))[0] for j, (i, k) in enumerate(zip(ids, keys))]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trained)
    weights = data.count[ids].astype(jnp.float32)
    new, kept = alg.aggregate(server, stacked, weights, info(0, ids))
    hnet = hypernetwork({f"qkv{l}": (16, 48) for l in range(2)}, 4, 8, 1)
    lr, wd = 0.01, 1e-3

    @jax.jit
    def by_hand(phi, z, trained_qkv, weights):
        sent = generate(hnet.apply, phi, z, ids)
        w_k = {f"qkv{l}": trained_qkv[:, l] for l in range(2)}
        g_phi, g_z = hypernet_grads(hnet.apply, phi, z, ids, sent, w_k, weights)
        return jax.tree_util.tree_map(lambda p, g: p - lr * (g + wd * p), phi, g_phi), z - lr * (g_z + wd * z), g_z
    args = (server["hnet"], server["embeddings"], stacked["trained_qkv"], weights)
    expect, expect_z, g_z = by_hand(*args)
    # another program: equal up to float32 rounding of the hand-made step
    tol, tol_z, _ = rounding_tolerance(by_hand, *args)
    assert_trees_close(new["hnet"], expect, atol=tol, rtol=0)
    np.testing.assert_allclose(new["embeddings"], expect_z, atol=tol_z, rtol=0)
    for row in (0, 2):  # unsampled: zero gradient, only the table-wide weight decay
        np.testing.assert_array_equal(g_z[row], 0.0)
    assert float(jnp.abs(g_z[1]).sum()) > 0
    assert kept == {}  # nothing is stored per client


def test_vanilla_without_personalization_is_fedavg_on_the_same_vit():
    data = make_data(list(COUNTS))
    trainer = make_trainer(lr=0.05, momentum=0.5)
    ours = build_algorithm("fedtp", vit(), trainer, variant="vanilla", personalize=False)
    avg = build_algorithm("fedavg", vit(), trainer)
    outs = []
    for alg in (ours, avg):
        server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
        outs.append(run_rounds(alg, data, server, clients, ROOT, rounds=2))
    xi, w = split_qkv(outs[1][0]["params"], 2)
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds (per leaf; W's per block)
    tol, _, metric_tol = rounds_tolerance(avg, data, *init_state(avg, jax.random.key(0), data.x[0], len(COUNTS)),
                                          ROOT, rounds=2)
    xi_tol, w_tol = split_qkv(tol["params"], 2)
    assert_trees_close(outs[0][0]["params"], xi, atol=xi_tol, rtol=0)
    assert_trees_close(list(outs[0][0]["qkv"]), list(w), atol=list(w_tol), rtol=0)
    np.testing.assert_allclose(outs[0][2]["loss"], outs[1][2]["loss"], atol=metric_tol["loss"], rtol=0)


def test_vanilla_keeps_each_clients_projections():
    alg, data, server, clients, _ = setup(variant="vanilla")
    s, c, m = run_rounds(alg, data, server, clients, ROOT, rounds=1)
    assert np.all(np.isfinite(m["loss"])) and not np.allclose(c["qkv"][0], c["qkv"][1])


def test_new_client_learns_only_an_embedding():
    alg, data, server, clients, trainer = setup()
    s, _, _ = run_rounds(alg, data, server, clients, ROOT, rounds=1)
    z, metrics = adapt_new_client(vit(), trainer, s, data.take(0), jax.random.key(5), **HYPER)
    assert z.shape == (4,) and np.isfinite(float(metrics["loss"]))
    assert not np.allclose(z, s["embeddings"].mean(0))


def test_needs_a_vit():
    with pytest.raises(ValueError, match="ViT"):
        build_algorithm("fedtp", small_cnn(4), make_trainer(), RunContext(num_clients=3))


def test_the_hypernetwork_variants_need_their_tables_size():
    # client ids index the embedding table; a table built too small would serve every later id its last row
    for build in (lambda ctx: build_algorithm("fedtp", vit(), make_trainer(), ctx),
                  lambda ctx: build_algorithm("pfedhn", small_cnn(4), make_trainer(), ctx)):
        for bad in (None, 0, 2.0):
            with pytest.raises(ValueError, match="num_clients"):
                build(RunContext(num_clients=bad))
    build_algorithm("fedtp", vit(), make_trainer(), variant="vanilla")  # no table: no size needed
