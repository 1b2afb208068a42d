import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import bit_identity, rounding_tolerance

from jaxfl.core.trees import count_params
from jaxfl.errors import ConfigError
from jaxfl.models import BatchNorm, build_model, conv2d, conv2d_matmul, digits_cnn, max_pool2
from jaxfl.models import kernel_matmul
from jaxfl.models.layers import TRANSPOSED_KERNEL_GRAD_MIN


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


def _convolutions(fn, *args) -> int:
    """How many convolution ops the program ``fn(*args)`` compiles to on this platform (0: slices and matmuls)."""
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.convolution")


@pytest.mark.parametrize("stride,padding,k", [(1, 2, 5), (2, 1, 3)])
def test_conv2d_evaluates_with_xla_convolution_on_cpu_and_differentiates_as_conv2d_matmul(stride, padding, k):
    """``conv2d`` = the convolution formula: XLA's convolution when no derivative is taken (on a CPU; not under
    vmap with a kernel per lane, where it is the batched matmul), and ``conv2d_matmul``'s own gradients, first and
    second order, when one is taken."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 13, 13, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, k, 3, 4)), jnp.float32)
    lax_conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (stride, stride), ((padding, padding),) * 2, dimension_numbers=("NHWC", "HWIO", "NHWC")))
    ours = lambda x, w: conv2d(x, w, stride, padding)  # noqa: E731
    matmul = lambda x, w: conv2d_matmul(x, w, stride, padding)  # noqa: E731
    on_cpu = jax.default_backend() == "cpu"
    assert _convolutions(ours, x, w) == (1 if on_cpu else 0)
    np.testing.assert_allclose(jax.jit(ours)(x, w), lax_conv(x, w), atol=rounding_tolerance(lax_conv, x, w), rtol=0)
    # differentiated: conv2d_matmul's program, no convolution op
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w)))  # noqa: E731
    assert _convolutions(jax.grad(loss(ours), (0, 1)), x, w) == 0
    want = jax.jit(jax.grad(loss(matmul), (0, 1)))
    for a, b, t in zip(jax.jit(jax.grad(loss(ours), (0, 1)))(x, w), want(x, w), rounding_tolerance(want, x, w)):
        np.testing.assert_allclose(a, b, atol=t, rtol=0)
    second = lambda conv: jax.jit(jax.grad(lambda w: jnp.sum(jnp.cos(jax.grad(loss(conv), 1)(x, w)))))  # noqa: E731
    np.testing.assert_allclose(second(ours)(w), second(matmul)(w), atol=rounding_tolerance(second(matmul), w),
                               rtol=0)
    # vmap: a kernel per lane (clients' own models) -> the batched matmul; one kernel -> one convolution
    xs, ws = jnp.stack([x, x[::-1]]), jnp.stack([w, -0.5 * w])
    per_lane = jax.vmap(ours)
    assert _convolutions(per_lane, xs, ws) == 0
    want = jax.jit(jax.vmap(matmul))
    np.testing.assert_allclose(jax.jit(per_lane)(xs, ws), want(xs, ws), atol=rounding_tolerance(want, xs, ws), rtol=0)
    shared = jax.vmap(ours, in_axes=(0, None))
    assert _convolutions(shared, xs, w) == (1 if on_cpu else 0)
    want = jax.jit(jax.vmap(lax_conv, in_axes=(0, None)))
    np.testing.assert_allclose(jax.jit(shared)(xs, w), want(xs, w), atol=rounding_tolerance(want, xs, w), rtol=0)
    # clients one after another (lax.map, the CPU default): XLA's convolution inside the loop body
    mapped = lambda xs, ws: jax.lax.map(lambda a: ours(*a), (xs, ws))  # noqa: E731
    assert _convolutions(mapped, xs, ws) == (1 if on_cpu else 0)
    np.testing.assert_allclose(jax.jit(mapped)(xs, ws), jax.jit(jax.vmap(lax_conv))(xs, ws),
                               atol=rounding_tolerance(jax.jit(jax.vmap(lax_conv)), xs, ws), rtol=0)


@bit_identity("conv2d's custom VJP runs conv2d_matmul's forward and backward functions unchanged")
def test_conv2d_trains_as_conv2d_matmul_bit_for_bit():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 10, 10, 2)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 2, 16)), jnp.float32)
    loss = lambda conv: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda x, w: jnp.sum(jnp.tanh(conv(x, w, 1, 1))), (0, 1)))
    (va, (ga, gb)), (vb, (ha, hb)) = loss(conv2d)(x, w), loss(conv2d_matmul)(x, w)
    np.testing.assert_array_equal(va, vb)
    np.testing.assert_array_equal(ga, ha)
    np.testing.assert_array_equal(gb, hb)


@pytest.mark.parametrize("k", [27, 288])  # either side of TRANSPOSED_KERNEL_GRAD_MIN
@pytest.mark.parametrize("side", [6, 12])  # N = 2 side^2 rows: 72 (autodiff's gradient), 288 (written out)
def test_kernel_matmul_gradients_are_the_matmuls(k, side):
    """d cols = g w^T and d w = cols^T g, however the kernel's product is ordered, under jit, vmap and grad."""
    assert (k >= TRANSPOSED_KERNEL_GRAD_MIN) == (k == 288)
    rng = np.random.default_rng(0)
    cols = jnp.asarray(rng.normal(size=(2, side, side, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, 5)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, side, side, 5)), jnp.float32)
    written = "custom_vjp_call" in str(jax.make_jaxpr(kernel_matmul)(cols, w))
    assert written == (2 * side * side >= TRANSPOSED_KERNEL_GRAD_MIN)
    formula = jax.jit(lambda c, w, g: (g @ w.T, c.reshape(-1, k).T @ g.reshape(-1, 5)))
    got = jax.jit(lambda c, w, g: jax.vjp(kernel_matmul, c, w)[1](g))
    np.testing.assert_array_equal(kernel_matmul(cols, w), cols @ w)
    for a, b, t in zip(got(cols, w, g), formula(cols, w, g), rounding_tolerance(formula, cols, w, g)):
        np.testing.assert_allclose(a, b, atol=t, rtol=0)
    stacked = [jnp.stack([a, a * 0.5]) for a in (cols, w, g)]  # two clients on a vmapped axis
    for a, b, t in zip(jax.vmap(got)(*stacked), jax.vmap(formula)(*stacked),
                       rounding_tolerance(jax.jit(jax.vmap(formula)), *stacked)):
        np.testing.assert_allclose(a, b, atol=t, rtol=0)
    # second order (a gradient through the gradient, as meta-learning takes it): the same as the plain matmul's
    second = lambda mm: jax.jit(jax.grad(lambda w: jnp.sum(jnp.sin(jax.grad(  # noqa: E731
        lambda w: jnp.sum(jnp.sin(mm(cols, w))))(w)))))
    want = second(jnp.matmul)
    np.testing.assert_allclose(second(kernel_matmul)(w), want(w), atol=rounding_tolerance(want, w), rtol=0)


