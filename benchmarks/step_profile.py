"""Where one local training step's time goes, operation by operation, as XLA runs it.

    python benchmarks/step_profile.py --model fedavg_cnn --batch 32            # both cores
    taskset -c 0 python benchmarks/step_profile.py --model fedavg_cnn --batch 32   # one core

``--steps`` SGD steps of a jaxfl model (``jaxfl.models.build_model``; no BatchNorm: parameters only; dropout
off unless ``--dropout``) on random
inputs, inside one jitted ``fori_loop`` as the engine's local training runs them, are traced with
``jax.profiler`` (``--reps`` calls after a compiling one). The trace's operation events are summed by name and
printed per step, largest first, with each operation's output shape from the compiled HLO and its share of the
step's wall time. ``--kernel-grad-min`` sets ``models.layers.TRANSPOSED_KERNEL_GRAD_MIN`` for the run (e.g.
10**9: the convolutions' kernel gradients as autodiff writes them). On a CPU the operations are XLA:CPU's
thunks (fusions, dots, concatenations); with several threads an operation's events can overlap, so the shares
may add up to more than 100 %.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# trace events that wrap the program rather than being one of its operations
WRAPPERS = re.compile(r"^(\$|ThunkExecutor|while|PjRt|TfrtCpu|XlaModule|ExecuteHelper|end: )")


def op_shapes(hlo_text: str) -> dict[str, str]:
    """{operation name: its output shape} from a compiled module's text (``%name = f32[...]{...} op(``)."""
    shapes = {}
    for m in re.finditer(r"%([\w.-]+) = ([a-z0-9]+\[[0-9,]*\])", hlo_text):
        shapes.setdefault(m.group(1), m.group(2))
    return shapes


def op_sources(hlo_text: str, top: int = 3) -> dict[str, str]:
    """{operation name: the model code it computes} from a compiled module's text: the ``op_name`` metadata of
    the operation, or of every instruction of the computation a fusion calls, cut to the scope jax named (the
    part after the last loop body, e.g. ``transpose(jvp(Classifier))/encoder/conv2`` for conv2's backward pass)
    and counted: the ``top`` most frequent scopes, ``scope xN; ...``."""
    def scope(op_name: str) -> str:
        return op_name.rsplit("/body/", 1)[-1].rsplit("/", 1)[0]

    bodies: dict[str, list[str]] = {}
    calls, own = {}, {}
    body = None
    for line in hlo_text.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a computation's header
            body = bodies.setdefault(line.split()[0].lstrip("%"), [])
            continue
        if line.startswith("}"):
            body = None
            continue
        op = re.match(r"\s*(?:ROOT )?%([\w.-]+) = ", line)
        named = re.search(r'op_name="([^"]+)"', line)
        if body is not None and named:
            body.append(scope(named.group(1)))
        if op:
            called = re.search(r"calls=%([\w.-]+)", line)
            if called:
                calls.setdefault(op.group(1), called.group(1))
            if named:
                own.setdefault(op.group(1), scope(named.group(1)))
    out = {}
    for name in set(calls) | set(own):
        names = bodies.get(calls[name], []) if name in calls else []
        names = names or [own[name]] if name in own else names
        if names:
            out[name] = "; ".join(f"{n} x{c}" for n, c in collections.Counter(names).most_common(top))
    return out


def traced_ops(trace_dir: str) -> tuple[dict[str, float], collections.Counter]:
    """({operation: seconds}, {operation: events}) summed over the perfetto trace ``jax.profiler.trace`` wrote
    under ``trace_dir``: its complete events, the wrappers around the program (``WRAPPERS``) left out."""
    [trace] = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    total, count = collections.defaultdict(float), collections.Counter()
    for e in json.load(gzip.open(trace))["traceEvents"]:
        if e.get("ph") == "X" and not WRAPPERS.match(e["name"]):
            total[e["name"]] += e["dur"] * 1e-6
            count[e["name"]] += 1
    return total, count


def profile(model: str, batch: int, steps: int, reps: int, shape: tuple[int, ...], classes: int,
            kernel_grad_min: int | None = None, dropout: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxfl.errors import ConfigError
    from jaxfl.models import build_model, layers

    if kernel_grad_min is not None:  # read by kernel_matmul's backward when the step is traced
        layers.TRANSPOSED_KERNEL_GRAD_MIN = kernel_grad_min

    mdl = build_model(model, classes)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-1, 1, (steps, batch) + shape).astype(np.float32))
    y = jnp.asarray(rng.integers(0, classes, (steps, batch)).astype(np.int32))
    variables = mdl.init(jax.random.key(0), x[0, :1])
    if set(variables) != {"params"}:
        raise ConfigError(f"--model {model} has state besides parameters ({sorted(variables)}); profile a model "
                          f"without BatchNorm")
    tx = optax.sgd(0.01)

    def loss(p, xb, yb, key):
        kw = {"train": True, "rngs": {"dropout": key}} if dropout else {}
        return optax.softmax_cross_entropy_with_integer_labels(mdl.apply({"params": p}, xb, **kw), yb).mean()

    def step(t, p):
        g = jax.grad(loss)(p, x[t], y[t], jax.random.fold_in(jax.random.key(1), t))
        return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

    run = jax.jit(lambda p, n: jax.lax.fori_loop(0, n, step, p))
    params = variables["params"]
    jax.block_until_ready(run(params, steps))  # compile
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(run(params, steps))
    step_s = (time.perf_counter() - t0) / reps / steps
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(run(params, steps))
        total, _ = traced_ops(trace_dir)
    shapes = op_shapes(run.lower(params, steps).compile().as_text())
    ops = sorted(((name, sec / reps / steps) for name, sec in total.items()), key=lambda kv: -kv[1])
    return {"model": model, "batch": batch, "steps": steps, "reps": reps, "step_s": step_s,
            "transposed_kernel_grad_min": layers.TRANSPOSED_KERNEL_GRAD_MIN, "dropout": dropout,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "ops": [{"name": n, "shape": shapes.get(n, ""), "s_per_step": s} for n, s in ops]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shape", default="28,28,1", help="one input's shape (H,W,C)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--top", type=int, default=20, help="operations printed")
    p.add_argument("--kernel-grad-min", type=int, default=None,
                   help="models.layers.TRANSPOSED_KERNEL_GRAD_MIN for this run (a large value: every convolution's "
                        "kernel gradient as autodiff writes it, cols^T dY)")
    p.add_argument("--dropout", action="store_true",
                   help="train mode: the model's dropout on, as local training runs it (default: off)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        from jaxfl.errors import ConfigError
        raise ConfigError(f"--shape {args.shape!r}: give one input's shape as integers H,W,C") from None
    res = profile(args.model, args.batch, args.steps, args.reps, shape, args.classes, args.kernel_grad_min,
                  args.dropout)
    res["command"] = "benchmarks/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{args.model}, batch {args.batch}: {res['step_s'] * 1e3:.1f} ms a step ({res['device']}, jax {res['jax']})")
    print("| operation | output shape | ms a step | share of the step |")
    print("|---|---|---|---|")
    for op in res["ops"][:args.top]:
        ms, share = op["s_per_step"] * 1e3, op["s_per_step"] / res["step_s"]
        print(f"| {op['name']} | {op['shape']} | {ms:.2f} | {share:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
