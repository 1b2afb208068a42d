"""What a ``lax.switch`` branch costs against the same computation outside it: the forward pass of ``--model`` (an
image model, on 28x28x1 inputs) over ``--batches`` batches inside ``lax.map``, each batch cut to size s (B, B/2,
B/4, B/8), once as the branch of a ``lax.switch`` over the four sizes (index passed at run time, as the
partial-last-batch code does) and once as a plain ``lax.map`` at size s. Both run alternately ``--reps`` times
after compiling; reported: the median microseconds a sample of each, per size. One process, the default device
(pin it to a core with taskset and OMP_NUM_THREADS=1 for a CPU figure).

    python benchmarks/switch_cost.py --model fedavg_cnn --batch 16 --batches 64 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxfl.models import MODELS, build_model  # noqa: E402
from jaxfl.errors import check_choice  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, run_script  # noqa: E402


def measure(model_name: str, batch: int, batches: int, reps: int) -> dict:
    """{size: {"switch_us", "plain_us"}}: median microseconds a sample of the two forms, per branch size."""
    model = build_model(model_name, 10)
    params = model.init(jax.random.key(0), jnp.zeros((batch, 28, 28, 1)), False)
    sizes = (batch, batch // 2, batch // 4, batch // 8)
    forward = lambda p, xb: model.apply(p, xb, False)

    def switched(p, xs, index):  # every batch through the switch, padded back to B as the evaluator does
        branches = [lambda xb, s=s: jnp.pad(forward(p, xb[:s]), ((0, batch - s), (0, 0))) for s in sizes]
        return jax.lax.map(lambda xb: jax.lax.switch(index, branches, xb), xs)

    xs = jnp.asarray(np.random.default_rng(0).random((batches, batch, 28, 28, 1)), jnp.float32)
    run_switch = jax.jit(switched)
    plain = {s: jax.jit(lambda p, xs, s=s: jax.lax.map(lambda xb: forward(p, xb[:s]), xs)) for s in sizes}
    out = {}
    for i, s in enumerate(sizes):
        jax.block_until_ready(run_switch(params, xs, jnp.int32(i)))
        jax.block_until_ready(plain[s](params, xs))
        times = {"switch": [], "plain": []}
        for _ in range(reps):
            for name, call in (("switch", lambda: run_switch(params, xs, jnp.int32(i))),
                               ("plain", lambda: plain[s](params, xs))):
                t = time.perf_counter()
                jax.block_until_ready(call())
                times[name].append(time.perf_counter() - t)
        out[str(s)] = {f"{k}_us": 1e6 * float(np.median(v)) / (batches * s) for k, v in times.items()}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--batch", type=int, default=16, help="B: the branches are B, B/2, B/4, B/8")
    p.add_argument("--batches", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    check_choice("--model", args.model, tuple(MODELS))
    check_at_least("--batch", args.batch, 8)
    check_at_least("--batches", args.batches, 1)
    check_at_least("--reps", args.reps, 1)
    if args.json:
        check_output_file(args.json, "--json")
    res = {"model": args.model, "batch": args.batch, "batches": args.batches, "reps": args.reps,
           "machine": platform.processor() or platform.machine(), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "sizes": measure(args.model, args.batch, args.batches, args.reps)}
    for s, r in res["sizes"].items():
        print(f"size {s}: switch {r['switch_us']:.1f} us a sample, plain {r['plain_us']:.1f} "
              f"({r['switch_us'] / r['plain_us']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