def test_dense_draws_and_computes_as_flax_dense():
    """``Dense`` keeps ``nn.Dense(name="linear")``'s parameters (names, shapes, the same draws from the same key), so
    checkpoints, converters and experiment logs made with it still apply; outputs equal, gradients equal up to
    float reassociation (its kernel gradient is ``kernel_matmul``'s once the rows reach the threshold)."""
    import flax.linen as nn

    from jaxfl.models.layers import Dense, torch_bias_init, torch_kernel_init

    class FlaxDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(7, kernel_init=torch_kernel_init, bias_init=torch_bias_init(x.shape[-1]),
                            name="linear")(x)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 100, 300)), jnp.float32)  # 300 rows, K = 300
    ours, flax_ = Dense(7).init(jax.random.key(5), x), FlaxDense().init(jax.random.key(5), x)
    jax.tree.map(np.testing.assert_array_equal, ours, flax_)
    np.testing.assert_array_equal(Dense(7).apply(ours, x), FlaxDense().apply(flax_, x))
    loss = lambda mod: jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(mod.apply(v, x)))))  # noqa: E731
    want = loss(FlaxDense())
    jax.tree.map(lambda a, b, t: np.testing.assert_allclose(a, b, atol=t, rtol=0),
                 loss(Dense(7))(ours), want(flax_), rounding_tolerance(want, flax_))


