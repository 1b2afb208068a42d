"""Layers that behave as PyTorch's (initialisation, convolution as a matmul, BatchNorm over real samples only,
pooling, an LSTM recurrence, residual blocks, attention): the pieces ``encoders`` builds models from."""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def torch_kernel_init(key, shape, dtype=jnp.float32):
    """PyTorch's default kernel init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = prod(shape[:-1])."""
    bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def kaiming_fan_out_init(key, shape, dtype=jnp.float32):
    """torchvision's ResNet kernel init (``kaiming_normal_(mode="fan_out", nonlinearity="relu")``): N(0, 2 /
    fan_out), fan_out = kh kw C_out of an HWIO kernel."""
    std = math.sqrt(2.0 / (math.prod(shape[:-2]) * shape[-1]))
    return std * jax.random.normal(key, shape, dtype)


CONV_INITS = {"torch": torch_kernel_init, "kaiming_fan_out": kaiming_fan_out_init}


def torch_bias_init(fan_in: int) -> Callable:
    """PyTorch's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class Dense(nn.Module):
    """Linear layer with PyTorch-default init: x @ kernel + bias, the product through ``kernel_matmul`` (its kernel
    gradient in the form XLA:CPU runs at its matmul rate). Parameters ``linear/{kernel, bias}``, as
    ``nn.Dense(name="linear")`` names and draws them."""
    features: int

    @nn.compact
    def __call__(self, x):
        return _Linear(self.features, name="linear")(x)


class _Linear(nn.Module):
    """``nn.Dense``'s parameters (same names, shapes, order of draws) with PyTorch-default init, product by
    ``kernel_matmul``."""
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", torch_kernel_init, (x.shape[-1], self.features))
        bias = self.param("bias", torch_bias_init(x.shape[-1]), (self.features,))
        return kernel_matmul(x, kernel) + bias


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
    return kernel_matmul(conv_patches(x, kh, kw, stride, padding), kernel.reshape(kh * kw * ci, co))


def conv2d_xla(x, kernel, stride: int = 1, padding: int = 0):
    """XLA's own 2-D convolution (``lax.conv_general_dilated``), NHWC input, HWIO kernel, symmetric zero padding:
    the formula of ``conv2d_matmul``."""
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), ((padding, padding), (padding, padding)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv2d(x, kernel, stride: int = 1, padding: int = 0):
    """2-D convolution (NHWC input, HWIO kernel, symmetric zero padding): ``conv2d_matmul``'s numbers and
    gradients wherever a derivative is taken, XLA's own convolution where none is (evaluation, a teacher's or a
    frozen model's outputs) on a CPU.

        y[b, h, w, o] = sum_{i, j, c} xpad[b, s*h + i, s*w + j, c] * kernel[i, j, c, o]

    Why two ways: inside loop bodies XLA:CPU runs its own convolution's backward passes on naive loops
    (``conv2d_matmul``'s docstring), so training takes slices and a matmul; a forward convolution is in the form
    XLA's fast library takes, in loops too, and there it needs no patch matrix: 1.3-2.4x faster than im2col for
    the CNNs' evaluation on one AMD EPYC core (``benchmarks/RESULTS.md``, "XLA's convolution for
    evaluation"). Under ``vmap`` with a kernel per lane (clients' own models) XLA's convolution becomes a grouped one,
    slower than the batched matmul, so there the evaluation takes ``conv2d_matmul`` too; with one kernel for all
    lanes the lanes join the image batch. Other platforms take ``conv2d_matmul`` throughout. The two agree up to
    float reassociation. A custom VJP: reverse mode to any order, no forward mode (``jax.jvp``), as
    ``kernel_matmul``.
    """
    return _conv2d(int(stride), int(padding))(x, kernel)


@functools.lru_cache(maxsize=None)
def _conv2d(stride: int, padding: int) -> Callable:
    """``conv2d`` at one stride and padding: a custom VJP (``conv2d_matmul``'s forward and backward) around an
    evaluation with a custom batching rule."""
    def matmul(x, kernel):
        return conv2d_matmul(x, kernel, stride, padding)

    def xla(x, kernel):
        dtype = jnp.result_type(x, kernel)  # (as the matmul promotes, e.g. uint8 images)
        return conv2d_xla(x.astype(dtype), kernel.astype(dtype), stride, padding)

    @jax.custom_batching.custom_vmap
    def evaluate(x, kernel):
        return jax.lax.platform_dependent(x, kernel, cpu=xla, default=matmul)

    @evaluate.def_vmap
    def evaluate_batched(axis_size, in_batched, x, kernel):
        if not in_batched[1]:  # one kernel for every lane: the lanes' images are one larger batch
            y = evaluate(x.reshape((-1,) + x.shape[2:]), kernel)
            return y.reshape((axis_size, -1) + y.shape[1:]), True
        return jax.vmap(matmul, in_axes=(0 if in_batched[0] else None, 0))(x, kernel), True

    conv = jax.custom_vjp(evaluate)
    conv.defvjp(lambda x, kernel: jax.vjp(matmul, x, kernel), lambda vjp, g: vjp(g))
    return conv


def conv_patches(x, kh: int, kw: int, stride: int = 1, padding: int = 0):
    """im2col: x [B, H, W, C] (NHWC), zero-padded by ``padding`` -> [B, Ho, Wo, kh kw C], the kh x kw window of
    each output position, taps in row-major order (i, j) and channels innermost, as by shifted strided slices."""
    if padding:
        x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    ho = (x.shape[1] - kh) // stride + 1
    wo = (x.shape[2] - kw) // stride + 1
    cols = [x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
            for i in range(kh) for j in range(kw)]
    return jnp.concatenate(cols, axis=-1)


# From this length on (rows N of x, contraction K of the kernel's product) the gradient forms below run faster than
# autodiff's on XLA:CPU (measured: benchmarks/RESULTS.md, "Dense layers and W_qkv through kernel_matmul").
TRANSPOSED_KERNEL_GRAD_MIN = 256


def kernel_matmul(x, w):
    """x [..., K] @ w [K, O] -> [..., O], the product of a layer's input with its kernel (``Dense``, the attention's
    W_qkv, ``conv2d_matmul``'s patch matrix). With N = prod(x.shape[:-1]) >= ``TRANSPOSED_KERNEL_GRAD_MIN`` rows
    its gradients are written out (``_kernel_matmul``):

        d x = g w^T,    d w = x^T g = (g^T x)^T   (x, g flattened to [N, K], [N, O]),

    the kernel's as (g^T x)^T when K >= ``TRANSPOSED_KERNEL_GRAD_MIN`` too, else as x^T g; fewer rows take
    autodiff's. Why: XLA:CPU runs autodiff's kernel gradient, a dot contracting the leading axis of x
    ([N, K]^T [N, O]), well below its matmul rate when N and K are long (in a FedAvg-CNN step it was the slowest
    operation, slower than the forward product of the same size: ``benchmarks/step_profile.py``), and folds a
    plain transpose of g^T x back into that form, so an optimization barrier keeps the product as written
    (``benchmarks/RESULTS.md``, "The kernel gradient of a convolution on XLA:CPU"); with K short the written x^T g
    gets operand layouts that autodiff's does not (a ViT's W_qkv, whose autodiff gradient is formed from a
    concatenation of the q, k, v cotangents). A few rows (a small model's batch) gain nothing and lose a little.
    The sums are the same up to float reassociation. Like ``max_last``, a custom VJP: reverse mode to any order, no
    forward mode (``jax.jvp``).
    """
    if math.prod(x.shape[:-1]) < TRANSPOSED_KERNEL_GRAD_MIN:
        return x @ w
    return _kernel_matmul(x, w)


@jax.custom_vjp
def _kernel_matmul(x, w):
    return x @ w


def _kernel_matmul_fwd(x, w):
    return x @ w, (x, w)


def _kernel_matmul_bwd(res, g):
    x, w = res
    k, o = w.shape
    flat_x, flat_g = x.reshape(-1, k), g.reshape(-1, o)
    if k >= TRANSPOSED_KERNEL_GRAD_MIN:
        dw = jax.lax.optimization_barrier(flat_g.T @ flat_x).T
    else:
        dw = flat_x.T @ flat_g
    return g @ w.T, dw


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


class Conv(nn.Module):
    """2-D convolution (NHWC, HWIO kernel) with PyTorch-default init (``init="kaiming_fan_out"``: torchvision's
    ResNet init, ``CONV_INITS``) and symmetric zero padding.

    ``impl="matmul"`` uses ``conv2d`` (``conv2d_matmul``, fast in loops and under vmap on CPU, wherever a
    derivative is taken; XLA's convolution for evaluation on a CPU); ``"lax"`` uses ``lax.conv_general_dilated``
    throughout. Both give the same numbers up to float rounding.
    """
    features: int
    kernel: int
    stride: int = 1
    padding: int = 0
    impl: str = "matmul"
    use_bias: bool = True
    init: str = "torch"

    @nn.compact
    def __call__(self, x):
        ci = x.shape[-1]
        k = self.param("kernel", CONV_INITS[self.init], (self.kernel, self.kernel, ci, self.features))
        b = (self.param("bias", torch_bias_init(ci * self.kernel * self.kernel), (self.features,))
             if self.use_bias else 0.0)
        if self.impl == "matmul":
            y = conv2d(x, k, self.stride, self.padding)
        else:
            y = conv2d_xla(x, k, self.stride, self.padding)
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


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN + shortcut (1x1 conv + BN when shape changes), ReLU;
    ``conv_init``: the convolutions' init (``CONV_INITS``)."""
    features: int
    stride: int = 1
    conv_init: str = "torch"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        y = Conv(self.features, 3, self.stride, 1, use_bias=False, init=self.conv_init, name="conv1")(x)
        y = nn.relu(BatchNorm(name="bn1")(y, train, mask))
        y = Conv(self.features, 3, 1, 1, use_bias=False, init=self.conv_init, name="conv2")(y)
        y = BatchNorm(name="bn2")(y, train, mask)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = Conv(self.features, 1, self.stride, 0, use_bias=False, init=self.conv_init, name="conv_shortcut")(x)
            x = BatchNorm(name="bn_shortcut")(x, train, mask)
        return nn.relu(x + y)


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


class Attention(nn.Module):
    """Multi-head self-attention with a bias-free fused projection W_qkv [D, 3 * heads * dim_head].

    ``qkv`` supplies W_qkv from outside (FedTP's hypernetwork); otherwise it is this module's parameter,
    initialised as PyTorch's ``nn.Linear(D, 3 I, bias=False)`` (U(+-1/sqrt(D)), as FedTP's ViT code does).
    softmax(q k^T / sqrt(dim_head)) v, heads concatenated, then Dense(D) and dropout.
    """
    heads: int = 8
    dim_head: int = 64
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False, qkv=None):
        b, n, d = x.shape
        inner = self.heads * self.dim_head
        w = qkv if qkv is not None else self.param("qkv", torch_kernel_init, (d, 3 * inner))
        # one transpose of the fused projection to [3, b, heads, n, dim_head] puts the batch axes (b, heads) first
        # in both products, as XLA's dots take them (a vit_small step 1.06-1.08x faster on XLA:CPU than with q, k
        # and v transposed apart; benchmarks/RESULTS.md, "Dense layers and W_qkv through kernel_matmul")
        q, k, v = kernel_matmul(x, w).reshape(b, n, 3, self.heads, self.dim_head).transpose(2, 0, 3, 1, 4)
        att = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) * self.dim_head ** -0.5, -1)
        out = jnp.einsum("bhqk,bhkd->bhqd", att, v).transpose(0, 2, 1, 3).reshape(b, n, inner)
        out = Dense(d, name="out")(out)
        return nn.Dropout(self.dropout, deterministic=not train)(out)
