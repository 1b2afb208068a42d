"""Shared losses and metrics: known values, invariances, padding weights, jit/vmap/grad."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfl import ops
from jaxfl.core.trees import count_params
from jaxfl.models import digits_cnn, small_cnn


class LossesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_symmetric_kl(self):
        a, b = jnp.array([[1.0, 0.0, -1.0]]), jnp.array([[0.0, 2.0, 0.5]])
        p, q = jax.nn.softmax(a), jax.nn.softmax(b)
        expected = jnp.sum(p * jnp.log(p / q) + q * jnp.log(q / p))
        np.testing.assert_allclose(self.variant(ops.losses.symmetric_kl)(a, b), [expected], rtol=1e-5)
        np.testing.assert_allclose(ops.losses.symmetric_kl(b, a), [expected], rtol=1e-5)
        np.testing.assert_allclose(ops.losses.symmetric_kl(a, a + 3.0), [0.0], atol=1e-6)  # shift-invariant logits
        ga, gb = jax.grad(lambda a, b: ops.losses.symmetric_kl(a, b).sum(), (0, 1))(a, b)
        assert np.abs(ga).sum() > 0 and np.abs(gb).sum() > 0  # gradients reach both heads

    @chex.variants(with_jit=True, without_jit=True)
    def test_negative_entropy(self):
        np.testing.assert_allclose(self.variant(ops.losses.negative_entropy)(jnp.zeros((2, 10))), [-math.log(10)] * 2,
                                   rtol=1e-6)
        np.testing.assert_allclose(ops.losses.negative_entropy(jnp.array([[1e4, 0.0, 0.0]])), [0.0], atol=1e-6)
        g = jax.grad(lambda z: ops.losses.negative_entropy(z).sum())(jnp.array([[2.0, 0.0, 0.0]]))
        assert g[0, 0] > 0  # descending it flattens the prediction (raises entropy)

    def test_feature_norm_and_its_gradient(self):
        z = jnp.array([[3.0, 4.0], [0.0, 0.0]])
        np.testing.assert_allclose(ops.losses.feature_norm(z), [5.0, 0.0])
        np.testing.assert_allclose(ops.losses.feature_norm(z, squared=True), [25.0, 0.0])
        g = jax.grad(lambda z: jnp.mean(ops.losses.feature_norm(z)))(z)
        np.testing.assert_allclose(g, [[0.3, 0.4], [0.0, 0.0]], rtol=1e-6)  # z_b / (B ||z_b||), finite at 0
        g2 = jax.grad(lambda z: jnp.mean(ops.losses.feature_norm(z, squared=True)))(z)
        np.testing.assert_allclose(g2, z, rtol=1e-6)  # 2 z_b / B


class MetricsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_ece_hand_example_and_padding(self):
        conf = jnp.array([0.95, 0.95, 0.55, 0.55, 0.0])
        correct = jnp.array([1, 0, 1, 1, 0])
        w = jnp.array([1, 1, 1, 1, 0])
        # bins: (0.9,1]: acc .5 conf .95, n 2; (0.533,0.6]: acc 1 conf .55, n 2 -> (2*.45 + 2*.45)/4
        got = self.variant(lambda c, k, w: ops.diagnostics.expected_calibration_error(c, k, 15, w))(conf, correct, w)
        np.testing.assert_allclose(got, 0.45, rtol=1e-6)
        np.testing.assert_allclose(ops.diagnostics.expected_calibration_error(jnp.ones(4), jnp.ones(4)), 0.0)
        with pytest.raises(ValueError, match="n_bins=0 must be an integer >= 1"):  # (0 bins: an ECE of 0, silently)
            ops.diagnostics.expected_calibration_error(jnp.ones(4), jnp.ones(4), 0)

    def test_auroc(self):
        np.testing.assert_allclose(ops.diagnostics.auroc(jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0])), 1.0)
        np.testing.assert_allclose(ops.diagnostics.auroc(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])), 0.0)
        np.testing.assert_allclose(ops.diagnostics.auroc(jnp.array([1.0, 3.0]), jnp.array([2.0, 2.0])), 0.5)
        np.testing.assert_allclose(ops.diagnostics.auroc(jnp.array([2.0]), jnp.array([2.0, 1.0])), 0.75)
        # n+ n- past 2^31 (a test set of ~50,000 per side): no integer overflow, all ties counted half
        np.testing.assert_allclose(ops.diagnostics.auroc(np.ones(50_000), np.ones(50_000)), 0.5, rtol=1e-5)

    def test_sparsity_ratio(self):
        z = jnp.array([[0.0, 1.0, 0.0, 2.0], [1.0, 1.0, 1.0, 0.0]])
        np.testing.assert_allclose(ops.diagnostics.sparsity_ratio(z), (0.5 + 0.25) / 2)
        np.testing.assert_allclose(ops.diagnostics.sparsity_ratio(1e-3 * z), ops.diagnostics.sparsity_ratio(z))
        np.testing.assert_allclose(ops.diagnostics.sparsity_ratio(z, weights=jnp.array([1.0, 0.0])), 0.5)

    def test_fisher_score_hand_example_and_invariances(self):
        z = jnp.array([[1.0, 5.0], [3.0, 5.0], [5.0, 1.0], [7.0, 1.0]])
        y = jnp.array([0, 0, 1, 1])
        f = ops.diagnostics.fisher_score(z, y, 2)
        # feature 0: class means 2, 6, overall 4: between = 2*4 + 2*4 = 16; within = 4 * 1 = 4 -> 4
        np.testing.assert_allclose(f[0], 4.0, rtol=1e-5)
        assert float(f[1]) > 1e10  # constant within class, different between classes
        np.testing.assert_allclose(ops.diagnostics.fisher_score(-3 * z + 7, y, 2)[0], 4.0, rtol=1e-5)
        same = jnp.array([[1.0], [2.0], [1.0], [2.0]])
        np.testing.assert_allclose(ops.diagnostics.fisher_score(same, y, 2), [0.0], atol=1e-6)
        np.testing.assert_allclose(ops.diagnostics.fisher_score(jnp.ones((4, 1)), y, 2), [0.0])
        padded = ops.diagnostics.fisher_score(jnp.concatenate([z, 50 * jnp.ones((1, 2))]), jnp.array([0, 0, 1, 1, 1]),
                                              2, jnp.array([1, 1, 1, 1, 0.0]))
        np.testing.assert_allclose(padded[0], 4.0, rtol=1e-5)

    def test_overlap_and_selection_ratio(self):
        a = jnp.array([1, 1, 0, 0], bool)
        np.testing.assert_allclose(ops.diagnostics.overlap_ratio(a, a), 1.0)
        np.testing.assert_allclose(ops.diagnostics.overlap_ratio(a, ~a), 0.0)
        np.testing.assert_allclose(ops.diagnostics.overlap_ratio(a, jnp.array([1, 0, 1, 0], bool)), 1 / 3)
        np.testing.assert_allclose(ops.diagnostics.selection_ratio(jnp.array([[1.0, 0.0], [1.0, 1.0]])), 0.75)

    def test_params_and_flops_of_a_masked_model(self):
        model = small_cnn(num_classes=3, width=4)  # conv3x3(3->4) on 8x8, pool, dense(64->3)
        x = jnp.zeros((2, 8, 8, 3))
        v = model.init(jax.random.key(0), x)
        pos = ops.diagnostics.layer_positions(model, v, x)
        assert pos == {("encoder", "conv1", "kernel"): 64, ("head", "fc1", "linear", "kernel"): 1}
        dense_flops = 2 * (64 * 3 * 3 * 3 * 4 + 64 * 3)
        assert int(ops.diagnostics.masked_flops(v["params"], pos)) == dense_flops
        conv_mask = ops.masks.channel_mask(v["params"]["encoder"]["conv1"]["kernel"], 0.5)  # keep 2 of 4 out-channels
        masks = {"encoder": {"conv1": {"kernel": conv_mask, "bias": True}, "bn1": {"scale": True, "bias": True}},
                 "head": {"fc1": {"linear": {"kernel": True, "bias": True}}}}
        assert int(ops.diagnostics.masked_flops(v["params"], pos, masks)) == 2 * (64 * 27 * 2 + 64 * 3)
        total = count_params(v["params"])
        assert int(count_params(v["params"], masks)) == total - 27 * 2
        # the FedBN digits CNN: 18,151,370 parameters (fedpick spec section 2 layout)
        big = digits_cnn()
        shapes = jax.eval_shape(big.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        assert count_params(shapes["params"]) == 18151370


def test_knn_predict_and_fisher_selection_probe():
    from jaxfl import ops
    train = jnp.array([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0]])
    labels = jnp.array([0, 0, 1, 1])
    np.testing.assert_array_equal(
        ops.diagnostics.knn_predict(train, labels, jnp.array([[0.2, 0.1], [4.0, 4.5]]), 2, k=1), [0, 1])
    # ties between two classes go to the smaller label
    np.testing.assert_array_equal(ops.diagnostics.knn_predict(train, labels, jnp.array([[2.5, 2.5]]), 2, k=4), [0])
    # feature 0 carries the label, features 1..7 are noise of a much larger scale: keeping only the top
    # Fisher-score dimension beats keeping all of them
    key = jax.random.key(0)
    y = jax.random.randint(key, (400,), 0, 2)
    z = jnp.concatenate([y[:, None] * 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (400, 1)),
                         5.0 * jax.random.normal(jax.random.key(2), (400, 7))], 1)
    accs = ops.diagnostics.fisher_selection_probe(z[:300], y[:300], z[300:], y[300:], 2, ratios=(0.125, 1.0), k=10)
    assert float(accs[0]) > 0.95 and float(accs[0]) > float(accs[1]) + 0.1


def test_reduce_kl_matches_pytorch_reductions_over_real_samples():
    kl = jnp.array([0.4, 1.2, 2.0, 7.0])
    w = jnp.array([1.0, 1.0, 1.0, 0.0])  # the last is padding
    np.testing.assert_allclose(ops.losses.reduce_kl(kl, w, 4, "sum"), 3.6, rtol=1e-6)
    np.testing.assert_allclose(ops.losses.reduce_kl(kl, w, 4, "batchmean"), 1.2, rtol=1e-6)
    np.testing.assert_allclose(ops.losses.reduce_kl(kl, w, 4, "mean"), 0.3, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(ops.losses.reduce_kl, static_argnums=(2, 3))(kl, w, 4, "mean"), 0.3, rtol=1e-6)
    with pytest.raises(ValueError, match="reduction='none'"):
        ops.losses.reduce_kl(kl, w, 4, "none")
