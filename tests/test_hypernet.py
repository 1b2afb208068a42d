"""Hypernetwork: shapes, parameter count, and the VJP update against grad of the surrogate and finite differences."""
import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxfl import ops
from jaxfl.core.trees import count_params


SHAPES = {"block0": (4, 6), "block1": (4, 6)}


def _setup(num_clients=5, embed=3, hidden=7):
    hn = ops.hypernet.hypernetwork(SHAPES, embed_dim=embed, hidden=hidden, n_hidden=2)
    params = hn.init(jax.random.key(0))
    table = ops.hypernet.init_embeddings(jax.random.key(1), num_clients, embed)
    return hn, params, table


class HypernetTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_parameter_count(self):
        hn, params, table = _setup()
        out = self.variant(hn.apply)(params, table[0])
        assert {k: v.shape for k, v in out.items()} == SHAPES
        batched = ops.hypernet.generate(hn.apply, params, table, jnp.array([0, 3]))
        assert batched["block1"].shape == (2, 4, 6)
        e, h, nh = 3, 7, 2
        expected = e * h + h + nh * (h * h + h) + 2 * (h + 1) * 24
        assert count_params(params) == expected

    def test_identical_embeddings_give_identical_weights(self):
        hn, params, table = _setup()
        table = table.at[2].set(table[4])
        out = ops.hypernet.generate(hn.apply, params, table, jnp.arange(5))
        np.testing.assert_array_equal(out["block0"][2], out["block0"][4])
        assert not np.allclose(out["block0"][0], out["block0"][1])

    def test_vjp_update_equals_grad_of_surrogate_and_finite_differences(self):
        hn, params, table = _setup()
        ids = jnp.array([1, 3, 4])
        weights = jnp.array([10.0, 30.0, 60.0])
        sent = ops.hypernet.generate(hn.apply, params, table, ids)
        trained = jax.tree_util.tree_map(
            lambda w: w + 0.1 * jax.random.normal(jax.random.key(9), w.shape), sent)
        g_phi, g_z = jax.jit(ops.hypernet.hypernet_grads, static_argnums=0)(hn.apply, params, table, ids, sent, trained,
                                                                            weights)
        loss = lambda p, z: ops.hypernet.hypernet_surrogate_loss(hn.apply, p, z, ids, trained, weights)
        r_phi, r_z = jax.grad(loss, argnums=(0, 1))(params, table)
        chex.assert_trees_all_close(g_phi, r_phi, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(g_z, r_z, rtol=1e-5, atol=1e-7)
        # rows of clients not sampled get exactly zero gradient
        np.testing.assert_array_equal(g_z[np.array([0, 2])], 0.0)
        assert np.all(np.abs(g_z[np.asarray(ids)]).sum(-1) > 0)
        # central finite difference along a random direction (float64 to make it sharp)
        with jax.enable_x64(True):
            p64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
            z64, t64 = table.astype(jnp.float64), jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), trained)
            d = jax.tree_util.tree_map(lambda x: jax.random.normal(jax.random.key(3), x.shape, jnp.float64), p64)
            eps = 1e-6
            f = lambda s: ops.hypernet.hypernet_surrogate_loss(
                hn.apply, jax.tree_util.tree_map(lambda x, v: x + s * v, p64, d), z64, ids, t64,
                weights.astype(jnp.float64))
            fd = (f(eps) - f(-eps)) / (2 * eps)
            dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(g_phi), jax.tree_util.tree_leaves(d)))
            np.testing.assert_allclose(float(dot), float(fd), rtol=1e-3)

    def test_zero_change_gives_zero_grad_and_a_step_reduces_the_surrogate(self):
        hn, params, table = _setup()
        ids, w = jnp.array([0, 2]), jnp.array([1.0, 3.0])
        sent = ops.hypernet.generate(hn.apply, params, table, ids)
        g_phi, g_z = ops.hypernet.hypernet_grads(hn.apply, params, table, ids, sent, sent, w)
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree_util.tree_leaves((g_phi, g_z)))
        trained = jax.tree_util.tree_map(lambda x: x + 0.5, sent)
        g_phi, g_z = ops.hypernet.hypernet_grads(hn.apply, params, table, ids, sent, trained, w)
        step = lambda t, g: jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, t, g)
        before = ops.hypernet.hypernet_surrogate_loss(hn.apply, params, table, ids, trained, w)
        after = ops.hypernet.hypernet_surrogate_loss(hn.apply, step(params, g_phi), step(table, g_z), ids, trained, w)
        assert float(after) < float(before)
