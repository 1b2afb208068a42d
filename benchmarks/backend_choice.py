"""Does ``jaxfl run``'s automatic backend choice pick the faster backend? For each workload, two ``jaxfl run``
processes on the same MNIST split (``--dataset mnist``, read through ``JAXFL_DATA_DIR``): the default (the
backend it chose is read from the CLI's start-up line) and the other backend (``--backend``). A
round's time is the median of ``time_s - compile_s`` over the rounds between the first and the last (which
evaluates), from each run's ``metrics.jsonl``: the steady cost once its shapes are compiled; beside it the
roofline of those rounds (``roofline.py``: their real samples' FLOP/s against the machine's measured peak). Writes
``backend_choice.json`` and ``backend_choice.md`` into ``--out``.

    python benchmarks/backend_choice.py --out DIR                 # the workloads below (~6 min on an H200)
    python benchmarks/backend_choice.py --out DIR --smoke         # two tiny ones, any machine

The rule (``jaxfl/core/cost.py``) was calibrated on the GPU suite's synthetic workloads; these are MNIST splits it
never saw: label-skewed (Dirichlet 0.3, so client sizes are uneven) FedAvg CNN and 2NN cohorts, and logreg.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402  (each backend's useful FLOP/s against the machine's measured peak)

# name: the `jaxfl run` flags of the workload (every run adds --rounds, --eval-every, --backend, --out)
WORKLOADS = {
    "fedavg_cnn dir0.3 100 clients, cohort 10": "--model fedavg_cnn --num-clients 100 --clients-per-round 10",
    "fedavg_cnn dir0.3 100 clients, cohort 100": "--model fedavg_cnn --num-clients 100 --clients-per-round 100",
    "mlp_2nn dir0.3 300 clients, cohort 100": "--model mlp_2nn --num-clients 300 --clients-per-round 100",
    "logreg dir0.3 300 clients, cohort 100": "--model logreg --num-clients 300 --clients-per-round 100",
}
SMOKE = {
    "mlp_2nn dir0.3 20 clients, cohort 4": "--model mlp_2nn --num-clients 20 --clients-per-round 4",
    "logreg dir0.3 20 clients, cohort 4": "--model logreg --num-clients 20 --clients-per-round 4",
}
COMMON = "--dataset mnist --algorithm fedavg --partition dirichlet --dirichlet-alpha 0.3 --batch-size 10 --lr 0.05"


def backend_taken(stderr: str) -> str | None:
    """The backend a ``jaxfl run`` ran, read from its start-up line on stderr (None if it printed none)."""
    found = re.search(r", backend (\w+),", stderr)
    return found.group(1) if found else None


def run_once(flags: str, backend: str | None, rounds: int, out: Path) -> dict:
    """One ``jaxfl run`` process: {backend (the one it ran: its start-up line), round_s (median of rounds
    2 .. rounds-1, less their compiling: new bucket shapes compile once per run), compile_s (all rounds'),
    wall_s}, or {error, wall_s}."""
    argv = [sys.executable, "-m", "jaxfl.run.cli", "run", *COMMON.split(), *flags.split(), "--rounds", str(rounds),
            "--eval-every", str(rounds), "--out", str(out), "--compile-cache", "none"
            ] + (["--backend", backend] if backend else [])  # no cache: each run's compile_s is its own
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "wall_s": wall}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = statistics.median(r["time_s"] - r["compile_s"] for r in recs[1:-1])
    # the same rounds' rate of useful work: real samples trained over their seconds
    samples_per_s = (sum(sum(r["train_samples"]) for r in recs[1:-1])
                     / max(sum(r["time_s"] - r["compile_s"] for r in recs[1:-1]), 1e-12))
    return {"backend": backend_taken(proc.stderr), "round_s": steady, "samples_per_s": samples_per_s,
            "compile_s": sum(r["compile_s"] for r in recs), "wall_s": wall}


def step_cost(flags: str) -> dict:
    """``roofline.train_step_cost`` of the workload's model (its ``--model``) on MNIST-shaped inputs at the
    batch size of ``COMMON``."""
    import numpy as np

    from jaxfl.models import build_model
    model = re.search(r"--model (\S+)", flags).group(1)
    batch = int(re.search(r"--batch-size (\d+)", COMMON).group(1))
    return roofline.train_step_cost(build_model(model, 10), np.zeros((1, 28, 28, 1), np.uint8), batch)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=8, help="rounds per run: the first compiles, the last evaluates")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the workloads left after this many seconds")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", default="", help="run only the workloads whose name contains this text")
    args = p.parse_args(argv)
    from jaxfl.errors import ConfigError
    from jaxfl.run.script import check_at_least
    check_at_least("--rounds", args.rounds, 3)  # a compiling round, one timed, an evaluating one
    names = list(SMOKE if args.smoke else WORKLOADS)
    if not any(args.only in name for name in names):
        raise ConfigError(f"--only {args.only!r} matches no workload; the workloads: {'; '.join(names)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    import jax  # the device, for the record
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    peaks = roofline.machine_peaks()
    for name, flags in (SMOKE if args.smoke else WORKLOADS).items():
        if args.only not in name:
            continue
        if time.perf_counter() - start > args.budget_s:
            rows.append({"workload": name, "flags": flags, "skipped": "budget spent"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            row = {"workload": name, "flags": flags}
            auto = run_once(flags, None, args.rounds, Path(tmp) / "auto")  # the default: times the chosen one
            row["chosen"] = auto.get("backend") or f"? ({auto.get('error')})"
            for backend in ("stacked", "ragged"):
                same = auto.get("backend") == backend
                row[backend] = auto if same else run_once(flags, backend, args.rounds, Path(tmp) / backend)
        cost = step_cost(flags)
        for backend in ("stacked", "ragged"):
            if "samples_per_s" in row[backend]:
                row[backend] = dict(row[backend], **roofline.roofline(row[backend]["samples_per_s"], cost, peaks))
        times = {b: row[b]["round_s"] for b in ("stacked", "ragged") if "round_s" in row[b]}
        row["faster"] = min(times, key=times.get) if len(times) == 2 else None
        row["right"] = row["faster"] == row["chosen"] if row["faster"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": device, "command": "python benchmarks/backend_choice.py " + " ".join(argv or sys.argv[1:]),
              "common_flags": COMMON, "rounds": args.rounds, **peaks, "rows": rows}
    (out / "backend_choice.json").write_text(json.dumps(result, indent=1))
    (out / "backend_choice.md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    lines = [f"Device: {result['device']}. `{result['command']}`; every run: `jaxfl run {result['common_flags']}`.",
             "", "| workload | chosen | stacked s/round | ragged s/round | stacked FLOP/s / peak | "
             "ragged FLOP/s / peak | faster | chosen is faster |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['workload']} | skipped ({r['skipped']}) | | | | | | |")
            continue
        cell = lambda m: f"{m['round_s']:.4f}" if "round_s" in m else f"failed: {m['error']}"
        frac = lambda m: f"{m['flops_fraction']:.4f}" if "flops_fraction" in m else "-"  # noqa: E731
        lines.append(f"| {r['workload']} | {r['chosen']} | {cell(r['stacked'])} | {cell(r['ragged'])} | "
                     f"{frac(r['stacked'])} | {frac(r['ragged'])} | "
                     f"{r['faster'] or '-'} | {'yes' if r['right'] else 'no' if r['right'] is False else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
