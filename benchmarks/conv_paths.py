"""Convolutions on XLA:CPU: which way of running the FedAvg CNN's local steps is fastest, against
PyTorch (oneDNN) doing the same steps.

One client's local training as the engine runs it: S SGD steps of batch B of the FedAvg CNN (McMahan et al.:
conv5x5(32)-pool-conv5x5(64)-pool-512-10, 28x28x1) inside one jitted call, timed after compilation (median of
``--reps`` calls, each path in its own process so that XLA flags apply to it alone). Paths (``--paths``):

  matmul/loop          jaxfl's default: im2col by shifted slices + one matmul (``models.conv2d_matmul``), the
                       steps in a ``fori_loop`` with a traced trip count (as ``LocalTrainer``)
  matmul/unrolled      the same, the S steps unrolled (a static step count, as one bucket of the ragged engine has)
  autodiff/loop        the same im2col and matmul differentiated by JAX's own rules (``conv_autodiff``): the kernel
                       gradient as cols^T dY, which ``models.kernel_matmul`` computes as (dY^T cols)^T
  lax/loop             XLA's own convolution (``lax.conv_general_dilated``) in the ``fori_loop``
  lax/unrolled         XLA's convolution with the steps unrolled (every convolution at the top level)
  xla/loop             XLA's convolution with its backward convolutions written in the canonical NHWC/HWIO form
                       that XLA:CPU's fast library takes inside loops too (``make_conv_xla``), in the ``fori_loop``
  xla/unrolled         the same, the steps unrolled
  laxfwd/loop          XLA's convolution forward; the backward as ``conv2d_matmul``'s, its patches rebuilt there
                       (``make_conv_hybrid``)
  hybrid/loop          XLA's convolution forward and input gradient (dy with the flipped kernel, canonical form);
                       the kernel gradient from patches rebuilt in the backward pass
  shiftsum/loop        no patch buffer: the sum over the 25 kernel taps of (shifted input) @ kernel[i, j]
  nchw/loop            channels-first im2col (Caffe / classic torch layout): kernel [co, ci*25] @ patches
                       [B, ci*25, H*W]
  vjp/loop             im2col forward with a hand-written backward: dW = patches^T dY (patches kept from the
                       forward pass), dX = one im2col matmul of the padded dY with the flipped kernel
  dft/loop             the second convolution (32 input channels; the first stays im2col) through a 2-D DFT of
                       the padded map's size written as real matmuls: y = IDFT(DFT(x) conj(DFT(k))) on the valid
                       outputs (``conv_dft``): 3.5x fewer multiplications than im2col at the FedAvg CNN's conv2
  winograd/loop        the second convolution by Winograd's F(2x2, 5x5) tiles (``conv_winograd``), its transforms
                       as explicit linear combinations: 2.8x fewer multiplications
  <path>+ynn           with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=+individual_convolution
  <path>+fastmath      with XLA_FLAGS=--xla_cpu_enable_fast_math=true
  <path>+vec512        with XLA_FLAGS=--xla_cpu_prefer_vector_width=512
  <path>+onednn        with XLA_FLAGS=--xla_cpu_use_onednn=true (oneDNN for XLA:CPU's dots and convolutions)
  <path>+xnnpack       with XLA_FLAGS=--xla_cpu_use_xnnpack=true
  torch/1, torch/2     the same S steps in PyTorch, 1 and 2 intra-op threads

    python benchmarks/conv_paths.py --json benchmarks/results/conv_paths.json      # ~10 min on the 2-core CPU
    python benchmarks/conv_paths.py --model femnist_cnn --batch 10 --json out.json   # LEAF's FEMNIST CNN
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PATHS = ["matmul/loop", "matmul/unrolled", "autodiff/loop", "lax/loop", "lax/unrolled", "xla/loop", "xla/unrolled",
         "laxfwd/loop", "hybrid/loop",
         "shiftsum/loop", "nchw/loop", "vjp/loop", "dft/loop", "winograd/loop",
         "lax/unrolled+ynn", "lax/loop+ynn", "matmul/loop+fastmath", "matmul/loop+vec512", "torch/1", "torch/2"]
FLAGS = {"ynn": "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution",
         "fastmath": "--xla_cpu_enable_fast_math=true", "vec512": "--xla_cpu_prefer_vector_width=512",
         "onednn": "--xla_cpu_use_onednn=true", "xnnpack": "--xla_cpu_use_xnnpack=true"}
MODELS = {"fedavg_cnn": dict(hidden=512, classes=10), "femnist_cnn": dict(hidden=2048, classes=62)}


def conv_autodiff(x, k, padding):
    """``models.conv2d_matmul`` without its custom gradient (``kernel_matmul``): im2col and one plain matmul."""
    from jaxfl.models import conv_patches
    kh, kw, ci, co = k.shape
    return conv_patches(x, kh, kw, 1, padding) @ k.reshape(kh * kw * ci, co)


def conv_shiftsum(x, k, padding):
    import jax.numpy as jnp
    kh, kw, ci, co = k.shape
    x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    ho, wo = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    return sum(x[:, i:i + ho, j:j + wo, :] @ k[i, j] for i in range(kh) for j in range(kw))


def conv_nchw(x, k, padding):
    """NHWC in/out, but the patches are built channels-first: [B, ci*kh*kw, H*W], kernel [co, ci*kh*kw]."""
    import jax.numpy as jnp
    kh, kw, ci, co = k.shape
    xc = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0))).transpose(0, 3, 1, 2)
    b, _, hp, wp = xc.shape
    ho, wo = hp - kh + 1, wp - kw + 1
    cols = jnp.stack([xc[:, :, i:i + ho, j:j + wo] for i in range(kh) for j in range(kw)], 2)  # [B, ci, 25, H, W]
    cols = cols.reshape(b, ci * kh * kw, ho * wo)
    kmat = k.transpose(3, 2, 0, 1).reshape(co, ci * kh * kw)
    return jnp.einsum("ok,bkp->bop", kmat, cols).reshape(b, co, ho, wo).transpose(0, 2, 3, 1)


def _phases(rows, cols, n: int, sign: int):
    """cos and sin of sign * 2 pi rows cols / n, [len(rows), len(cols)] each (float64, on the host)."""
    import numpy as np
    a = sign * 2 * np.pi * np.outer(rows, cols) / n
    return np.cos(a), np.sin(a)


def conv_dft(x, k, padding):
    """Stride-1 cross-correlation (NHWC, HWIO) by a 2-D DFT of the padded map's size (n1, n2), which no valid
    output wraps around, with real arithmetic only:

        X = DFT(xpad) [n1, n2//2 + 1],  K = conj(DFT(k)),  Y[u, v] = X[u, v] K[u, v]  (a [B, C] @ [C, O] product
        per frequency),  y[h, w] = Re sum_{u, v} c_v Y[u, v] e^{2 pi i (u h / n1 + v w / n2)} / (n1 n2),

    c_v = 2 but for v = 0 and v = n2 / 2 (rfft's Hermitian weights); every transform a matmul with a constant
    matrix, the padding folded into the forward one's phases."""
    import jax.numpy as jnp
    import numpy as np
    b, h, w, c = x.shape
    kh, kw, _, o = k.shape
    n1, n2 = h + 2 * padding, w + 2 * padding
    ho, wo, nu, nv = n1 - kh + 1, n2 - kw + 1, n1, n2 // 2 + 1
    cat = lambda *a, axis=0: jnp.asarray(np.concatenate(a, axis=axis), x.dtype)
    t = jnp.einsum("vw,bhwc->vbhc", cat(*_phases(np.arange(nv), np.arange(w) + padding, n2, -1)), x)
    p = jnp.einsum("uh,vbhc->uvbc", cat(*_phases(np.arange(nu), np.arange(h) + padding, n1, -1)), t)
    xf = jnp.concatenate([p[:nu, :nv] - p[nu:, nv:], p[:nu, nv:] + p[nu:, :nv]], -1)       # [U, V, B, 2C]: re | im
    q = jnp.einsum("ui,vj,ijco->uvco", cat(*_phases(np.arange(nu), np.arange(kh), n1, 1)),
                   cat(*_phases(np.arange(nv), np.arange(kw), n2, 1)), k)
    kr, ki = q[:nu, :nv] - q[nu:, nv:], q[:nu, nv:] + q[nu:, :nv]
    kf = jnp.concatenate([jnp.concatenate([kr, ki], -1), jnp.concatenate([-ki, kr], -1)], -2)  # [U, V, 2C, 2O]
    yf = jnp.einsum("uvbc,uvcd->uvbd", xf, kf)                                                # [U, V, B, 2O]
    r = jnp.einsum("hu,uvbd->hvbd", cat(*_phases(np.arange(ho), np.arange(nu), n1, 1)) / n1, yf)
    z = jnp.concatenate([r[:ho, ..., :o] - r[ho:, ..., o:], r[:ho, ..., o:] + r[ho:, ..., :o]], 1)  # [Ho, 2V, B, O]
    cv = np.where((np.arange(nv) == 0) | (2 * np.arange(nv) == n2), 1.0, 2.0)
    br, bi = _phases(np.arange(wo), np.arange(nv), n2, 1)
    return jnp.einsum("wv,hvbo->bhwo", cat(br * cv, -bi * cv, axis=1) / n2, z)


def winograd_matrices(m: int, r: int, points):
    """Toom-Cook F(m, r) for cross-correlation, y = AT [(G g) * (BT d)] on a tile d of a = m + r - 1 inputs,
    from a - 1 finite points and infinity: with V_n [a, n] the evaluation matrix (rows p^0..p^(n-1), infinity's
    row e_(n-1)), the product of polynomials is V_a^-1 (V_r g * V_m h), and correlation is its transpose:
    AT = V_m^T, G = V_r, BT = V_a^-T."""
    import numpy as np
    a = m + r - 1

    def evaluation(n):
        v = np.zeros((a, n))
        v[:-1] = np.asarray(points, float)[:, None] ** np.arange(n)
        v[-1, n - 1] = 1.0
        return v
    return evaluation(m).T, evaluation(r), np.linalg.inv(evaluation(a)).T


def conv_winograd(x, k, padding, m: int = 2):
    """Stride-1 cross-correlation (NHWC, HWIO) by Winograd F(m x m, r x r): each m x m output tile is
    AT [(G k G^T) * (BT d BT^T)] AT^T of its a x a input window d (a = m + r - 1), the per-position products a
    [B tiles, C] @ [C, O] matmul, every transform an explicit linear combination (which XLA fuses); the finite
    points the first a - 1 of 0, 1, -1, 1/2, -1/2, 2, -2."""
    import jax.numpy as jnp
    import numpy as np
    b, h, w, c = x.shape
    r, _, _, o = k.shape
    a = m + r - 1
    at, g, bt = winograd_matrices(m, r, (0, 1, -1, 0.5, -0.5, 2, -2)[:a - 1])
    ho, wo = h + 2 * padding - r + 1, w + 2 * padding - r + 1
    th, tw = -(-ho // m), -(-wo // m)
    xp = jnp.pad(x, ((0, 0), (padding, padding + (th - 1) * m + a - h - 2 * padding),
                     (padding, padding + (tw - 1) * m + a - w - 2 * padding), (0, 0)))

    def comb(coeffs, arrays):
        return sum(np.float32(cf) * arr for cf, arr in zip(coeffs, arrays) if cf != 0)
    rows = [comb(bt[p], [xp[:, i:i + m * (th - 1) + 1:m] for i in range(a)]) for p in range(a)]
    d = jnp.stack([comb(bt[q], [row[:, :, j:j + m * (tw - 1) + 1:m] for j in range(a)])
                   for row in rows for q in range(a)]).reshape(a * a, b * th * tw, c)
    kq = [[comb(g[q], [k[i, j] for j in range(r)]) for q in range(a)] for i in range(r)]
    kf = jnp.stack([comb(g[p], [kq[i][q] for i in range(r)]) for p in range(a) for q in range(a)])
    prod = jnp.einsum("anc,aco->ano", d, kf).reshape(a, a, b, th, tw, o)
    half = [[comb(at[i], [prod[p, q] for p in range(a)]) for q in range(a)] for i in range(m)]
    y = jnp.stack([jnp.stack([comb(at[j], half[i]) for j in range(m)]) for i in range(m)])  # [m, m, B, th, tw, O]
    return jnp.transpose(y, (2, 3, 0, 4, 1, 5)).reshape(b, th * m, tw * m, o)[:, :ho, :wo]


def make_conv_vjp():
    import jax
    import jax.numpy as jnp

    from jaxfl.models import conv2d_matmul, conv_patches

    @jax.custom_vjp
    def conv(x, k):
        return conv2d_matmul(x, k, 1, k.shape[0] // 2)

    def fwd(x, k):
        p = conv_patches(x, k.shape[0], k.shape[1], 1, k.shape[0] // 2)
        return p @ k.reshape(-1, k.shape[-1]), (p, k)

    def bwd(res, g):
        p, k = res
        kh, kw, ci, co = k.shape
        dk = jnp.einsum("bhwk,bhwo->ko", p, g).reshape(k.shape)
        flipped = k[::-1, ::-1].transpose(0, 1, 3, 2)  # [kh, kw, co, ci]
        dx = conv_patches(g, kh, kw, 1, kh - 1 - kh // 2) @ flipped.reshape(kh * kw * co, ci)
        return dx, dk

    conv.defvjp(fwd, bwd)
    return conv


def conv_nhwc(x, k, padding: int):
    """XLA's own stride-1 convolution, x [B, H, W, Ci], k [kh, kw, Ci, Co], zero padding ``padding``."""
    import jax
    return jax.lax.conv_general_dilated(x, k, (1, 1), ((padding, padding), (padding, padding)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def make_conv_xla(padding: int):
    """XLA's stride-1 NHWC/HWIO convolution whose backward convolutions are written in the canonical form too.

    Why lax/loop is slow: XLA:CPU's ``ConvCanonicalization`` pass, which rewrites a convolution into the
    NHWC/HWIO form its fast library takes, visits the entry computation only; inside a ``while`` body
    autodiff's backward convolutions (kernel gradient ``f01b_i01o->01bf``, input gradient with the flipped
    kernel ``b01f_01oi->b01f``) run on naive emitted loops. Here (custom VJP):

        dx = conv(dy, flip_hw(kernel) with Ci <-> Co swapped, padding kh - 1 - p)
        dk[i, j, c, o] = sum_{b, h, w} xpad[b, h + i, w + j, c] dy[b, h, w, o]
                       = conv(xpad^T, dy^T)   (x's channels as the batch, its batch as the features)
    """
    import jax
    import jax.numpy as jnp

    def grads(res, dy):
        x, k = res
        dx = conv_nhwc(dy, k[::-1, ::-1].transpose(0, 1, 3, 2), k.shape[0] - 1 - padding)
        xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0))).transpose(3, 1, 2, 0)
        return dx, conv_nhwc(xp, dy.transpose(1, 2, 0, 3), 0).transpose(1, 2, 0, 3)

    conv = jax.custom_vjp(lambda x, k: conv_nhwc(x, k, padding))
    conv.defvjp(lambda x, k: (conv_nhwc(x, k, padding), (x, k)), grads)
    return conv


def make_conv_hybrid(padding: int, dx_lax: bool):
    """XLA's stride-1 NHWC/HWIO convolution forward, the kernel gradient from im2col patches rebuilt in the
    backward pass, dk = (dy^T cols)^T (as ``models.kernel_matmul``), and the input gradient either through im2col's
    transpose (``dx_lax=False``: ``conv2d_matmul``'s backward) or as XLA's convolution of dy with the flipped
    kernel (``dx_lax=True``; canonical NHWC/HWIO, so fast inside loops as the forward is).
    """
    import jax

    from jaxfl.models import conv_patches

    def grads(res, dy):
        x, k = res
        kh, kw, ci, co = k.shape
        cols, cols_vjp = jax.vjp(lambda x: conv_patches(x, kh, kw, 1, padding), x)
        flat_g = dy.reshape(-1, co)
        dk = jax.lax.optimization_barrier(flat_g.T @ cols.reshape(-1, kh * kw * ci)).T.reshape(k.shape)
        if dx_lax:
            dx = conv_nhwc(dy, k[::-1, ::-1].transpose(0, 1, 3, 2), kh - 1 - padding)
        else:
            dx = cols_vjp(dy @ k.reshape(-1, co).T)[0]
        return dx, dk

    conv = jax.custom_vjp(lambda x, k: conv_nhwc(x, k, padding))
    conv.defvjp(lambda x, k: (conv_nhwc(x, k, padding), (x, k)), grads)
    return conv


def jax_path(path: str, model: str, batch: int, steps: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxfl.models import conv2d_matmul, max_pool2
    impl, loop = path.split("+")[0].split("/")
    cfg = MODELS[model]
    vjp_conv = make_conv_vjp() if impl == "vjp" else None
    xla_conv = make_conv_xla(2) if impl == "xla" else None
    hybrid_conv = make_conv_hybrid(2, dx_lax=impl == "hybrid") if impl in ("laxfwd", "hybrid") else None

    def conv(x, k):
        if impl in ("matmul",):
            return conv2d_matmul(x, k, 1, 2)
        if impl == "lax":
            return conv_nhwc(x, k, 2)
        if impl == "xla":
            return xla_conv(x, k)
        if impl in ("laxfwd", "hybrid"):
            return hybrid_conv(x, k)
        if impl == "shiftsum":
            return conv_shiftsum(x, k, 2)
        if impl == "autodiff":
            return conv_autodiff(x, k, 2)
        if impl == "nchw":
            return conv_nchw(x, k, 2)
        if impl in ("dft", "winograd"):  # the second convolution only: with one input channel im2col is cheaper
            fast = conv_dft if impl == "dft" else conv_winograd
            return fast(x, k, 2) if k.shape[2] > 1 else conv2d_matmul(x, k, 1, 2)
        return vjp_conv(x, k)

    def forward(p, x):
        h = max_pool2(jax.nn.relu(conv(x, p["c1"]) + p["b1"]))
        h = max_pool2(jax.nn.relu(conv(h, p["c2"]) + p["b2"]))
        h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["f1"] + p["fb1"])
        return h @ p["f2"] + p["fb2"]

    rng = np.random.default_rng(0)
    init = lambda *s: jnp.asarray(rng.uniform(-0.05, 0.05, s).astype(np.float32))
    params = {"c1": init(5, 5, 1, 32), "b1": init(32), "c2": init(5, 5, 32, 64), "b2": init(64),
              "f1": init(7 * 7 * 64, cfg["hidden"]), "fb1": init(cfg["hidden"]),
              "f2": init(cfg["hidden"], cfg["classes"]), "fb2": init(cfg["classes"])}
    tx = optax.sgd(0.01)
    x = jnp.asarray(rng.uniform(-1, 1, (steps, batch, 28, 28, 1)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, cfg["classes"], (steps, batch)).astype(np.int32))

    def loss(p, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, xb), yb).mean()

    def step(t, p):
        g = jax.grad(loss)(p, x[t], y[t])
        return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

    if loop == "loop":
        run = jax.jit(lambda p, n: jax.lax.fori_loop(0, n, step, p))
        call = lambda: run(params, steps)
    else:
        def unrolled(p):
            for t in range(steps):
                p = step(t, p)
            return p
        run = jax.jit(unrolled)
        call = lambda: run(params)
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return {"step_s": float(np.median(times)) / steps, "compile_s": compile_s}


def torch_path(threads: int, model: str, batch: int, steps: int, reps: int) -> dict:
    import numpy as np
    import torch
    import torch.nn as tnn
    torch.set_num_threads(threads)
    cfg = MODELS[model]
    net = tnn.Sequential(tnn.Conv2d(1, 32, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2),
                         tnn.Conv2d(32, 64, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Flatten(),
                         tnn.Linear(7 * 7 * 64, cfg["hidden"]), tnn.ReLU(), tnn.Linear(cfg["hidden"], cfg["classes"]))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.rand(steps, batch, 1, 28, 28) * 2 - 1
    y = torch.randint(0, cfg["classes"], (steps, batch))

    def call():
        for t in range(steps):
            opt.zero_grad()
            tnn.functional.cross_entropy(net(x[t]), y[t]).backward()
            opt.step()
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {"step_s": float(np.median(times)) / steps, "torch": torch.__version__}


def flops_per_step(model: str, batch: int) -> float:
    """XLA's flop count of one train step (forward, backward, SGD, input scaling) of the im2col model:
    ``roofline.train_step_cost``'s."""
    import jax.numpy as jnp

    from jaxfl.models import build_model
    from roofline import train_step_cost
    sample = jnp.zeros((1, 28, 28, 1), jnp.uint8)
    return train_step_cost(build_model(model, MODELS[model]["classes"]), sample, batch)["flops"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fedavg_cnn", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="local steps per timed call (S)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from jaxfl.errors import ConfigError
    from jaxfl.run.script import check_at_least, check_output_file
    for flag in ("batch", "steps", "reps"):
        check_at_least(f"--{flag}", getattr(a, flag), 1)
    for path in a.paths.split(","):
        base, *flags = path.split("+")
        if base not in PATHS or any(f not in FLAGS for f in flags):
            raise ConfigError(f"--paths: {path!r} is not PATH[+FLAG...] with PATH one of {', '.join(PATHS)} and "
                              f"FLAG of {', '.join(FLAGS)}")
    check_output_file(a.json, "--json")
    if a.one:
        if a.one.startswith("torch/"):
            res = torch_path(int(a.one.split("/")[1]), a.model, a.batch, a.steps, a.reps)
        else:
            res = jax_path(a.one, a.model, a.batch, a.steps, a.reps)
        print(json.dumps(res))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import matmul_peak_gflops
    peak = matmul_peak_gflops()
    flops = flops_per_step(a.model, a.batch)
    out = {"model": a.model, "batch": a.batch, "steps": a.steps, "reps": a.reps, "matmul_peak_gflops": peak,
           "flops_per_step": flops, "command": " ".join(sys.argv), "paths": {}}
    print(f"matmul peak {peak:.0f} GFLOP/s; {flops / 1e9:.3f} GFLOP per step of batch {a.batch}")
    print("| path | XLA_FLAGS | step ms | samples/s | x torch (best) | FLOP/s / peak | compile s |\n"
          "|---|---|---|---|---|---|---|")
    for path in a.paths.split(","):
        flags = " ".join(FLAGS[f] for f in path.split("+")[1:])
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        cmd = [sys.executable, __file__, "--one", path, "--model", a.model, "--batch", str(a.batch),
               "--steps", str(a.steps), "--reps", str(a.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            print(f"{path} failed: {proc.stderr[-500:]}", file=sys.stderr)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(xla_flags=flags, samples_per_s=a.batch / res["step_s"],
                   flops_fraction=flops / res["step_s"] / (peak * 1e9))
        out["paths"][path] = res
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    best_torch = max((v["samples_per_s"] for k, v in out["paths"].items() if k.startswith("torch")), default=None)
    for path, v in out["paths"].items():
        xt = f"{v['samples_per_s'] / best_torch:.2f}" if best_torch else "-"
        print(f"| {path} | {v['xla_flags'] or '-'} | {v['step_s'] * 1e3:.1f} | {v['samples_per_s']:.0f} | {xt} | "
              f"{v['flops_fraction']:.3f} | {v.get('compile_s', 0):.1f} |")
    out["best_torch_samples_per_s"] = best_torch
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
