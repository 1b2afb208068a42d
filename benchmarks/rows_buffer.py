"""A stacked ``map`` round's trained rows kept between rounds against a new buffer every call, in one process.

Two stacked engines on the same workload of ``throughput.py --small`` (FedAvg, synthetic samples, one local
epoch, ``map``): ``Stacked(keep_rows=True)`` (the default: each call writes its clients' rows into the rows of the
call before, donated to it) and ``keep_rows=False`` (a new [cohort, ...] output, zero-filled, every call). After
one compiling call each, their calls alternate (``--calls`` each, the order swapped every call), so both sides
see the same machine state; printed: each side's median and mean seconds a round and the ratio new / kept of the
medians. ``--devices``: the cohort split over that many CPU devices (one per core, as a CPU run does by default);
``--k``: rounds a call (``run_rounds``); ``--tails``: partial last batches at the eighths of B the clients' last
batches take.

    python benchmarks/rows_buffer.py --plan fedavg_cnn_dir0.3:1000:50 --devices 2 --tails --calls 8
    python benchmarks/rows_buffer.py --plan logreg:1000:100 --devices 2 --k 10 --calls 30 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def compare(plan: str, devices: int = 1, k: int = 1, calls: int = 8, tails: bool = False) -> dict:
    """Seconds a round of each side, ``calls`` alternated calls of ``k`` rounds each (``devices`` must be
    available: ask for them before jax starts, ``use_cpu_devices``)."""
    import time

    import jax
    import numpy as np
    import optax
    from throughput import SMALL, small_population, workload_counts

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Stacked
    from jaxfl.core.cohort import client_map
    from jaxfl.core.distributed import client_mesh
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.models import build_model
    from jaxfl.run.build import tails_chosen

    name, n, cohort = plan.split(":")
    w = SMALL[name]
    counts = workload_counts(w, int(n))
    data = small_population(w, counts)
    tail = tails_chosen("on", counts, w["batch"]) or None if tails else None
    mesh = client_mesh(devices) if devices > 1 else None
    root = jax.random.key(1)
    sides = {}
    for keep in (True, False):
        trainer = LocalTrainer(optax.sgd(w["lr"]), w["batch"], 1, tail_sizes=tail, tail_log=[])
        sim = Stacked(build_algorithm("fedavg", build_model(w["model"], w["classes"]), trainer), data,
                      batch_size=w["batch"], clients=client_map("map", mesh=mesh), cohort_size=int(cohort),
                      rounds_per_call=k, keep_rows=keep, trainer=trainer)
        server, store = sim.init(jax.random.key(0), data.x[:1])
        server, _ = sim.run_rounds(server, store, 0, k, root)  # compile
        sides[keep] = {"sim": sim, "server": jax.block_until_ready(server), "store": store, "s": []}
    for c in range(calls):
        for keep in ((True, False) if c % 2 == 0 else (False, True)):
            side = sides[keep]
            t = time.perf_counter()
            server, _ = side["sim"].run_rounds(side["server"], side["store"], 0, k, root)
            side["server"] = jax.block_until_ready(server)
            side["s"].append((time.perf_counter() - t) / k)
    out = {"plan": plan, "devices": devices, "k": k, "calls": calls, "tails": tails,
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for keep, label in ((True, "kept"), (False, "new")):
        s = sides[keep]["s"]
        out[label] = {"median_s": float(np.median(s)), "mean_s": float(np.mean(s)), "round_s": s}
    out["new_over_kept"] = out["new"]["median_s"] / out["kept"]["median_s"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="fedavg_cnn_dir0.3:1000:50", help="NAME:CLIENTS:COHORT (throughput.py --small)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices the cohort is split over")
    p.add_argument("--k", type=int, default=1, help="rounds a call")
    p.add_argument("--calls", type=int, default=8, help="timed calls of each side, alternated")
    p.add_argument("--tails", action="store_true",
                   help="partial last batches at the eighths of B the population's last batches take")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from throughput import check_plan_item

    from jaxfl.core.distributed import cpu_cores, use_cpu_devices
    from jaxfl.errors import ConfigError
    from jaxfl.run.script import check_at_least, check_output_file
    check_plan_item(args.plan)
    for flag, value in (("--devices", args.devices), ("--k", args.k), ("--calls", args.calls)):
        check_at_least(flag, value, 1)
    check_output_file(args.json, "--json")
    if args.devices > 1 and not use_cpu_devices(args.devices):
        raise ConfigError(f"--devices {args.devices}: this process can run at most {cpu_cores()} CPU devices "
                          f"(one per core it may use)")
    res = compare(args.plan, args.devices, args.k, args.calls, args.tails)
    res["command"] = "benchmarks/rows_buffer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{args.plan}, {args.devices} device(s), {args.k} round(s) a call, {args.calls} calls a side "
          f"({res['device']}, jax {res['jax']}): kept {res['kept']['median_s'] * 1e3:.2f} ms a round (median; mean "
          f"{res['kept']['mean_s'] * 1e3:.2f}), new {res['new']['median_s'] * 1e3:.2f} (mean "
          f"{res['new']['mean_s'] * 1e3:.2f}); new / kept {res['new_over_kept']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
