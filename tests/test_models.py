import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfl.models import BatchNorm, build_model, conv2d_matmul, count_params, digits_cnn, max_pool2
from jaxfl.errors import ConfigError


@pytest.mark.parametrize("stride,padding,k", [(1, 2, 5), (1, 1, 3), (2, 1, 3), (4, 2, 11)])
def test_conv_matmul_equals_lax_conv(stride, padding, k):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 19, 19, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, k, 3, 5)), jnp.float32)
    ref = jax.lax.conv_general_dilated(x, w, (stride, stride), ((padding, padding),) * 2,
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(conv2d_matmul(x, w, stride, padding), ref, atol=1e-4, rtol=1e-5)
    # gradients too
    g1 = jax.grad(lambda w: jnp.sum(jnp.sin(conv2d_matmul(x, w, stride, padding))))(w)
    g2 = jax.grad(lambda w: jnp.sum(jnp.sin(jax.lax.conv_general_dilated(
        x, w, (stride, stride), ((padding, padding),) * 2, dimension_numbers=("NHWC", "HWIO", "NHWC")))))(w)
    np.testing.assert_allclose(g1, g2, atol=1e-3, rtol=1e-4)


def test_max_pool2():
    x = jnp.arange(2 * 4 * 4 * 1, dtype=jnp.float32).reshape(2, 4, 4, 1)
    np.testing.assert_array_equal(max_pool2(x)[0, :, :, 0], [[5, 7], [13, 15]])


def test_batchnorm_pytorch_semantics_and_mask():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(2.0, 3.0, size=(6, 4)), jnp.float32)
    bn = BatchNorm()
    v = bn.init(jax.random.key(0), x, train=False)
    y, upd = bn.apply(v, x, train=True, mutable=["batch_stats"])
    mean, var = x.mean(0), x.var(0)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), atol=1e-5)
    # running stats: momentum 0.1, unbiased variance (n / (n - 1)), as torch.nn.BatchNorm
    np.testing.assert_allclose(upd["batch_stats"]["mean"], 0.1 * mean, atol=1e-6)
    np.testing.assert_allclose(upd["batch_stats"]["var"], 0.9 + 0.1 * x.var(0, ddof=1), atol=1e-5)
    # masked: padded rows (garbage) change nothing for the real rows nor the statistics
    xp = jnp.concatenate([x, 1e3 * jnp.ones((3, 4))])
    mask = jnp.array([1.0] * 6 + [0.0] * 3)
    yp, updp = bn.apply(v, xp, train=True, mask=mask, mutable=["batch_stats"])
    np.testing.assert_allclose(yp[:6], y, atol=1e-5)
    np.testing.assert_allclose(updp["batch_stats"]["var"], upd["batch_stats"]["var"], atol=1e-5)
    # an all-padding batch leaves the running statistics alone
    _, upd0 = bn.apply(v, x, train=True, mask=jnp.zeros(6), mutable=["batch_stats"])
    np.testing.assert_array_equal(upd0["batch_stats"]["var"], v["batch_stats"]["var"])
    # eval uses the running statistics
    ye = bn.apply({"params": v["params"], "batch_stats": upd["batch_stats"]}, x, train=False)
    np.testing.assert_allclose(ye, (x - upd["batch_stats"]["mean"]) / np.sqrt(upd["batch_stats"]["var"] + 1e-5),
                               atol=1e-5)


def test_digits_cnn_matches_fedbn_digit_model():
    m = digits_cnn()
    v = m.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    assert m.apply(v, jnp.zeros((2, 32, 32, 3)), train=False).shape == (2, 10)
    assert m.apply(v, jnp.zeros((2, 32, 32, 3)), method=m.features).shape == (2, 8192)
    # conv 4,864 + 102,464 + 204,928; fc 16,779,264 + 1,049,088 + 5,130; BN 2*(64+64+128+2048+512)
    assert count_params(v["params"]) == 4864 + 102464 + 204928 + 16779264 + 1049088 + 5130 + 2 * 2816
    # PyTorch default init: kernel and bias ~ U(+-1/sqrt(fan_in))
    k = np.asarray(v["params"]["encoder"]["conv2"]["kernel"])
    assert np.abs(k).max() <= 1 / np.sqrt(64 * 25) and np.abs(k).max() > 0.9 / np.sqrt(64 * 25)


def test_unknown_model_lists_valid():
    with pytest.raises(ConfigError, match="unknown model 'resnet99'; valid: digits_cnn, small_cnn"):
        build_model("resnet99", 10)
