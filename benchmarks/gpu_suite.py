"""The GPU benchmark suite in one command (needs jax with CUDA; torch on CUDA for the torch rows; no network,
nothing to install). Runs, each workload in its own process, the engine (strategies vmap / chunked / map), a
jitted per-client loop and a PyTorch loop on the same GPU, for cohorts from 10 to 1,000 on equal and on
Dirichlet-skewed clients (``throughput.measure``), then writes ``results.json``, ``results.md`` and
``round_time.png`` (round time against cohort size) into ``--out``. Workloads left when ``--budget-s`` is
spent are skipped and listed as such.

    python benchmarks/gpu_suite.py --out gpu_results          # about 9 minutes on one H100
    python benchmarks/gpu_suite.py --out /tmp/smoke --smoke   # any machine, checks the plumbing: 8 min on
                                                              # the 2-core CPU box under load, no budget
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

# (spec for throughput.run_one, cohort): equal FedAvg CNN and cross-device clients, then label-skewed ones
SUITE = [
    ("equal:fedavg_cnn:10", 10), ("equal:fedavg_cnn:100", 100), ("equal:fedavg_cnn:1000", 1000),
    ("skewed:0.3:1000:10", 10), ("skewed:0.3:1000:100", 100), ("skewed:0.3:1000:1000", 1000),
    ("skewed:0.1:1000:100", 100), ("skewed:0.1:100:100", 100),
    ("xdev:10", 10), ("xdev:100", 100), ("xdev:1000", 1000),
]
SMOKE = [("skewed:0.3:40:4:1000", 4), ("skewed:0.3:40:8:1000", 8), ("xdev:8", 8)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json, results.md, round_time.png")
    p.add_argument("--strategies", default="vmap,chunked,map")
    p.add_argument("--rounds", type=int, default=1, help="rounds timed per runner (after one compiling pass)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip workloads once this much time is spent (default 480; none with --smoke)")
    p.add_argument("--smoke", action="store_true", help="two tiny workloads, to check the suite runs")
    args = p.parse_args(argv)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.smoke else 480.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # jax and torch share the GPU
    start, results, skipped = time.perf_counter(), [], []
    for spec, cohort in (SMOKE if args.smoke else SUITE):
        left = budget - (time.perf_counter() - start)
        if left < 20:
            skipped.append(spec)
            continue
        res = throughput.subprocess_run(_expand(spec, args.smoke), args.strategies, args.rounds, env=env,
                                        timeout=None if left == float("inf") else left)
        if res is None:
            skipped.append(spec)
            continue
        res["suite_cohort"] = cohort
        results.append(res)
        print("\n".join(throughput.report(results[-1:]).splitlines()[2:]), flush=True)
    elapsed = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps({"results": results, "skipped": skipped, "elapsed_s": elapsed},
                                                 indent=1))
    device = results[0]["device"] if results else "none"
    md = [f"Device: {device}; backend {results[0]['backend'] if results else '-'}; "
          f"jax {results[0]['jax'] if results else '-'}; suite time {elapsed:.0f} s; "
          f"command: python benchmarks/gpu_suite.py --out {args.out}" + (" --smoke" if args.smoke else ""), "",
          throughput.report(results)]
    if skipped:
        md += ["", f"Skipped (budget or failure): {', '.join(skipped)}"]
    (out / "results.md").write_text("\n".join(md) + "\n")
    plot(results, out / "round_time.png")
    print("\n".join(md))


def _expand(spec: str, smoke: bool) -> str:
    """``xdev:C``: the cross-device workload (1,000 pfl_cnn clients of 50 samples) at cohort C."""
    if spec.startswith("xdev:"):
        return f"equal:cross_device:{40 if smoke else 1000}:{spec.split(':')[1]}"
    return spec


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = {}
    for r in results:
        for runner in [k for k in r if k.startswith("engine/")] + ["jax_loop", "torch_loop"]:
            if runner in r:
                groups.setdefault((r["workload"], runner), []).append((r["cohort"], r[runner]["round_s"]))
    for (workload, runner), pts in sorted(groups.items()):
        if len(pts) > 1:
            pts.sort()
            ax.plot(*zip(*pts), marker="o", label=f"{workload} {runner}")
    ax.set(xscale="log", yscale="log", xlabel="cohort (clients per round)", ylabel="round time (s)",
           title="round time against cohort size")
    ax.grid(alpha=0.3, which="both")
    if groups:
        ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