@pytest.mark.parametrize("model,batch,shape,written", [("mlp_2nn", 10, (28, 28, 1), False),
                                                        ("mlp_2nn", 512, (28, 28, 1), True),
                                                        ("vit_tiny", 4, (32, 32, 3), True)])
def test_kernel_matmul_written_out_only_for_many_rows(model, batch, shape, written):
    """A small model at a small batch differentiates its Dense layers as autodiff does (the program it had
    before ``kernel_matmul``); many rows (a large batch, a ViT's batch x tokens) take the written-out gradient."""
    mdl = build_model(model, 10)
    x = jnp.zeros((batch,) + shape)
    params = mdl.init(jax.random.key(0), x[:1])["params"]
    jaxpr = str(jax.make_jaxpr(lambda p: mdl.apply({"params": p}, x))(params))  # (grad inlines the custom VJP)
    assert ("custom_vjp_call" in jaxpr) == written


def test_max_pool2():
    x = jnp.arange(2 * 4 * 4 * 1, dtype=jnp.float32).reshape(2, 4, 4, 1)
    np.testing.assert_array_equal(max_pool2(x)[0, :, :, 0], [[5, 7], [13, 15]])


def test_max_last_value_and_gradient_to_the_first_argmax():
    from jaxfl.models import max_last
    v = jnp.array([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 4.0]])
    g = jnp.array([10.0, 20.0])
    for fn in (max_last, jax.jit(max_last)):
        np.testing.assert_array_equal(fn(v), [3.0, 5.0])
        _, vjp = jax.vjp(fn, v)
        np.testing.assert_array_equal(vjp(g)[0], [[0, 10, 0, 0], [0, 0, 20, 0]])  # a tie goes to the first max
    np.testing.assert_array_equal(jax.vmap(jax.grad(lambda r: max_last(r) * 2.0))(v), [[0, 2, 0, 0], [0, 0, 2, 0]])


def test_jitted_gradient_of_a_masked_conv_pool_net_equals_eager_and_finite_differences():
    # Regression: with the default max gradient (winner found by comparing the input with the max again),
    # XLA:CPU recomputed the input with other rounding and this gradient was 45% off under jit.
    from jaxfl.core.metrics import cross_entropy, weighted_mean_loss
    from jaxfl.models import small_cnn
    model = small_cnn(num_classes=4, width=4)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 256, (8, 8, 8, 3)).astype(np.float32) / 255)
    y = jnp.asarray(rng.integers(0, 4, 8))
    w = (jnp.arange(8) < 3).astype(jnp.float32)
    v = model.init(jax.random.key(0), x)

    def loss(p, x, w):
        logits, _ = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x, train=True, mask=w,
                                mutable=["batch_stats"])
        return weighted_mean_loss(cross_entropy(logits, y), w)
    grad = jax.grad(loss)
    eager, jitted = grad(v["params"], x, w), jax.jit(grad)(v["params"], x, w)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    k = v["params"]["encoder"]["conv1"]["kernel"]
    at = lambda d: jax.tree_util.tree_map(lambda a: a, dict(v["params"], encoder=dict(
        v["params"]["encoder"], conv1=dict(v["params"]["encoder"]["conv1"], kernel=k.at[1, 1, 1, 1].add(d)))))
    fd = (loss(at(1e-3), x, w) - loss(at(-1e-3), x, w)) / 2e-3
    np.testing.assert_allclose(jitted["encoder"]["conv1"]["kernel"][1, 1, 1, 1], fd, rtol=2e-2)


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


# --- backbones for the paper comparisons -----------------------------------------------------------------
from jaxfl.core.trees import count_params as count_kept  # noqa: E402
from jaxfl.models import (adaptive_avg_pool, alexnet_bn, max_pool, resnet10, resnet10_slim, resnet18,  # noqa: E402
                          vit_small)


