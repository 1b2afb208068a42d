"""A round's page faults and kernel time with glibc's malloc as the system sets it and as `jaxfl run` sets it
(``jaxfl.core.host_memory.keep_freed_memory``), on the same cohorts.

    taskset -c 0 python benchmarks/host_memory.py --plan fedavg_cnn_dir0.3:1000:50 --pairs 2 --json OUT.json

Each side runs in its own process (the malloc settings are the process's, made before jax starts), the two
alternated ``--pairs`` times: FedAvg on a workload of ``throughput.py --small`` (synthetic samples, the
workload's batch, one local epoch, the stacked backend with ``map`` on one device, partial last batches at B,
B/2, B/4, B/8), one compiling round, then ``--rounds`` rounds one call each, every round's wall time, user and
system CPU time and minor page faults (``getrusage``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("system", "keep")


def measure(plan: str, rounds: int, mode: str) -> dict:
    """One side in this process: ``mode`` "keep" makes jaxfl's malloc settings first (before jax starts)."""
    from jaxfl.core.host_memory import keep_freed_memory
    applied = keep_freed_memory() if mode == "keep" else False
    import resource
    import time

    import jax
    import optax

    from throughput import SMALL, lognormal_counts, skewed_counts, small_population

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Stacked
    from jaxfl.core.cohort import client_map
    from jaxfl.core.trainer import LocalTrainer, tail_sizes
    from jaxfl.models import build_model

    name, n, cohort = plan.split(":")
    n, cohort, w = int(n), int(cohort), SMALL[name]
    counts = (skewed_counts(w["dirichlet"], n, w["samples"]) if "dirichlet" in w
              else lognormal_counts(n, w["median"], w["sigma"]))
    data = small_population(w, counts)
    trainer = LocalTrainer(optax.sgd(w["lr"]), w["batch"], 1, tail_sizes=tail_sizes(w["batch"]), tail_log=[])
    alg = build_algorithm("fedavg", build_model(w["model"], w["classes"]), trainer)
    sim = Stacked(alg, data, batch_size=w["batch"], clients=client_map("map"), cohort_size=cohort,
                  rounds_per_call=1, trainer=trainer)
    server, store = sim.init(jax.random.key(0), data.x[:1])
    root = jax.random.key(1)
    server, _ = sim.round(server, store, 0, root)  # compile
    jax.block_until_ready(server)
    rows = []
    for r in range(rounds):
        u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        server, _ = sim.round(server, store, r, root)
        jax.block_until_ready(server)
        wall, u1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        rows.append({"round": r, "wall_s": wall, "user_s": u1.ru_utime - u0.ru_utime,
                     "sys_s": u1.ru_stime - u0.ru_stime, "minor_faults": u1.ru_minflt - u0.ru_minflt})
    return {"plan": plan, "mode": mode, "applied": applied, "rounds": rows, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def summary(res: dict) -> str:
    r = res["rounds"]
    mean = lambda k: sum(x[k] for x in r) / len(r)  # noqa: E731
    return (f"| {res['plan']} | {res['mode']} | {mean('wall_s') * 1e3:.0f} | {mean('user_s') * 1e3:.0f} | "
            f"{mean('sys_s') * 1e3:.0f} | {mean('minor_faults'):.0f} | {res['peak_rss_gb']:.2f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="fedavg_cnn_dir0.3:1000:50", help="NAME:CLIENTS:COHORT (throughput.py --small)")
    p.add_argument("--rounds", type=int, default=4, help="rounds timed a side, after one compiling round")
    p.add_argument("--pairs", type=int, default=2, help="system/keep pairs, alternated")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, choices=MODES, help=argparse.SUPPRESS)  # internal: one side
    args = p.parse_args(argv)
    from throughput import SMALL

    from jaxfl.errors import ConfigError
    from jaxfl.run.script import check_at_least, check_output_file
    name, *sizes = args.plan.split(":")
    if name not in SMALL or len(sizes) != 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise ConfigError(f"--plan {args.plan!r}: give NAME:CLIENTS:COHORT with NAME one of {', '.join(SMALL)}")
    check_at_least("--rounds", args.rounds, 1)
    check_at_least("--pairs", args.pairs, 1)
    check_output_file(args.json, "--json")
    if args.one:
        print(json.dumps(measure(args.plan, args.rounds, args.one)))
        return
    results = []
    print("| plan | malloc | wall ms a round | user ms | system ms | minor faults | peak RSS GB |\n"
          "|---|---|---|---|---|---|---|")
    for _ in range(args.pairs):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--plan", args.plan, "--rounds", str(args.rounds),
                                  "--one", mode], capture_output=True, text=True, check=True)
            command = "benchmarks/host_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
            results.append(dict(json.loads(out.stdout.strip().splitlines()[-1]), command=command))
            print(summary(results[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
