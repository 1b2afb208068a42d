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

    Why not ``lax.conv``: on XLA:CPU a convolution inside a loop body (``scan``, ``lax.map``) is compiled
    to code ~40x slower than at top level, and under vmap over per-client kernels it becomes a grouped
    convolution, which is slow too. Slices and a matmul stay fast in loops and vmap to a batched matmul.
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

    @nn.compact
    def __call__(self, x):
        ci = x.shape[-1]
        k = self.param("kernel", torch_kernel_init, (self.kernel, self.kernel, ci, self.features))
        b = self.param("bias", torch_bias_init(ci * self.kernel * self.kernel), (self.features,))
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


def max_pool2(x):
    """2x2 max-pool, stride 2, by reshape (``reduce_window`` is slow inside loops on CPU too)."""
    b, h, w, c = x.shape
    x = x[:, : h - h % 2, : w - w % 2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class MLPHead(nn.Module):
    """Dense(h1)-BN-ReLU-...-Dense(num_classes); with ``hidden=()`` a single linear layer."""
    hidden: Sequence[int]
    num_classes: int

    @nn.compact
    def __call__(self, z, train: bool = False, mask=None):
        for i, h in enumerate(self.hidden):
            z = Dense(h, name=f"fc{i + 1}")(z)
            z = nn.relu(BatchNorm(name=f"bn{i + 1}")(z, train, mask))
        return Dense(self.num_classes, name=f"fc{len(self.hidden) + 1}")(z)


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


class Classifier(nn.Module):
    """An encoder followed by a head: params {"encoder": ..., "head": ...}.

    ``features`` returns the encoder output z; ``__call__`` returns the head's logits on z.
    """
    encoder: nn.Module
    head: nn.Module

    def features(self, x, train: bool = False, mask=None):
        return self.encoder(x, train, mask)

    def __call__(self, x, train: bool = False, mask=None):
        return self.head(self.encoder(x, train, mask), train, mask)


def digits_cnn(num_classes: int = 10) -> Classifier:
    """The FedBN digits CNN: DigitsEncoder (d=8192 at 32x32) + Dense(2048)-BN-ReLU-Dense(512)-BN-ReLU-Dense(C)."""
    return Classifier(encoder=DigitsEncoder(), head=MLPHead((2048, 512), num_classes))


def small_cnn(num_classes: int = 10, width: int = 8, hidden: Sequence[int] = ()) -> Classifier:
    """Tiny conv net for tests and quick runs."""
    return Classifier(encoder=SmallEncoder(width), head=MLPHead(tuple(hidden), num_classes))


MODELS = {"digits_cnn": digits_cnn, "small_cnn": small_cnn}


def build_model(name: str, num_classes: int) -> Classifier:
    """Look up a model by name; unknown names list the valid ones."""
    check_choice("model", name, MODELS)
    return MODELS[name](num_classes=num_classes)


def count_params(tree) -> int:
    """Number of scalar entries in a pytree."""
    return int(sum(x.size for x in jax.tree_util.tree_leaves(tree)))