@pytest.mark.parametrize("factory,shape,expected", [
    (alexnet_bn, (1, 256, 256, 3), 57_063_498),       # rfeddis spec: encoder 2,469,696 + 2,304 BN + head
    (resnet10, (1, 32, 32, 3), 4_903_242),            # dapperfl spec
    (resnet10_slim, (1, 32, 32, 3), 308_826),         # stem 464, stages 4,672 + 14,528 + 57,728 + 230,144, head 1,290
    (resnet18, (1, 32, 32, 3), 11_173_962),           # dapperfl spec
    (lambda: resnet18(stem="imagenet"), (1, 224, 224, 3), 11_181_642),  # torchvision resnet18, 10 classes
    (lambda: build_model("resnet18_imagenet", 10), (1, 32, 32, 3), 11_181_642),  # the same, FedSelect's inputs
    (vit_small, (1, 32, 32, 3), 2_645_898),           # fedtp spec: ~2.65M at depth 8
])
def test_parameter_counts(factory, shape, expected):
    model = factory()
    v = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(shape))
    assert count_kept(v["params"]) == expected
    assert jax.eval_shape(model.apply, v, jnp.zeros(shape)).shape == (1, 10)


def test_alexnet_takes_63_pixels_a_side_and_names_a_smaller_input():
    # 63x63: the last max-pool sees 3x3 (15 -> 7 -> 3); at 62 it would see 2x2 and return an empty map
    model = alexnet_bn()
    v = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 63, 63, 3)))
    assert jax.eval_shape(model.apply, v, jnp.zeros((1, 63, 63, 3))).shape == (1, 10)
    with pytest.raises(ConfigError, match="at least 63x63 pixels .*got 62x63"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 62, 63, 3)))


@pytest.mark.parametrize("name,x,expected,classes", [
    ("logreg", jnp.zeros((2, 28, 28, 1)), 7_850, 10),              # 784 x 10 + 10
    ("mlp_2nn", jnp.zeros((2, 28, 28, 1)), 199_210, 10),           # McMahan et al.: 784-200-200-10
    ("femnist_cnn", jnp.zeros((2, 28, 28, 1)), 6_603_710, 62),     # LEAF: 832 + 51,264 + 6,424,576 + 127,038
    ("char_lstm", jnp.zeros((2, 80), jnp.int32), 817_872, 80),     # LEAF: 640 + 271,360 + 525,312 + 20,560
    ("cnn_dropout", jnp.zeros((2, 28, 28, 1)), 1_206_590, 62),    # Reddi et al.: 320 + 18,496 + 1,179,776 + 7,998
    ("cnn_dropout", jnp.zeros((2, 32, 32, 3)), 1_626_442, 10),    # pfl-research: 896 + 18,496 + 1,605,760 + 1,290
])
def test_small_models_have_their_papers_sizes(name, x, expected, classes):
    model = build_model(name, classes)
    v = jax.eval_shape(model.init, jax.random.key(0), x)
    assert count_kept(v["params"]) == expected
    assert jax.eval_shape(model.apply, v, x).shape == (2, classes)


def test_char_lstm_reads_token_order_and_only_the_last_step_feeds_the_head():
    model = build_model("char_lstm", 80)
    x = jax.random.randint(jax.random.key(1), (3, 20), 0, 80)
    v = model.init(jax.random.key(0), x)
    out = model.apply(v, x)
    assert not np.allclose(out, model.apply(v, x[:, ::-1]), atol=1e-6)  # order matters
    z = model.apply(v, x, method="features")
    assert z.shape == (3, 256)
    np.testing.assert_allclose(out, z @ v["params"]["head"]["fc1"]["linear"]["kernel"]
                               + v["params"]["head"]["fc1"]["linear"]["bias"], rtol=1e-5, atol=1e-5)


def test_fused_char_lstm_matches_flax_lstm_cells_in_values_and_gradients():
    # the default LSTM layer (input projections hoisted, hand-written VJP) against nn.RNN(OptimizedLSTMCell):
    # the same parameter tree and initial values, the same logits and gradients; under vmap over clients too
    from jaxfl.models import CharLSTMEncoder, Classifier, MLPHead
    fused = build_model("char_lstm", 80)
    ref = Classifier(CharLSTMEncoder(impl="flax", unroll=1), MLPHead((), 80))
    x = jax.random.randint(jax.random.key(1), (4, 2, 13), 0, 80)  # 4 clients x 2 sequences of 13 characters
    y = jax.random.randint(jax.random.key(2), (4, 2), 0, 80)
    v = fused.init(jax.random.key(0), x[0])
    v_ref = ref.init(jax.random.key(0), x[0])
    assert jax.tree_util.tree_structure(v) == jax.tree_util.tree_structure(v_ref)
    for a, b in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(v_ref)):
        np.testing.assert_array_equal(a, b)
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a * (1 + 0.1 * i) for i in range(4)]), v["params"])

    def loss(model):
        def f(p, x, y):
            logits = model.apply({"params": p}, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
        return jax.jit(jax.vmap(jax.value_and_grad(f)))

    (l1, g1), (l2, g2) = loss(fused)(stacked, x, y), loss(ref)(stacked, x, y)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_pools_match_reference_windows():
    x = jax.random.normal(jax.random.key(0), (2, 7, 7, 3))
    ref = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "VALID")
    np.testing.assert_array_equal(max_pool(x, 3, 2), ref)
    ref = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))
    np.testing.assert_array_equal(max_pool(x, 3, 2, 1), ref)
    # adaptive 7 -> 6 is exactly a 2x2 stride-1 average pool; 6 -> 6 is the identity
    ref = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "VALID") / 4
    np.testing.assert_allclose(adaptive_avg_pool(x, 6), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adaptive_avg_pool(x[:, :6, :6], 6), x[:, :6, :6], rtol=1e-6)


