"""Programs compiled and seconds spent compiling in a whole run, per backend: what a run pays before its rounds
run at speed, which a benchmark that warms up on the same cohorts does not show.

Setting (the default): FedAvg, logistic regression on MNIST (``JAXFL_DATA_DIR``), 300 clients of log-normal sizes
(``dirichlet_quantity``, sigma 0.8), 100 a round (``--cohorts``), batch 10, one local epoch, ``--strategy vmap``,
20 rounds (``--rounds``), one evaluation at the end; each backend in its own fresh process (no compile cache),
through ``jaxfl run``. Reported per backend, summed over the run's rounds from metrics.jsonl:
``compiled_programs`` (every XLA program: the rounds', the evaluation's, the state store's), ``compile_s``
(tracing and compiling) and ``time_s`` (the run's rounds and evaluation, compiling included), and the final mean
test accuracy (equal up to float rounding: the backends compute the same rounds).

    JAXFL_DATA_DIR=../shared/data python benchmarks/compile_count.py --out benchmarks/results/compile_count.json
    python benchmarks/compile_count.py --backends streamed,ragged --rounds 100 --cohorts 100,10 --out c.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxfl.run.script import check_at_least, parse_list, run_script

BACKENDS = ("stacked", "streamed", "ragged")


def run_backend(backend: str, rounds: int, cohort: int, extra: list[str]) -> dict:
    """One run of the setting on ``backend`` in a fresh process: the sums of its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "jaxfl.run.cli", "run", "--algorithm", "fedavg", "--dataset", "mnist",
               "--model", "logreg", "--num-clients", "300", "--clients-per-round", str(cohort), "--partition",
               "dirichlet_quantity", "--client-sizes", "lognormal", "--size-sigma", "0.8", "--batch-size", "10",
               "--strategy", "vmap", "--rounds", str(rounds), "--eval-every", str(rounds), "--backend", backend,
               "--compile-cache", "none", "--quiet", "--out", str(out), *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXFL_COMPILE_CACHE")}
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"backend": backend, "rounds": rounds, "clients_per_round": cohort,
            "command": " ".join(cmd[1:]).replace(str(out), "OUT"),
            "compiled_programs": sum(h["compiled_programs"] for h in hist),
            "compile_s": round(sum(h["compile_s"] for h in hist), 2),
            "time_s": round(sum(h["time_s"] for h in hist), 2),
            "final_mean_accuracy": hist[-1]["mean_accuracy"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cohorts", default="100", help="comma-separated clients per round, each run on every backend")
    p.add_argument("--out", required=True)
    args, extra = p.parse_known_args(argv)
    backends = parse_list(args.backends, "--backends", choices=BACKENDS)  # (a ConfigError: one line, exit 2)
    cohorts = parse_list(args.cohorts, "--cohorts", kind=int)
    check_at_least("--cohorts", cohorts, 1)
    rows = []
    for cohort in cohorts:
        for b in backends:
            rows.append(run_backend(b, args.rounds, cohort, extra))
            print(json.dumps(rows[-1]), flush=True)
    import jax
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "cpu_count": os.cpu_count(), "jax": jax.__version__, "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
