"""jaxfl's robust aggregators against Flower's on the same updates (``flwr.server.strategy.aggregate``).

Two steps, so that neither environment needs the other's packages:

    # 1. in an environment with Flower and numpy (no jaxfl): draw updates, aggregate them with Flower
    python -m venv /tmp/flwr && /tmp/flwr/bin/pip install flwr numpy
    /tmp/flwr/bin/python experiments/flower_check.py flower --out /tmp/flower.npz
    # 2. with jaxfl: the same updates through jaxfl.ops.robust, the largest difference per rule
    python experiments/flower_check.py compare /tmp/flower.npz --md experiments/logs/flower_check/table.md

The updates: ``--cases`` problems of n clients (7, 11 or 15) with a model of two layers (a [8, 5] matrix and a
[5] vector), Gaussian values, one client's update scaled by 50 (an attacker's); every client has the same
sample count, so Flower's sample-weighted Multi-Krum mean is the plain mean jaxfl takes. Rules: median,
trimmed mean (beta 0.2), Krum and Multi-Krum (f = 1, m = 3), Bulyan (f = 1, Krum as its selection rule).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SHAPES = [(8, 5), (5,)]
SIZES = (7, 11, 15)


def problems(cases: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for c in range(cases):
        n = SIZES[c % len(SIZES)]
        layers = [rng.normal(size=(n,) + s).astype(np.float32) for s in SHAPES]
        for layer in layers:
            layer[n - 1] *= 50.0
        yield n, layers


def flower(args) -> None:
    from flwr.server.strategy import aggregate as A
    out = {}
    for c, (n, layers) in enumerate(problems(args.cases)):
        results = [([layer[i] for layer in layers], 10) for i in range(n)]
        flat = lambda ws: np.concatenate([np.asarray(w).ravel() for w in ws])  # noqa: E731
        out[f"x{c}"] = np.stack([flat([layer[i] for layer in layers]) for i in range(n)])
        out[f"median{c}"] = flat(A.aggregate_median(results))
        out[f"trimmed{c}"] = flat(A.aggregate_trimmed_avg(results, 0.2))
        out[f"krum{c}"] = flat(A.aggregate_krum(results, 1, 0))
        out[f"multikrum{c}"] = flat(A.aggregate_krum(results, 1, 3))
        out[f"bulyan{c}"] = flat(A.aggregate_bulyan(list(results), 1, A.aggregate_krum, to_keep=0))
    import flwr
    np.savez(args.out, cases=args.cases, flwr_version=flwr.__version__, **out)
    print(f"wrote {args.out}: {args.cases} problems, flwr {flwr.__version__}")


def compare(args) -> None:
    import jax
    import jax.numpy as jnp

    from jaxfl.ops import robust
    data = np.load(args.flower)
    rules = {
        "median": lambda x, p: robust.coordinate_median(x, p),
        "trimmed": lambda x, p: robust.trimmed_mean(x, p, 0.2),
        "krum": lambda x, p: robust.multi_krum(x, p, 1, 1)[0],
        "multikrum": lambda x, p: robust.multi_krum(x, p, 1, 3)[0],
        "bulyan": lambda x, p: robust.bulyan(x, p, 1)[0],
    }
    worst = {name: 0.0 for name in rules}
    scale = {name: 0.0 for name in rules}
    for c in range(int(data["cases"])):
        x = jnp.asarray(data[f"x{c}"])
        # padded with two absent rows holding garbage: jaxfl must ignore them as Flower never sees them
        padded = jnp.concatenate([x, jnp.full((2, x.shape[1]), jnp.nan)])
        present = jnp.arange(padded.shape[0]) < x.shape[0]
        for name, rule in rules.items():
            got = np.asarray(jax.jit(rule)(padded, present))
            want = data[f"{name}{c}"]
            worst[name] = max(worst[name], float(np.max(np.abs(got - want))))
            scale[name] = max(scale[name], float(np.max(np.abs(want))))
    rows = ["| rule | problems | largest abs(jaxfl - Flower) | largest abs(Flower) |", "|---|---|---|---|"]
    rows += [f"| {name} | {int(data['cases'])} | {worst[name]:.2e} | {scale[name]:.2f} |" for name in rules]
    text = (f"jaxfl.ops.robust against flwr {data['flwr_version']} "
            f"(`flwr.server.strategy.aggregate`), float32 updates\n\n" + "\n".join(rows) + "\n")
    print(text)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
        Path(args.md).with_suffix(".json").write_text(json.dumps({"max_abs_diff": worst, "max_abs": scale}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    f = sub.add_parser("flower")
    f.add_argument("--cases", type=int, default=30)
    f.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("flower")
    c.add_argument("--md", default=None)
    args = p.parse_args(argv)
    (flower if args.step == "flower" else compare)(args)


if __name__ == "__main__":
    main()
