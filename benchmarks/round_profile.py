"""Where a whole round's time goes, operation by operation, grouped by how often each operation runs a round.

    taskset -c 0 python benchmarks/round_profile.py --plan fedavg_cnn_dir0.3:1000:50 --tails

FedAvg on a workload of ``throughput.py --small`` (synthetic samples, the workload's batch, one local epoch,
the stacked backend with ``map`` on one device; ``--tails``:
partial last batches at the eighths of B the clients' last batches take, as ``--tail-batches on``): one
compiling round, then ``--rounds`` rounds traced with ``jax.profiler``. The trace's operation events (XLA:CPU's
thunks) are summed by name and printed per round with their count a round, so that the work done once per
local step (count ~ the round's steps), once per client (count = the cohort) and once per round (count 1)
can be told apart; each operation's output shape and the model code it computes (the name scopes jax gives its
instructions, a fusion's counted over the instructions fused into it: ``step_profile.op_sources``) are read from
the compiled round.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def profile(plan: str, rounds: int, tails: bool) -> dict:
    import time

    import jax
    import optax
    from step_profile import op_shapes, op_sources, traced_ops
    from throughput import SMALL, small_population, workload_counts

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Stacked
    from jaxfl.core.cohort import client_map
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.models import build_model
    from jaxfl.run.build import tails_chosen

    name, n, cohort = plan.split(":")
    n, cohort, w = int(n), int(cohort), SMALL[name]
    counts = workload_counts(w, n)
    data = small_population(w, counts)
    trainer = LocalTrainer(optax.sgd(w["lr"]), w["batch"], 1, tail_log=[],
                           tail_sizes=tails_chosen("on", counts, w["batch"]) or None if tails else None)
    alg = build_algorithm("fedavg", build_model(w["model"], w["classes"]), trainer)
    sim = Stacked(alg, data, batch_size=w["batch"], clients=client_map("map"), cohort_size=cohort,
                  rounds_per_call=1, trainer=trainer)
    server, store = sim.init(jax.random.key(0), data.x[:1])
    root = jax.random.key(1)
    server, _ = sim.round(server, store, 0, root)  # compile
    jax.block_until_ready(server)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for r in range(rounds):
                server, _ = sim.round(server, store, r, root)
                jax.block_until_ready(server)
            wall = (time.perf_counter() - t0) / rounds  # (traced: the profiler's own cost included)
        total, count = traced_ops(trace_dir)
    # the compiled round's operation shapes and sources (``Stacked._round``, the one jitted call of a round, with
    # the rows' buffer the traced rounds were given: the same program)
    rows = sim.held_rows(server, store.state, sim.data, root)
    hlo = sim._round.lower(server, store.state, sim.data, 0, root, rows).compile()
    shapes, sources = op_shapes(hlo.as_text()), op_sources(hlo.as_text())
    ops = sorted(({"name": k, "shape": shapes.get(k, ""), "computes": sources.get(k, ""), "s_per_round": v / rounds,
                   "per_round": count[k] / rounds} for k, v in total.items()), key=lambda o: -o["s_per_round"])
    return {"plan": plan, "rounds": rounds, "tails": tails, "round_s": wall, "cohort": cohort,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "ops": ops}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="fedavg_cnn_dir0.3:1000:50", help="NAME:CLIENTS:COHORT (throughput.py --small)")
    p.add_argument("--rounds", type=int, default=3, help="rounds traced, after one compiling round")
    p.add_argument("--tails", action="store_true",
                   help="partial last batches at the eighths of B the population's last batches take")
    p.add_argument("--top", type=int, default=30, help="operations printed")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from throughput import check_plan_item

    from jaxfl.run.script import check_at_least, check_output_file
    check_plan_item(args.plan)
    check_at_least("--rounds", args.rounds, 1)
    check_output_file(args.json, "--json")
    res = profile(args.plan, args.rounds, args.tails)
    res["command"] = "benchmarks/round_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ms = lambda runs: sum(o["s_per_round"] for o in res["ops"] if o["per_round"] == runs) * 1e3  # noqa: E731
    print(f"{args.plan}: {res['round_s'] * 1e3:.0f} ms a round traced ({res['device']}, jax {res['jax']}); operations "
          f"run once a round: {ms(1):.0f} ms, once a client: {ms(res['cohort']):.0f} ms")
    print("| operation | output shape | runs a round | ms a round | computes (jax's scopes of its instructions) |\n"
          "|---|---|---|---|---|")
    for op in res["ops"][:args.top]:
        print(f"| {op['name']} | {op['shape']} | {op['per_round']:.1f} | {op['s_per_round'] * 1e3:.1f} | "
              f"{op['computes']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
