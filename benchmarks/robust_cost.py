"""What each robust aggregator costs over a cohort's updates, alone (no local training): x [N, D] float32 of
N = --rows updates of D = --dim parameters (default 100 x 7,850: a cohort of 100 logistic regressions on MNIST),
all rows present. Each rule is jitted and timed after a compiling call; the rules run in turn, --repeats times,
so a drift in the machine's load reaches all of them alike; the median of each is reported, and its ratio to
the plain mean of a round's aggregation is left to the round-level table (``experiments/robustness.py``).

    python benchmarks/robust_cost.py [--baseline CHECKOUT] [--json FILE]

--baseline: a checkout of another commit: its ``jaxfl/ops/robust.py`` is timed beside this one's, interleaved
(the file imports only jax, so it loads on its own).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

RULES = {  # name: (robust module, x, present) -> [D]
    "median": lambda m, x, p: m.coordinate_median(x, p),
    "trimmed_mean (beta 0.1)": lambda m, x, p: m.trimmed_mean(x, p, 0.1),
    "krum (f 1)": lambda m, x, p: m.multi_krum(x, p, 1)[0],
    "multi_krum (f 1, m k - 1)": lambda m, x, p: m.multi_krum(x, p, 1, x.shape[0] - 1)[0],
    "bulyan (f 1)": lambda m, x, p: m.bulyan(x, p, 1)[0],
    "geometric_median (8 iterations)": lambda m, x, p: m.geometric_median(x, p),
}


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"robust_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--dim", type=int, default=7850)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--baseline", help="a checkout of another commit, timed beside this one")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from jaxfl.ops import robust
    modules = {"this": robust}
    if args.baseline:
        modules["baseline"] = load(Path(args.baseline) / "jaxfl" / "ops" / "robust.py")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(args.rows, args.dim)).astype(np.float32) * 0.01)
    present = jnp.ones(args.rows, bool)
    fns = {("mean", "this"): jax.jit(lambda x, p: jnp.mean(x, axis=0))}
    for name, rule in RULES.items():
        for tag, module in modules.items():
            fns[(name, tag)] = jax.jit(lambda x, p, rule=rule, module=module: rule(module, x, p))
    for f in fns.values():
        jax.block_until_ready(f(x, present))
    times: dict = {key: [] for key in fns}
    for _ in range(args.repeats):
        for key, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(x, present))
            times[key].append(time.perf_counter() - t)
    ms = {key: 1e3 * float(np.median(v)) for key, v in times.items()}
    head = "| rule | ms (this) |" + (" ms (baseline) | this / baseline |" if args.baseline else "")
    lines = [head, "|---|---|" + ("---|---|" if args.baseline else "")]
    for name in ["mean", *RULES]:
        row = f"| {name} | {ms[(name, 'this')]:.2f} |"
        if args.baseline and (name, "baseline") in ms:
            row += f" {ms[(name, 'baseline')]:.2f} | {ms[(name, 'this')] / ms[(name, 'baseline')]:.2f} |"
        elif args.baseline:
            row += " | |"
        lines.append(row)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": args.rows, "dim": args.dim, "repeats": args.repeats,
                                               "device": jax.devices()[0].device_kind,
                                               "ms": {f"{k[0]} | {k[1]}": v for k, v in ms.items()}}, indent=1))


if __name__ == "__main__":
    main()
