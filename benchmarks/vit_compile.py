"""Compile time of a FedTP-sized ViT's local training with its blocks unrolled (the library's ``ViTEncoder``)
against the same blocks in one ``lax.scan`` (``nn.scan`` over one block, parameters stacked on a leading axis):
a cohort of ``--clients`` clients, ``vmap`` over clients of a ``fori_loop`` of SGD steps on batches of
``--batch`` 32x32x3 images, dropout on (as in training). Reported per form: seconds to lower and to compile the
program, and milliseconds a step after compiling (median of ``--reps`` calls). The two forms compute the same
function of differently laid-out parameters; this measures only whether one scan body instead of ``--depth``
copies of the block shortens compiling, and what it costs a step (a GPU compiles each copy's fusions).

    python benchmarks/vit_compile.py --depth 8 --clients 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxfl.models.encoders import ViTEncoder  # noqa: E402
from jaxfl.models.layers import Attention, Dense  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, run_script  # noqa: E402


class Block(nn.Module):
    """One pre-norm ViT block, as ``ViTEncoder``'s loop body: x + Attn(LN(x)); x + FF(LN(x))."""
    heads: int
    dim_head: int
    mlp_dim: int
    dropout: float

    @nn.compact
    def __call__(self, x, train):
        drop = lambda t: nn.Dropout(self.dropout, deterministic=not train)(t)  # noqa: E731
        x = x + Attention(self.heads, self.dim_head, self.dropout)(nn.LayerNorm(epsilon=1e-5)(x), train)
        y = drop(nn.gelu(Dense(self.mlp_dim)(nn.LayerNorm(epsilon=1e-5)(x)), approximate=False))
        return x + drop(Dense(x.shape[-1])(y)), None


class ScannedViT(nn.Module):
    """``ViTEncoder`` with its ``depth`` blocks as one ``nn.scan`` (a head of 10 classes on the CLS token)."""
    depth: int
    patch: int = 4
    dim: int = 128
    heads: int = 8
    dim_head: int = 64
    mlp_dim: int = 256
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train=False):
        b, h, w, c = x.shape
        p = self.patch
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = Dense(self.dim)(x)
        cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, self.dim))
        pos = self.param("pos", nn.initializers.normal(1.0), (1, x.shape[1] + 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], 1) + pos
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                         in_axes=nn.broadcast, length=self.depth)
        x, _ = blocks(self.heads, self.dim_head, self.mlp_dim, self.dropout)(x, train)
        return Dense(10)(nn.LayerNorm(epsilon=1e-5)(x[:, 0]))


class UnrolledViT(nn.Module):
    """The library's ``ViTEncoder`` (blocks unrolled) with the same head."""
    depth: int

    @nn.compact
    def __call__(self, x, train=False):
        return Dense(10)(ViTEncoder(depth=self.depth)(x, train))


def measure(model, clients: int, steps: int, batch: int, reps: int) -> dict:
    """Lower and compile seconds of the cohort's local training, and milliseconds a step after compiling."""
    x = jnp.zeros((batch, 32, 32, 3))
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)["params"]

    def loss(p, xb, yb, key):
        logits = model.apply({"params": p}, xb, True, rngs={"dropout": key})
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))

    def client(p, xs, ys, key):
        def step(i, p):
            g = jax.grad(loss)(p, xs[i], ys[i], jax.random.fold_in(key, i))
            return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g)
        return jax.lax.fori_loop(0, steps, step, p)

    cohort = jax.jit(jax.vmap(client))
    stacked = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape), params)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.random((clients, steps, batch, 32, 32, 3)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, 10, (clients, steps, batch)), jnp.int32)
    keys = jax.random.split(jax.random.key(2), clients)
    t0 = time.perf_counter()
    lowered = cohort.lower(stacked, xs, ys, keys)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(stacked, xs, ys, keys))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(stacked, xs, ys, keys))
        times.append(time.perf_counter() - t)
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "step_ms": float(np.median(times)) / steps * 1e3,
            "parameters": int(sum(a.size for a in jax.tree_util.tree_leaves(params)))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=8, help="ViT blocks (vit_small: 8)")
    p.add_argument("--clients", type=int, default=5, help="clients trained together (FedTP's cohort: 5)")
    p.add_argument("--steps", type=int, default=4, help="SGD steps a client in the timed program")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for flag in ("depth", "clients", "steps", "batch", "reps"):
        check_at_least(f"--{flag}", getattr(args, flag), 1)
    check_output_file(args.json, "--json")
    out = {"command": "python benchmarks/vit_compile.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
           "machine": platform.processor() or platform.machine(), "args": vars(args), "rows": {}}
    for name, model in (("unrolled", UnrolledViT(args.depth)), ("scan", ScannedViT(args.depth))):
        r = out["rows"][name] = measure(model, args.clients, args.steps, args.batch, args.reps)
        print(f"{name:9s} lower {r['lower_s']:6.2f} s  compile {r['compile_s']:6.2f} s  step {r['step_ms']:8.2f} ms  "
              f"({r['parameters']:,} parameters)", flush=True)
        if args.json:  # after each form: a time limit that stops the second keeps the first
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_script(main)