def test_resnet_forward_under_vmap_over_clients():
    model = resnet10(num_classes=5)
    x = jax.random.normal(jax.random.key(1), (3, 2, 16, 16, 3))  # 3 clients x 2 images
    v = jax.jit(model.init)(jax.random.key(0), x[0])  # jitted: op by op, a ResNet's init takes 2-3x longer
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 1.01, a * 0.99]), v)
    apply = lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])
    out, upd = jax.jit(jax.vmap(apply))(stacked, x)
    assert out.shape == (3, 2, 5)
    one, _ = jax.jit(apply)(jax.tree_util.tree_map(lambda a: a[2], stacked), x[2])
    np.testing.assert_allclose(out[2], one, rtol=1e-4, atol=1e-5)
    v18 = jax.eval_shape(resnet18().init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    stacked18 = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((4,) + a.shape, a.dtype), v18)
    shapes = jax.eval_shape(jax.vmap(resnet18().apply), stacked18, jnp.zeros((4, 2, 32, 32, 3)))
    assert shapes.shape == (4, 2, 10)


def test_attention_is_multi_head_softmax_attention():
    """Attention against the formula as FedTP's torch ViT writes it: [q | k | v] = x W_qkv, each split into heads
    of dim_head consecutive columns, softmax(q k^T / sqrt(dim_head)) v per head, heads concatenated, then the out
    projection; computed here in float64 numpy, under jit, vmap (two inputs) and grad."""
    from jaxfl.models.layers import Attention

    b, n, d, heads, e = 2, 5, 8, 3, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    att = Attention(heads, e, dropout=0.0)
    params = att.init(jax.random.key(0), x)["params"]

    def formula(params, x):
        x, w = np.asarray(x, np.float64), np.asarray(params["qkv"], np.float64)
        q, k, v = np.split(x @ w, 3, axis=-1)
        outs = []
        for i in range(heads):
            qi, ki, vi = (t[..., i * e:(i + 1) * e] for t in (q, k, v))
            z = qi @ ki.transpose(0, 2, 1) / np.sqrt(e)
            p = np.exp(z - z.max(-1, keepdims=True))
            outs.append((p / p.sum(-1, keepdims=True)) @ vi)
        lin = params["out"]["linear"]
        return np.concatenate(outs, -1) @ np.asarray(lin["kernel"], np.float64) + np.asarray(lin["bias"])

    apply = jax.jit(lambda p, x: att.apply({"params": p}, x))
    tol = rounding_tolerance(apply, params, x)
    np.testing.assert_allclose(apply(params, x), formula(params, x), atol=tol, rtol=0)
    xs = jnp.stack([x, x[::-1] * 2])
    vapply = jax.jit(jax.vmap(apply, in_axes=(None, 0)))
    got, vtol = vapply(params, xs), rounding_tolerance(vapply, params, xs)
    for i in range(2):
        np.testing.assert_allclose(got[i], formula(params, xs[i]), atol=vtol, rtol=0)
    # grad: the gradient of a scalar of the output against central differences of the float64 formula
    grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(apply(p, x)))))
    gw, gtol = grad(params)["qkv"], rounding_tolerance(grad, params)["qkv"]
    i, j, h = 3, 7, 1e-6
    unit = np.zeros((d, 3 * heads * e))
    unit[i, j] = 1.0
    bump = lambda sign: {**params, "qkv": np.asarray(params["qkv"], np.float64) + sign * h * unit}  # noqa: E731
    fd = (np.sin(formula(bump(1), x)).sum() - np.sin(formula(bump(-1), x)).sum()) / (2 * h)
    np.testing.assert_allclose(gw[i, j], fd, atol=gtol, rtol=0)


