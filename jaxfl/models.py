"""Flax models. Every model takes ``(x, train, mask)``: ``mask`` [B] marks real samples, so padded samples
never enter a BatchNorm statistic. Parameters are grouped as ``{"encoder": ..., "head": ...}`` so that
algorithms can share or keep parts by path.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .errors import check_choice


def torch_kernel_init(key, shape, dtype=jnp.float32):
    """PyTorch's default kernel init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = prod(shape[:-1])."""
    bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def torch_bias_init(fan_in: int) -> Callable:
    """PyTorch's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class Dense(nn.Module):
    """Linear layer with PyTorch-default init."""
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, kernel_init=torch_kernel_init,
                        bias_init=torch_bias_init(x.shape[-1]), name="linear")(x)


def conv2d_matmul(x, kernel, stride: int = 1, padding: int = 0):
    """2-D convolution (NHWC input, HWIO kernel) as shifted slices + one matmul (im2col).

        y[b, h, w, o] = sum_{i, j, c} xpad[b, s*h + i, s*w + j, c] * kernel[i, j, c, o]

    Why not ``lax.conv``: on XLA:CPU a convolution's gradient inside a loop body (``scan``, ``lax.map``) runs
    8-22x slower than at top level (the pass that rewrites convolutions into the form its fast library takes
    visits only the entry computation, so autodiff's backward convolutions stay on naive loops; writing them
    canonically by hand removes that but does not beat this function: ``benchmarks/conv_paths.py``,
    ``benchmarks/RESULTS.md``, "Why XLA's convolution is slow inside a loop"), and under vmap over per-client
    kernels it becomes a grouped convolution, which is slow too. Slices and a matmul stay fast in loops and vmap
    to a batched matmul.
    """
    kh, kw, ci, co = kernel.shape
    if padding:
        x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    ho = (x.shape[1] - kh) // stride + 1
    wo = (x.shape[2] - kw) // stride + 1
    cols = [x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
            for i in range(kh) for j in range(kw)]
    return jnp.concatenate(cols, axis=-1) @ kernel.reshape(kh * kw * ci, co)


class Conv(nn.Module):
    """2-D convolution (NHWC, HWIO kernel) with PyTorch-default init and symmetric zero padding.

    ``impl="matmul"`` uses ``conv2d_matmul`` (fast in loops and under vmap on CPU); ``"lax"`` uses
    ``lax.conv_general_dilated``. Both give the same numbers up to float rounding.
    """
    features: int
    kernel: int
    stride: int = 1
    padding: int = 0
    impl: str = "matmul"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        ci = x.shape[-1]
        k = self.param("kernel", torch_kernel_init, (self.kernel, self.kernel, ci, self.features))
        b = (self.param("bias", torch_bias_init(ci * self.kernel * self.kernel), (self.features,))
             if self.use_bias else 0.0)
        if self.impl == "matmul":
            y = conv2d_matmul(x, k, self.stride, self.padding)
        else:
            p = self.padding
            y = jax.lax.conv_general_dilated(x, k, (self.stride,) * 2, ((p, p), (p, p)),
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + b


class BatchNorm(nn.Module):
    """BatchNorm over all axes but the last, with PyTorch semantics and a sample mask.

    Train:  mu = sum_b m_b x_b / n,  var = sum_b m_b (x_b - mu)^2 / n,  n = sum_b m_b (per channel, over
            the batch and spatial axes); y = (x - mu) / sqrt(var + eps) * scale + bias;
            running_mean <- (1 - momentum) running_mean + momentum mu,
            running_var  <- (1 - momentum) running_var + momentum var * n / (n - 1)   (unbiased, as PyTorch).
    Eval:   mu, var = running_mean, running_var.
    Padded samples (m_b = 0) change neither y for real samples nor the running statistics; a batch with no
    real sample leaves the running statistics as they were.
    """
    momentum: float = 0.1
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,))
        bias = self.param("bias", nn.initializers.zeros, (c,))
        running_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32))
        running_var = self.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32))
        if train:
            axes = tuple(range(x.ndim - 1))
            if mask is None:
                mask = jnp.ones(x.shape[:1], x.dtype)
            w = mask.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
            n = jnp.sum(jnp.broadcast_to(w, x.shape[:-1] + (1,)), axes)  # [1]: real positions
            safe_n = jnp.maximum(n, 1.0)
            mean = jnp.sum(w * x, axes) / safe_n
            var = jnp.sum(w * jnp.square(x - mean), axes) / safe_n
            if not self.is_initializing():
                m = self.momentum
                has_data = n > 0
                unbiased = var * n / jnp.maximum(n - 1.0, 1.0)
                running_mean.value = jnp.where(has_data, (1 - m) * running_mean.value + m * mean,
                                               running_mean.value)
                running_var.value = jnp.where(has_data, (1 - m) * running_var.value + m * unbiased,
                                              running_var.value)
        else:
            mean, var = running_mean.value, running_var.value
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias


@jax.custom_vjp
def max_last(v):
    """max over the last axis, v [..., k] -> [...], whose gradient goes to the first argmax (PyTorch's rule).

    Why a custom VJP: the default gradient of a max finds the winner by comparing the input with the max
    again, and XLA:CPU may recompute the input in a different fusion with different rounding (measured: the
    jitted gradient of the masked small CNN then differed from the eager one and from finite differences by
    45%). Here the winner's index is found once in the forward pass and saved.
    """
    return jnp.max(v, -1)


def _max_last_fwd(v):
    i = jnp.argmax(v, -1)
    return jnp.take_along_axis(v, i[..., None], -1)[..., 0], (i, v.shape[-1])


def _max_last_bwd(res, g):
    i, k = res
    return (jax.nn.one_hot(i, k, dtype=g.dtype) * g[..., None],)


max_last.defvjp(_max_last_fwd, _max_last_bwd)


def max_pool2(x):
    """2x2 max-pool, stride 2, by reshape (``reduce_window`` is slow inside loops on CPU too)."""
    b, h, w, c = x.shape
    x = x[:, : h - h % 2, : w - w % 2].reshape(b, h // 2, 2, w // 2, 2, c)
    return max_last(x.transpose(0, 1, 3, 5, 2, 4).reshape(b, h // 2, w // 2, c, 4))


def max_pool(x, window: int, stride: int, padding: int = 0):
    """Max-pool (NHWC) as the max of window^2 strided slices; padding with -inf (PyTorch semantics)."""
    if padding:
        x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)), constant_values=-jnp.inf)
    ho = (x.shape[1] - window) // stride + 1
    wo = (x.shape[2] - window) // stride + 1
    return max_last(jnp.stack([x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
                               for i in range(window) for j in range(window)], -1))


def adaptive_pool_matrix(n_in: int, n_out: int):
    """P [n_out, n_in]: row i averages PyTorch's adaptive window [floor(i n_in / n_out), ceil((i+1) n_in / n_out))."""
    p = np.zeros((n_out, n_in), np.float32)
    for i in range(n_out):
        lo, hi = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        p[i, lo:hi] = 1.0 / (hi - lo)
    return jnp.asarray(p)


def adaptive_avg_pool(x, size: int):
    """PyTorch's AdaptiveAvgPool2d((size, size)) on NHWC, as two small matmuls (7 -> 6 is a 2x2 stride-1 pool)."""
    ph, pw = adaptive_pool_matrix(x.shape[1], size), adaptive_pool_matrix(x.shape[2], size)
    return jnp.einsum("bhwc,ih,jw->bijc", x, ph, pw)


class MLPHead(nn.Module):
    """Dense(h1)-BN-ReLU-...-Dense(num_classes); with ``hidden=()`` a single linear layer.

    With ``taps=True`` it returns (logits, {"fc<i>": pre-BN activation, "relu<i>": post-ReLU activation})
    of every hidden layer i (RFedDis reads its disentangling features there).
    """
    hidden: Sequence[int]
    num_classes: int

    @nn.compact
    def __call__(self, z, train: bool = False, mask=None, taps: bool = False):
        seen = {}
        for i, h in enumerate(self.hidden):
            z = seen[f"fc{i + 1}"] = Dense(h, name=f"fc{i + 1}")(z)
            z = seen[f"relu{i + 1}"] = nn.relu(BatchNorm(name=f"bn{i + 1}")(z, train, mask))
        logits = Dense(self.num_classes, name=f"fc{len(self.hidden) + 1}")(z)
        return (logits, seen) if taps else logits


class DigitsEncoder(nn.Module):
    """FedBN DigitModel feature extractor: 3 x (conv5x5 pad2 - BN - ReLU), max-pool after the first two.

    32x32xC input -> 8x8x128 -> flattened d = 8192 (fedpick spec section 2).
    """
    widths: Sequence[int] = (64, 64, 128)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for i, w in enumerate(self.widths):
            x = Conv(w, 5, padding=2, name=f"conv{i + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{i + 1}")(x, train, mask))
            if i < 2:
                x = max_pool2(x)
        return x.reshape(x.shape[0], -1)


