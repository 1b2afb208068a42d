import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxfl.core.aggregation import masked_mean, member_weights, tree_masked_mean, weighted_mean


class WeightedMeanTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_known_values(self):
        x = jnp.array([[1.0, 2.0], [3.0, 6.0], [5.0, 10.0]])
        w = jnp.array([1.0, 1.0, 2.0])
        out = self.variant(weighted_mean)(x, w)
        np.testing.assert_allclose(out, [(1 + 3 + 10) / 4, (2 + 6 + 20) / 4])

    @chex.variants(with_jit=True, without_jit=True)
    def test_one_client_is_exact_and_zero_weights_are_not_nan(self):
        x = jnp.array([[0.1, 0.7, 1e-8]])
        np.testing.assert_array_equal(self.variant(weighted_mean)(x, jnp.array([17.0])), x[0])
        out = self.variant(weighted_mean)(jnp.ones((3, 2)), jnp.zeros(3))
        assert np.all(np.isfinite(out))

    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_mean_hand_example_three_clients_overlapping(self):
        # entry e0: shared by clients 0,1; e1: by 1,2; e2: by none -> keeps previous; e3: by all
        x = jnp.array([[1.0, 10.0, 7.0, 2.0], [3.0, 20.0, 8.0, 4.0], [5.0, 40.0, 9.0, 6.0]])
        m = jnp.array([[1, 0, 0, 1], [1, 1, 0, 1], [0, 1, 0, 1]], bool)
        w = jnp.array([1.0, 1.0, 2.0])
        prev = jnp.array([-1.0, -2.0, -3.0, -4.0])
        out = self.variant(masked_mean)(x, w, m, prev)
        np.testing.assert_allclose(out, [2.0, (20 + 80) / 3, -3.0, (2 + 4 + 12) / 4])

    def test_masked_mean_grad_and_vmap(self):
        x = jnp.arange(6.0).reshape(3, 2)
        w = jnp.array([1.0, 2.0, 3.0])
        g = jax.grad(lambda x: masked_mean(x, w, jnp.array([1, 1, 0], bool)[:, None], jnp.zeros(2)).sum())(x)
        np.testing.assert_allclose(g, [[1 / 3, 1 / 3], [2 / 3, 2 / 3], [0, 0]], atol=1e-6)
        batched = jax.vmap(lambda xx: weighted_mean(xx, w))(jnp.stack([x, 2 * x]))
        np.testing.assert_allclose(batched[1], 2 * batched[0])

    def test_tree_masked_mean_per_leaf_bools(self):
        tree = {"a": jnp.array([[1.0], [3.0]]), "b": jnp.array([[5.0], [7.0]])}
        prev = {"a": jnp.array([0.0]), "b": jnp.array([-1.0])}
        out = tree_masked_mean(tree, jnp.array([1.0, 1.0]), {"a": True, "b": False}, prev)
        np.testing.assert_array_equal(out["a"], [2.0])
        np.testing.assert_array_equal(out["b"], [-1.0])


class RecoveredMeanTest(chex.TestCase):
    """DapperFL heterogeneous aggregation: W + sum_i p_i m_i (x_i - W), weights not renormalised per entry."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_identities(self):
        from jaxfl.core.aggregation import recovered_mean
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
        prev = jnp.asarray(rng.normal(size=5), jnp.float32)
        w = jnp.array([1.0, 2.0, 5.0])
        m = jnp.asarray(rng.random((3, 5)) < 0.5).at[:, 0].set(False).at[:, 1].set(True)
        fn = self.variant(recovered_mean)
        out = fn(x, w, m, prev)
        p = np.asarray(w) / 8
        expected = np.asarray(prev) + (p[:, None] * np.asarray(m) * (np.asarray(x) - np.asarray(prev))).sum(0)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        assert out[0] == prev[0]  # nobody kept the entry
        np.testing.assert_allclose(out[1], (p[:, None] * np.asarray(x)).sum(0)[1], rtol=1e-6)  # all kept
        np.testing.assert_allclose(fn(jnp.broadcast_to(prev, x.shape), w, m, prev), prev, rtol=1e-6)
        garbage = jnp.where(m, x, 1e6)  # values where m = 0 never matter
        np.testing.assert_allclose(fn(garbage, w, m, prev), out, rtol=1e-6)


def test_member_weights_are_one_per_client_and_zero_per_padding_row():
    w = jnp.asarray([3.0, 0.0, 1.0, 0.0])
    assert np.array_equal(jax.jit(member_weights)(w), [1.0, 0.0, 1.0, 0.0])
    assert member_weights(w).dtype == w.dtype
    batched = jax.vmap(member_weights)(jnp.stack([w, jnp.ones(4)]))
    assert np.array_equal(batched, [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # a uniform mean over them is the mean of the clients alone
    x = jnp.asarray([[1.0], [100.0], [3.0], [-50.0]])
    assert float(weighted_mean(x, member_weights(w))[0]) == 2.0