def test_vit_external_qkv_replaces_its_own_projections():
    model = vit_small(num_classes=3, depth=2)
    x = jax.random.normal(jax.random.key(2), (2, 32, 32, 3))
    v = jax.jit(model.init)(jax.random.key(0), x)
    assert v["params"]["encoder"]["attn0"]["qkv"].shape == (128, 1536)
    shape = model.encoder.qkv_shape()
    assert shape == (2, 128, 1536)
    ext = jax.jit(lambda k, x, q: model.init(k, x, qkv=q))(jax.random.key(0), x, jnp.zeros(shape))
    assert "qkv" not in ext["params"]["encoder"]["attn0"]  # the shared part has no attention projections
    own = jnp.stack([v["params"]["encoder"][f"attn{i}"]["qkv"] for i in range(2)])
    with_qkv = jax.jit(lambda ext, x, q: model.apply(ext, x, qkv=q))(ext, x, own)
    own_qkv = jax.jit(model.apply)
    # another program: equal up to float32 rounding of the model with its own projections
    np.testing.assert_allclose(with_qkv, own_qkv(v, x), atol=rounding_tolerance(own_qkv, v, x), rtol=0)
    assert not np.allclose(model.apply(ext, x, qkv=own * 3), model.apply(ext, x, qkv=own))
    # vmapped over clients with per-client qkv
    out = jax.vmap(lambda q, x: model.apply(ext, x, qkv=q))(jnp.stack([own, own * 2]), jnp.stack([x, x]))
    assert out.shape == (2, 2, 3)
    # dropout is active only in training and follows the key
    a = model.apply(v, x, train=True, rngs={"dropout": jax.random.key(1)})
    b = model.apply(v, x, train=True, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(a, b)


def test_cnn_dropout_drops_in_training_only():
    """Evaluation is the plain network relu(relu(conv(conv(x)))) -> pool -> fc -> head (no dropout); training
    draws its masks from the ``dropout`` rng: two keys give different logits, one key the same."""
    model = build_model("cnn_dropout", 10)
    x = jax.random.uniform(jax.random.key(1), (4, 32, 32, 3))
    v = model.init(jax.random.key(0), x)
    p = v["params"]["encoder"]
    relu = jax.nn.relu
    conv = lambda h, c: jax.lax.conv_general_dilated(h, c["kernel"], (1, 1), "VALID",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + c["bias"]
    h = relu(conv(relu(conv(x, p["conv1"])), p["conv2"]))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").reshape(4, -1)
    h = relu(h @ p["fc"]["linear"]["kernel"] + p["fc"]["linear"]["bias"])
    head = v["params"]["head"]["fc1"]["linear"]
    expected = h @ head["kernel"] + head["bias"]
    evaluate = jax.jit(lambda x: model.apply(v, x))
    np.testing.assert_allclose(evaluate(x), expected, rtol=0, atol=rounding_tolerance(evaluate, x))
    features = lambda k: model.apply(v, x, train=True, rngs={"dropout": jax.random.key(k)}, method=model.features)
    assert not np.array_equal(features(0) == 0, features(1) == 0)
    # the same key drops the same units, eager or jitted (the kept values agree up to rounding)
    np.testing.assert_array_equal(features(0) == 0, jax.jit(features, static_argnums=0)(0) == 0)


def test_resnet18_gn_is_the_fedopt_resnet_v2_with_group_norm():
    # the FedOpt CIFAR-100 network: conv7x7 stem, 4 stages of 2 pre-activation blocks at stride 1, GroupNorm;
    # its parameters counted by hand, and GroupNorm makes each sample's logits independent of the batch
    from jaxfl.models import build_model
    model = build_model("resnet18_gn", 100)
    x = jax.random.uniform(jax.random.key(1), (3, 24, 24, 3))
    v = model.init(jax.random.key(0), x, train=False)
    gn = lambda c: 2 * c  # noqa: E731  (scale and bias)
    count, width = 7 * 7 * 3 * 64 + gn(64), 64
    for w in (64, 128, 256, 512):
        for b in range(2):
            first = w == 64 and b == 0
            count += (0 if first else gn(width)) + 9 * width * w + gn(w) + 9 * w * w
            if width != w:
                count += width * w + gn(w)
            width = w
    count += gn(512) + 512 * 100 + 100
    assert sum(a.size for a in jax.tree_util.tree_leaves(v["params"])) == count
    assert "batch_stats" not in v
    out = model.apply(v, x, train=True)
    alone = model.apply(v, x[:1], train=True)
    np.testing.assert_allclose(out[:1], alone, rtol=1e-5, atol=1e-5)
    assert model.apply(v, jnp.zeros((2, 32, 32, 3)), train=False).shape == (2, 100)


def test_word_lstm_is_the_fedopt_stack_overflow_network():
    # Embedding(V, 96) - LSTM(670) - Dense(96) - Dense(V): its parameters counted by hand
    from jaxfl.models import build_model
    v = build_model("word_lstm", 10004).init(jax.random.key(0), jnp.zeros((2, 20), jnp.int32), train=False)
    lstm = 4 * (96 * 670 + 670 * 670 + 670)  # four gates: input and recurrent kernels, one bias
    assert count_params(v["params"]) == 10004 * 96 + lstm + 670 * 96 + 96 + 96 * 10004 + 10004


def test_sent_lstm_is_leafs_sent140_network():
    # Embedding(10,001, 100) - 2 x LSTM(100) - Dense(128) - Dense(2): its parameters counted by hand
    from jaxfl.models import build_model
    v = build_model("sent_lstm", 2).init(jax.random.key(0), jnp.zeros((2, 25), jnp.int32), train=False)
    lstm = lambda i: 4 * (i * 100 + 100 * 100 + 100)  # noqa: E731
    assert count_params(v["params"]) == 10001 * 100 + lstm(100) + lstm(100) + 100 * 128 + 128 + 128 * 2 + 2


def test_vit_attention_projections_initialise_as_torchs_linear():
    """FedTP's ViT code builds W_qkv as nn.Linear(128, 1536, bias=False): U(-1/sqrt(128), 1/sqrt(128)), uniform
    draws of std bound / sqrt(3) (Xavier-uniform's bound sqrt(6 / (128 + 1536)) = 0.060 is 0.68 of it)."""
    from jaxfl.models import vit_small
    params = vit_small(10, depth=2).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]["encoder"]
    w = np.asarray(params["attn1"]["qkv"], np.float64)  # [128, 1536]: 196,608 draws
    bound = 1 / np.sqrt(128)
    assert w.shape == (128, 1536) and np.abs(w).max() <= bound
    # the sample std of n uniform draws is within 5 standard errors (std / sqrt(5 n)) of std = bound / sqrt(3)
    std = bound / np.sqrt(3)
    assert abs(w.std() - std) < 5 * std / np.sqrt(5 * w.size)


def test_resnet18_imagenet_initialises_its_convolutions_as_torchvision():
    """kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, 2 / (kh kw C_out)); the other ResNets keep
    PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    from jaxfl.models import resnet18, resnet18_imagenet
    x = jnp.zeros((1, 32, 32, 3), jnp.uint8)
    conv = resnet18_imagenet(10).init(jax.random.key(0), x)["params"]["encoder"]["layer2_0"]["conv2"]["kernel"]
    k = np.asarray(conv, np.float64)  # 3x3, 128 -> 128: 147,456 draws
    std = np.sqrt(2 / (9 * 128))
    # the sample std of n normal draws is within 5 standard errors (std / sqrt(2n)) of the std
    assert abs(k.std() - std) < 5 * std / np.sqrt(2 * k.size) and abs(k.mean()) < 5 * std / np.sqrt(k.size)
    plain = np.asarray(resnet18(10).init(jax.random.key(0), x)["params"]["encoder"]["layer2_0"]["conv2"]["kernel"])
    bound = 1 / np.sqrt(9 * 128)
    assert np.abs(plain).max() <= bound and plain.std() == pytest.approx(bound / np.sqrt(3), rel=0.02)
