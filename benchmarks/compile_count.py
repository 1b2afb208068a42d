"""Programs compiled and seconds spent compiling in a whole run, per backend: what a run pays before its rounds
run at speed, which a benchmark that warms up on the same cohorts does not show.

Settings (``--setting``; data under ``JAXFL_DATA_DIR``), each backend in its own fresh process (no compile cache),
through ``jaxfl run``, 20 rounds (``--rounds``), one evaluation at the end:

- ``logreg_mnist`` (the default): FedAvg, logistic regression on MNIST, 300 clients of log-normal sizes
  (``dirichlet_quantity``, sigma 0.8), 100 a round (``--cohorts``), batch 10, one local epoch, ``--strategy vmap``.
- ``fedtp_cifar10``: FedTP (hypernetwork variant) with ``vit_small`` at its paper's per-client size: the 10,000
  CIFAR-10 training images as 10 clients of 1,000 (two classes each, ``shards``), 5 a round, 5 local epochs,
  batch 64, SGD lr 0.01 momentum 0.9 weight decay 1e-5; the platform's default strategy.

``--backends`` takes ``auto`` too (the run's automatic choice: no ``--backend`` flag). Reported per backend,
summed over the run's rounds from metrics.jsonl: ``compiled_programs`` (every XLA program: the rounds', the
evaluation's, the state store's), ``compile_s`` (tracing and compiling), ``time_s`` (the run's rounds and
evaluation, compiling included), ``compile_share`` (compile_s / time_s), the backend the run took (its
start-up line) and the final mean test accuracy (equal up to float rounding: the backends compute the same
rounds).

    JAXFL_DATA_DIR=../shared/data python benchmarks/compile_count.py --out benchmarks/results/compile_count.json
    python benchmarks/compile_count.py --backends streamed,ragged --rounds 100 --cohorts 100,10 --out c.json
    python benchmarks/compile_count.py --setting fedtp_cifar10 --backends auto --rounds 100 --out fedtp.json
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

from backend_choice import backend_taken
from jaxfl.errors import check_choice
from jaxfl.run.script import check_at_least, parse_list, run_script

BACKENDS = ("stacked", "streamed", "ragged", "auto")
# each setting's `jaxfl run` flags (without --clients-per-round, --rounds, --eval-every, --backend, --out) and
# its default cohort
SETTINGS: dict[str, tuple[list[str], int]] = {
    "logreg_mnist": (["--algorithm", "fedavg", "--dataset", "mnist", "--model", "logreg", "--num-clients", "300",
                      "--partition", "dirichlet_quantity", "--client-sizes", "lognormal", "--size-sigma", "0.8",
                      "--batch-size", "10", "--strategy", "vmap"], 100),
    "fedtp_cifar10": (["--algorithm", "fedtp", "--fedtp.variant", "hypernet", "--dataset", "cifar10", "--model",
                       "vit_small", "--normalize", "cifar10", "--num-clients", "10", "--partition", "shards",
                       "--classes-per-client", "2", "--test-per-client", "500", "--local-epochs", "5",
                       "--batch-size", "64", "--lr", "0.01", "--momentum", "0.9", "--weight-decay", "1e-5"], 5),
}


def run_command(setting: str, backend: str, rounds: int, cohort: int, out: str, extra: list[str]) -> list[str]:
    """The ``jaxfl run`` command (after the interpreter) of one run of ``setting`` on ``backend``."""
    flags = SETTINGS[setting][0]
    return ["-m", "jaxfl.run.cli", "run", *flags, "--clients-per-round", str(cohort), "--rounds", str(rounds),
            "--eval-every", str(rounds), *([] if backend == "auto" else ["--backend", backend]),
            "--compile-cache", "none", "--out", out, *extra]


def summarize(hist: list[dict]) -> dict:
    """A run's compile figures from its metrics.jsonl rows: programs, compile and round seconds summed over
    the rounds, the compile share and the final mean test accuracy."""
    compile_s, time_s = sum(h["compile_s"] for h in hist), sum(h["time_s"] for h in hist)
    return {"compiled_programs": sum(h["compiled_programs"] for h in hist),
            "rounds_compiling": sum(h["compiled_programs"] > 0 for h in hist),
            "compile_s": round(compile_s, 2), "time_s": round(time_s, 2),
            "compile_share": round(compile_s / time_s, 4) if time_s > 0 else None,
            "final_mean_accuracy": hist[-1].get("mean_accuracy")}


def run_backend(backend: str, rounds: int, cohort: int, extra: list[str], setting: str = "logreg_mnist",
                timeout_s: float | None = None) -> dict:
    """One run of ``setting`` on ``backend`` in a fresh process: the sums of its metrics.jsonl (of the rounds it
    finished, marked ``timed_out``, when it runs past ``timeout_s``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, *run_command(setting, backend, rounds, cohort, str(out), extra)]
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXFL_COMPILE_CACHE")}
        try:
            stderr, timed_out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                                               timeout=timeout_s).stderr, False
        except subprocess.TimeoutExpired as stopped:  # keep the rounds it finished: a bounded device lease
            err = stopped.stderr or ""
            stderr, timed_out = err.decode(errors="replace") if isinstance(err, bytes) else err, True
        path = out / "metrics.jsonl"
        hist = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    row = {"setting": setting, "backend": backend, "backend_taken": backend_taken(stderr),
           "rounds": rounds, "clients_per_round": cohort,
           "command": " ".join(cmd[1:]).replace(str(out), "OUT")}
    if timed_out:  # a partial run: its figures cover the rounds it finished before --timeout-s
        row.update(timed_out=True, rounds_done=len(hist))
    return {**row, **(summarize(hist) if hist else {})}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", default="logreg_mnist", help=" | ".join(SETTINGS))
    p.add_argument("--backends", default=",".join(BACKENDS[:3]), help=" | ".join(BACKENDS) + ", comma-separated")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cohorts", default=None,
                   help="comma-separated clients per round, each run on every backend (default: the setting's)")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=None,
                   help="stop a run after this many seconds and report the rounds it finished")
    args, extra = p.parse_known_args(argv)
    backends = parse_list(args.backends, "--backends", choices=BACKENDS)  # (a ConfigError: one line, exit 2)
    check_choice("--setting", args.setting, tuple(SETTINGS))
    cohorts = parse_list(args.cohorts or str(SETTINGS[args.setting][1]), "--cohorts", kind=int)
    check_at_least("--cohorts", cohorts, 1)
    check_at_least("--timeout-s", args.timeout_s, 0, strict=True)
    rows = []
    for cohort in cohorts:
        for b in backends:
            rows.append(run_backend(b, args.rounds, cohort, extra, args.setting, args.timeout_s))
            print(json.dumps(rows[-1]), flush=True)
    import jax
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "cpu_count": os.cpu_count(), "jax": jax.__version__,
                                          "device": jax.devices()[0].device_kind, "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