class SmallEncoder(nn.Module):
    """Tiny conv encoder for tests: conv3x3(width) - BN - ReLU - maxpool2 - flatten."""
    width: int = 8

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = Conv(self.width, 3, padding=1, name="conv1")(x)
        x = nn.relu(BatchNorm(name="bn1")(x, train, mask))
        return max_pool2(x).reshape(x.shape[0], -1)


class PlainConvEncoder(nn.Module):
    """BatchNorm-free conv encoder: per entry of ``widths`` a conv(kernel, 'same')-ReLU, 2x2 max-pool after the
    entries listed in ``pool_after`` (indices), then flatten and Dense(hidden)-ReLU.

    fedavg_cnn: McMahan et al.'s CNN; pfl_cnn: a small 2-conv CNN for the cross-device benchmark.
    """
    widths: Sequence[int] = (32, 64)
    kernel: int = 5
    pool_after: Sequence[int] = (0, 1)
    hidden: int = 512
    conv_impl: str = "matmul"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for i, w in enumerate(self.widths):
            x = nn.relu(Conv(w, self.kernel, padding=self.kernel // 2, impl=self.conv_impl, name=f"conv{i + 1}")(x))
            if i in self.pool_after:
                x = max_pool2(x)
        return nn.relu(Dense(self.hidden, name="fc")(x.reshape(x.shape[0], -1)))


class DropoutCNNEncoder(nn.Module):
    """The EMNIST CNN of Reddi et al. 2021 ("Adaptive Federated Optimization"), as FedML, FLUTE's FEMNIST
    experiment and pfl-research's CIFAR-10 benchmark define it: conv3x3(32, no padding)-ReLU-conv3x3(64, no
    padding)-ReLU-maxpool2-dropout(0.25)-flatten-Dense(128)-ReLU-dropout(0.5). Dropout draws from the
    ``dropout`` rng in training and is the identity in evaluation."""

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = nn.relu(Conv(32, 3, name="conv1")(x))
        x = max_pool2(nn.relu(Conv(64, 3, name="conv2")(x)))
        x = nn.Dropout(0.25, deterministic=not train)(x).reshape(x.shape[0], -1)
        return nn.Dropout(0.5, deterministic=not train)(nn.relu(Dense(128, name="fc")(x)))


class FlattenEncoder(nn.Module):
    """The identity feature map z = flatten(x): logistic regression's encoder (it has no parameters)."""

    def __call__(self, x, train: bool = False, mask=None):
        return x.reshape(x.shape[0], -1)


class MLPEncoder(nn.Module):
    """flatten - (Dense(h) - ReLU) for each h in ``hidden``: McMahan et al.'s "2NN" body is (200, 200)."""
    hidden: Sequence[int] = (200, 200)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = x.reshape(x.shape[0], -1)
        for i, h in enumerate(self.hidden):
            x = nn.relu(Dense(h, name=f"fc{i + 1}")(x))
        return x


def _lstm_gates(z, c):
    """(i, f, g, o) activations of the pre-activations z [..., 4H] (PyTorch / flax order), the new cell and
    hidden state."""
    i, f, g, o = jnp.split(z, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    c = f * c + i * g
    return (i, f, g, o), c, o * jnp.tanh(c)


def lstm_recurrence(unroll: int = 8) -> Callable:
    """rec(xw [T, B, 4H], wh [H, 4H]) -> hs [T, B, H]: an LSTM over time whose input projections (x W_x + b)
    are already in ``xw``; h_0 = c_0 = 0.

    Its VJP is written out: the backward scan only carries dh, dc and multiplies dz_t by W_h^T (the gates are
    kept from the forward pass, not recomputed), and the recurrent kernel's gradient is one matmul over all time
    steps after the loop, dW_h = sum_t h_{t-1}^T dz_t. JAX's own scan transpose adds h_{t-1}^T dz_t into a
    carried [H, 4H] accumulator at every step (a read and write of W_h's size per step): 2.3x slower per
    train step of LEAF's character LSTM on CPU (batch 10, 80 steps).
    """
    def forward(xw, wh):
        b, h = xw.shape[1], wh.shape[0]

        def step(carry, x):
            c, hp = carry
            gates, c, hn = _lstm_gates(x + hp @ wh, c)
            return (c, hn), (hn, c, jnp.concatenate(gates, -1))

        zero = jnp.zeros((b, h), xw.dtype)
        _, (hs, cs, gs) = jax.lax.scan(step, (zero, zero), xw, unroll=unroll)
        return hs, (wh, hs, cs, gs)

    @jax.custom_vjp
    def rec(xw, wh):
        return forward(xw, wh)[0]

    def backward(res, dhs):
        wh, hs, cs, gs = res
        zero = jnp.zeros(hs.shape[1:], hs.dtype)
        hprev = jnp.concatenate([zero[None], hs[:-1]], 0)
        cprev = jnp.concatenate([zero[None], cs[:-1]], 0)

        def step(carry, inputs):
            dh_next, dc_next = carry
            gates, cp, c, dh_out = inputs
            i, f, g, o = jnp.split(gates, 4, axis=-1)
            tc = jnp.tanh(c)
            dh = dh_out + dh_next
            dc = dc_next + dh * o * (1 - tc * tc)
            dz = jnp.concatenate([dc * g * i * (1 - i), dc * cp * f * (1 - f), dc * i * (1 - g * g),
                                  dh * tc * o * (1 - o)], -1)
            return (dz @ wh.T, dc * f), dz

        _, dz = jax.lax.scan(step, (zero, zero), (gs, cprev, cs, dhs), reverse=True, unroll=unroll)
        return dz, jnp.einsum("tbh,tbk->hk", hprev, dz)

    rec.defvjp(forward, backward)
    return rec


class LSTMLayer(nn.Module):
    """One LSTM layer over a sequence, xs [B, T, D] -> hs [B, T, H], with flax ``OptimizedLSTMCell``'s parameters
    (names, shapes, initialisers: input kernels ``i{i,f,g,o}`` lecun-normal without bias, recurrent kernels
    ``h{i,f,g,o}`` orthogonal with zero bias) and its numbers up to float rounding. The input projections of
    all time steps are one matmul before the time loop; the loop is ``lstm_recurrence``."""
    features: int
    unroll: int = 8

    @nn.compact
    def __call__(self, xs):
        from flax.linen.recurrent import DenseParams
        h = self.features
        wi, wh, bh = [], [], []
        for gate in "ifgo":
            wi.append(DenseParams(h, use_bias=False, kernel_init=nn.initializers.lecun_normal(),
                                  name=f"i{gate}")(xs[:, 0])[0])
            kernel, bias = DenseParams(h, use_bias=True, kernel_init=nn.initializers.orthogonal(),
                                       bias_init=nn.initializers.zeros_init(),
                                       name=f"h{gate}")(jnp.zeros(xs.shape[:1] + (h,), xs.dtype))
            wh.append(kernel)
            bh.append(bias)
        wi, wh, bh = jnp.concatenate(wi, -1), jnp.concatenate(wh, -1), jnp.concatenate(bh, -1)
        xw = jnp.einsum("btd,dk->tbk", xs, wi) + bh
        return lstm_recurrence(self.unroll)(xw, wh).transpose(1, 0, 2)


class CharLSTMEncoder(nn.Module):
    """LEAF's Shakespeare model body: token ids x [B, T] -> Embedding(vocab, embed) -> ``layers`` stacked
    LSTMs of ``hidden`` units -> the last time step's hidden state z [B, hidden] (next-character prediction).

    impl="fused" (default): ``LSTMLayer`` (input projections hoisted out of the time loop, a hand-written
    backward); "flax": ``nn.RNN(nn.OptimizedLSTMCell)``. Same parameters, same numbers up to float rounding.
    unroll: time steps per iteration of the loops over time."""
    vocab: int = 80
    embed: int = 8
    hidden: int = 256
    layers: int = 2
    unroll: int = 8
    impl: str = "fused"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = nn.Embed(self.vocab, self.embed, name="embed")(x.astype(jnp.int32))
        for i in range(self.layers):
            if self.impl == "fused":
                h = LSTMLayer(self.hidden, self.unroll, name=f"OptimizedLSTMCell_{i}")(h)
            else:
                h = nn.RNN(nn.OptimizedLSTMCell(self.hidden), unroll=self.unroll, name=f"lstm{i + 1}")(h)
        return h[:, -1]


class WordLSTMEncoder(nn.Module):
    """A word-level LSTM body: token ids x [B, T] -> Embedding(vocab, embed) -> ``layers`` stacked LSTMs of
    ``hidden`` units -> the last time step's hidden state -> Dense(project) (no activation), z [B, project].
    The defaults are the FedOpt Stack Overflow next-word model's (google-research/federated, ``utils/models/
    stackoverflow_models.py``: Embedding 96, LSTM 670, Dense 96)."""
    vocab: int = 10004
    embed: int = 96
    hidden: int = 670
    layers: int = 1
    project: int = 96
    unroll: int = 4

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = nn.Embed(self.vocab, self.embed, name="embed")(x.astype(jnp.int32))
        for i in range(self.layers):
            h = LSTMLayer(self.hidden, self.unroll, name="lstm" if i == 0 else f"lstm{i + 1}")(h)
        return nn.Dense(self.project, name="project")(h[:, -1])


class AlexNetEncoder(nn.Module):
    """FedBN's AlexNet with BatchNorm after every conv and dense layer, up to the 4096-d feature (d = 4096).

    conv11x11/s4/p2(64)-BN-ReLU-maxpool3/s2 | conv5x5/p2(192)-BN-ReLU-maxpool3/s2 | conv3x3/p1(384)-BN-ReLU |
    conv3x3/p1(256)-BN-ReLU | conv3x3/p1(256)-BN-ReLU-maxpool3/s2 | adaptive-avgpool 6x6 | flatten (9216) |
    Dense(4096)-BN-ReLU | Dense(4096)-BN-ReLU. On 256x256 input: 63 -> 31 -> 15 -> 7 -> 6.
    """
    hidden: Sequence[int] = (4096, 4096)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for i, (w, k, s, p, pool) in enumerate([(64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
                                                (256, 3, 1, 1, False), (256, 3, 1, 1, True)]):
            x = Conv(w, k, stride=s, padding=p, name=f"conv{i + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{i + 1}")(x, train, mask))
            if pool:
                x = max_pool(x, 3, 2)
        x = adaptive_avg_pool(x, 6).reshape(x.shape[0], -1)
        for j, h in enumerate(self.hidden):
            x = Dense(h, name=f"fc{j + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{6 + j}")(x, train, mask))
        return x


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN + shortcut (1x1 conv + BN when shape changes), ReLU."""
    features: int
    stride: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        y = Conv(self.features, 3, self.stride, 1, use_bias=False, name="conv1")(x)
        y = nn.relu(BatchNorm(name="bn1")(y, train, mask))
        y = Conv(self.features, 3, 1, 1, use_bias=False, name="conv2")(y)
        y = BatchNorm(name="bn2")(y, train, mask)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = Conv(self.features, 1, self.stride, 0, use_bias=False, name="conv_shortcut")(x)
            x = BatchNorm(name="bn_shortcut")(x, train, mask)
        return nn.relu(x + y)


class ResNetEncoder(nn.Module):
    """ResNet body up to global average pooling (z in R^512).

    stem="cifar": conv3x3(64, s1) - BN - ReLU (no max-pool; DapperFL's backbone).
    stem="imagenet": conv7x7(64, s2, p3) - BN - ReLU - maxpool3/s2/p1 (torchvision).
    Stages of BasicBlocks, widths 64/128/256/512, strides 1/2/2/2; convs have no bias.
    """
    blocks: Sequence[int] = (2, 2, 2, 2)
    stem: str = "cifar"
    widths: Sequence[int] = (64, 128, 256, 512)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        if self.stem == "cifar":
            x = Conv(self.widths[0], 3, 1, 1, use_bias=False, name="conv_stem")(x)
            x = nn.relu(BatchNorm(name="bn_stem")(x, train, mask))
        else:
            x = Conv(self.widths[0], 7, 2, 3, use_bias=False, name="conv_stem")(x)
            x = nn.relu(BatchNorm(name="bn_stem")(x, train, mask))
            x = max_pool(x, 3, 2, 1)
        for s, (n, w) in enumerate(zip(self.blocks, self.widths)):
            for b in range(n):
                x = BasicBlock(w, (1 if s == 0 else 2) if b == 0 else 1, name=f"layer{s + 1}_{b}")(x, train, mask)
        return jnp.mean(x, axis=(1, 2))


class PreActGNBlock(nn.Module):
    """The FedOpt ResNet's basic block (ResNet v2, pre-activation, GroupNorm): y = conv3x3(GN-ReLU(conv3x3(
    GN-ReLU(x)))) (``first``: the first conv reads x itself), plus x, or conv1x1-GN(x) when the width changes.
    Stride 1 throughout, as the FedOpt code builds it."""
    features: int
    first: bool = False
    groups: int = 32

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        gn_relu = lambda name, v: nn.relu(nn.GroupNorm(self.groups, epsilon=1e-3, name=name)(v))  # noqa: E731
        y = x if self.first else gn_relu("gn1", x)
        y = Conv(self.features, 3, 1, 1, use_bias=False, name="conv1")(y)
        y = Conv(self.features, 3, 1, 1, use_bias=False, name="conv2")(gn_relu("gn2", y))
        if x.shape[-1] != self.features:
            x = Conv(self.features, 1, 1, 0, use_bias=False, name="conv_shortcut")(x)
            x = nn.GroupNorm(self.groups, epsilon=1e-3, name="gn_shortcut")(x)
        return x + y


class ResNetGNEncoder(nn.Module):
    """The ResNet-18 of Reddi et al.'s FedOpt CIFAR-100 task (google-research/federated,
    ``utils/models/resnet_models.py``: ResNet v2 with GroupNorm, 32 groups): conv7x7(64, s2)-GN-ReLU -
    maxpool3/s2 - stages of 2 pre-activation blocks of widths 64/128/256/512, all at stride 1 (the code never
    passes a stage stride) - GN-ReLU - global average pooling (z in R^512). Deviations: PyTorch's symmetric
    padding (3 and 1) where Keras pads 'same' (2 before, 3 after at stride 2), PyTorch's default
    initialisation, no L2 kernel regulariser."""
    blocks: Sequence[int] = (2, 2, 2, 2)
    widths: Sequence[int] = (64, 128, 256, 512)
    groups: int = 32

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = Conv(self.widths[0], 7, 2, 3, use_bias=False, name="conv_stem")(x)
        x = nn.relu(nn.GroupNorm(self.groups, epsilon=1e-3, name="gn_stem")(x))
        x = max_pool(x, 3, 2, 1)
        for s, (n, w) in enumerate(zip(self.blocks, self.widths)):
            for b in range(n):
                x = PreActGNBlock(w, first=s == 0 and b == 0, groups=self.groups, name=f"layer{s + 1}_{b}")(x)
        x = nn.relu(nn.GroupNorm(self.groups, epsilon=1e-3, name="gn_final")(x))
        return jnp.mean(x, axis=(1, 2))


class Attention(nn.Module):
    """Multi-head self-attention with a bias-free fused projection W_qkv [D, 3 * heads * dim_head].

    ``qkv`` supplies W_qkv from outside (FedTP's hypernetwork); otherwise it is this module's parameter.
    softmax(q k^T / sqrt(dim_head)) v, heads concatenated, then Dense(D) and dropout.
    """
    heads: int = 8
    dim_head: int = 64
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False, qkv=None):
        b, n, d = x.shape
        inner = self.heads * self.dim_head
        w = qkv if qkv is not None else self.param("qkv", nn.initializers.xavier_uniform(), (d, 3 * inner))
        q, k, v = jnp.split(x @ w, 3, axis=-1)
        split = lambda t: t.reshape(b, n, self.heads, self.dim_head)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) * self.dim_head ** -0.5, -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(b, n, inner)
        out = Dense(d, name="out")(out)
        return nn.Dropout(self.dropout, deterministic=not train)(out)


class ViTEncoder(nn.Module):
    """Small pre-norm ViT (FedTP): patches -> Dense(dim) + CLS + learned positions -> depth x
    [x + Attn(LN(x)); x + FF(LN(x))] -> LN(CLS token). Returns [B, dim].

    ``qkv``: optional [depth, dim, 3 * heads * dim_head] attention projections supplied from outside; when
    given, the blocks have no ``qkv`` parameter of their own (``qkv_shape`` gives the shape to generate).
    """
    patch: int = 4
    dim: int = 128
    depth: int = 8
    heads: int = 8
    dim_head: int = 64
    mlp_dim: int = 256
    dropout: float = 0.1

    def qkv_shape(self):
        return (self.depth, self.dim, 3 * self.heads * self.dim_head)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, qkv=None):
        b, h, w, c = x.shape
        p = self.patch
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = Dense(self.dim, name="patch_embed")(x)
        cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, self.dim))
        pos = self.param("pos", nn.initializers.normal(1.0), (1, x.shape[1] + 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], 1) + pos
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        drop = lambda t: nn.Dropout(self.dropout, deterministic=not train)(t)
        for layer in range(self.depth):
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln_attn{layer}")(x)
            x = x + Attention(self.heads, self.dim_head, self.dropout, name=f"attn{layer}")(
                y, train, None if qkv is None else qkv[layer])
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln_ff{layer}")(x)
            y = drop(nn.gelu(Dense(self.mlp_dim, name=f"ff{layer}_1")(y), approximate=False))
            x = x + drop(Dense(self.dim, name=f"ff{layer}_2")(y))
        return nn.LayerNorm(epsilon=1e-5, name="ln_out")(x[:, 0])


class Classifier(nn.Module):
    """An encoder followed by a head: params {"encoder": ..., "head": ...}.

    ``features`` returns the encoder output z; ``__call__`` returns the head's logits on z. Extra keyword
    arguments (e.g. a ViT's ``qkv``) go to the encoder.
    """
    encoder: nn.Module
    head: nn.Module

    def features(self, x, train: bool = False, mask=None, **kw):
        return self.encoder(x, train, mask, **kw)

    def __call__(self, x, train: bool = False, mask=None, **kw):
        return self.head(self.encoder(x, train, mask, **kw), train, mask)


def digits_cnn(num_classes: int = 10) -> Classifier:
    """The FedBN digits CNN: DigitsEncoder (d=8192 at 32x32) + Dense(2048)-BN-ReLU-Dense(512)-BN-ReLU-Dense(C)."""
    return Classifier(encoder=DigitsEncoder(), head=MLPHead((2048, 512), num_classes))


def small_cnn(num_classes: int = 10, width: int = 8, hidden: Sequence[int] = ()) -> Classifier:
    """Tiny conv net for tests and quick runs."""
    return Classifier(encoder=SmallEncoder(width), head=MLPHead(tuple(hidden), num_classes))


def fedavg_cnn(num_classes: int = 10) -> Classifier:
    """The FedAvg CNN (McMahan et al. 2017): conv5x5(32)-pool-conv5x5(64)-pool-Dense(512)-Dense(C), no BN;
    1,663,370 parameters on 28x28x1 inputs at C = 10."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 5, (0, 1), 512), head=MLPHead((), num_classes))


def pfl_cnn(num_classes: int = 10) -> Classifier:
    """A small 2-conv CNN for the cross-device workload: conv3x3(32)-conv3x3(64)-pool-Dense(128)-Dense(C)."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 3, (1,), 128), head=MLPHead((), num_classes))


def cnn_dropout(num_classes: int = 10) -> Classifier:
    """Reddi et al.'s EMNIST CNN with dropout (``DropoutCNNEncoder`` + Dense(C)): 1,206,590 parameters on
    28x28x1 inputs at C = 62 (FLUTE's FEMNIST setting), 1,626,442 on 32x32x3 at C = 10 (pfl-research's
    CIFAR-10 benchmark)."""
    return Classifier(encoder=DropoutCNNEncoder(), head=MLPHead((), num_classes))


def logreg(num_classes: int = 10) -> Classifier:
    """Multinomial logistic regression: logits = W flatten(x) + b (7,850 parameters on 28x28 inputs, C = 10)."""
    return Classifier(encoder=FlattenEncoder(), head=MLPHead((), num_classes))


def mlp_2nn(num_classes: int = 10) -> Classifier:
    """McMahan et al.'s "2NN": 784-200-200-C with ReLU (199,210 parameters at C = 10 on 28x28 inputs)."""
    return Classifier(encoder=MLPEncoder((200, 200)), head=MLPHead((), num_classes))


def femnist_cnn(num_classes: int = 62) -> Classifier:
    """LEAF's FEMNIST CNN: conv5x5(32, 'same')-ReLU-pool-conv5x5(64, 'same')-ReLU-pool-Dense(2048)-ReLU-Dense(C)
    (6,603,710 parameters on 28x28x1 inputs at C = 62)."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 5, (0, 1), 2048), head=MLPHead((), num_classes))


def char_lstm(num_classes: int = 80) -> Classifier:
    """LEAF's Shakespeare next-character model: Embedding(80, 8) - 2 x LSTM(256) - Dense(C); C = the
    vocabulary (80: ``jaxfl.data.text.LEAF_CHARS``). Inputs are token ids [B, T]."""
    return Classifier(encoder=CharLSTMEncoder(vocab=max(num_classes, 80)), head=MLPHead((), num_classes))


def word_lstm(num_classes: int = 10004) -> Classifier:
    """The FedOpt Stack Overflow next-word model: Embedding(V, 96) - LSTM(670) - Dense(96) - Dense(C), V = C
    (the vocabulary, ``jaxfl.data.tff``'s 10,000 words and 4 special tokens). Inputs are token ids [B, T]."""
    return Classifier(encoder=WordLSTMEncoder(vocab=num_classes), head=MLPHead((), num_classes))


def sent_lstm(num_classes: int = 2) -> Classifier:
    """LEAF's Sent140 model: Embedding(10,001, 100) - 2 x LSTM(100) - Dense(128) - Dense(C) over 25 word ids
    (``SENT140_VOCAB`` words and one id for unknown words and padding). Deviation: LEAF feeds 300-d GloVe
    vectors (n_hidden 100 sizes its trained embedding); here the embedding is trained from scratch."""
    from .data.leaf import SENT140_VOCAB
    return Classifier(encoder=WordLSTMEncoder(vocab=SENT140_VOCAB + 1, embed=100, hidden=100, layers=2,
                                              project=128), head=MLPHead((), num_classes))


def alexnet_bn(num_classes: int = 10) -> Classifier:
    """FedBN's AlexNet-BN: AlexNetEncoder (d = 4096) + Dense(C). 57,063,498 parameters at C = 10."""
    return Classifier(encoder=AlexNetEncoder(), head=MLPHead((), num_classes))


def resnet10(num_classes: int = 10, stem: str = "cifar") -> Classifier:
    """ResNet-10 ([1, 1, 1, 1] basic blocks) + Dense(C): 4,903,242 parameters at C = 10 (cifar stem)."""
    return Classifier(encoder=ResNetEncoder((1, 1, 1, 1), stem), head=MLPHead((), num_classes))


def resnet10_slim(num_classes: int = 10, stem: str = "cifar") -> Classifier:
    """ResNet-10 at a quarter width (16/32/64/128, z in R^128) + Dense(C): a CPU-sized stand-in with the same
    block structure, so DapperFL's pruning rules apply unchanged. 308,826 parameters at C = 10."""
    return Classifier(encoder=ResNetEncoder((1, 1, 1, 1), stem, widths=(16, 32, 64, 128)),
                      head=MLPHead((), num_classes))


def resnet18(num_classes: int = 10, stem: str = "cifar") -> Classifier:
    """ResNet-18 ([2, 2, 2, 2]) + Dense(C): 11,173,962 parameters (cifar stem), 11,181,642 (imagenet stem)."""
    return Classifier(encoder=ResNetEncoder((2, 2, 2, 2), stem), head=MLPHead((), num_classes))


def resnet18_gn(num_classes: int = 100) -> Classifier:
    """The FedOpt CIFAR-100 ResNet-18 with GroupNorm (``ResNetGNEncoder``) + Dense(C)."""
    return Classifier(encoder=ResNetGNEncoder(), head=MLPHead((), num_classes))


def resnet18_imagenet(num_classes: int = 10) -> Classifier:
    """torchvision's ResNet-18 as FedSelect's code runs it on 32x32 inputs: ``resnet18(stem="imagenet")``."""
    return resnet18(num_classes, stem="imagenet")


def vit_small(num_classes: int = 10, depth: int = 8, **kw) -> Classifier:
    """FedTP's ViT for 32x32 images: patch 4, dim 128, 8 heads x 64, MLP 256, ``depth`` pre-norm blocks."""
    return Classifier(encoder=ViTEncoder(depth=depth, **kw), head=MLPHead((), num_classes))


def vit_tiny(num_classes: int = 10) -> Classifier:
    """A CPU-sized FedTP ViT: depth 4, dim 64, 4 heads x 32, MLP 128 (same architecture as ``vit_small``)."""
    return vit_small(num_classes, depth=4, dim=64, heads=4, dim_head=32, mlp_dim=128)


MODELS = {"digits_cnn": digits_cnn, "small_cnn": small_cnn, "fedavg_cnn": fedavg_cnn, "pfl_cnn": pfl_cnn,
          "cnn_dropout": cnn_dropout, "alexnet_bn": alexnet_bn, "resnet10": resnet10, "resnet10_slim": resnet10_slim,
          "resnet18": resnet18, "resnet18_gn": resnet18_gn, "resnet18_imagenet": resnet18_imagenet,
          "vit_small": vit_small, "vit_tiny": vit_tiny,
          "logreg": logreg, "mlp_2nn": mlp_2nn, "femnist_cnn": femnist_cnn, "char_lstm": char_lstm,
          "word_lstm": word_lstm, "sent_lstm": sent_lstm}


# the models whose inputs are token ids [B, T]; every other one reads images
TEXT_MODELS = ("char_lstm", "word_lstm", "sent_lstm")


def build_model(name: str, num_classes: int) -> Classifier:
    """Look up a model by name; unknown names list the valid ones."""
    check_choice("model", name, MODELS)
    return MODELS[name](num_classes=num_classes)
