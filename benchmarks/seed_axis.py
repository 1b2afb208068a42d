"""Seeds on an array axis: does one jitted round over S seeds (``vmap`` over a leading seed axis of the server
state, the client states, the data and the PRNG root) beat S jitted rounds, one per seed?

A lead for ``jaxfl run --seeds`` (a sweep runs its seeds one after another): if a round over S seeds costs less
than S rounds, small-model sweeps would gain the way the cohort axis gains. Each seed has its own population
(in ``jaxfl run`` the seed also draws the partition): here its own log-normal client sizes and samples
(``throughput.small_population``), padded to the longest seed's store; the round is ``Stacked``'s (cohort draw,
gather of the cohort's rows, ``make_step``, write-back), FedAvg, one local epoch. Under ``vmap`` a client's
step loop runs until the same client of every seed is done, so unequal partitions cost the longest seed's steps
(``--equal-sizes`` gives every seed the same sizes, the best case). Prints one line per configuration and writes
``--out`` (JSON): seconds per round of all S seeds for both paths, each path's roofline (``roofline.py``: the
real samples' FLOP/s and bytes/s against the machine's measured peaks), and the largest difference of the final
server parameters between them (the same numbers up to float reassociation).

    python benchmarks/seed_axis.py --workload logreg --clients 1000 --cohort 100 --seeds 3 --strategy map
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import roofline  # noqa: E402
from throughput import SMALL, lognormal_counts, small_population  # noqa: E402

from jaxfl.algorithms import build_algorithm  # noqa: E402
from jaxfl.core.backends import client_rows  # noqa: E402
from jaxfl.core.buckets import grid_ceil  # noqa: E402
from jaxfl.core.cohort import STRATEGIES, default_strategy, sample_cohort  # noqa: E402
from jaxfl.core.step import init_state, make_step  # noqa: E402
from jaxfl.core.trainer import LocalTrainer  # noqa: E402
from jaxfl.models import build_model  # noqa: E402
from jaxfl.run.script import check_at_least, parse_list, run_script  # noqa: E402


def stack(trees):
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


def measure(workload: str, n: int, cohort: int, seeds: int, strategy: str, rounds: int, equal: bool) -> dict:
    w = dict(SMALL[workload])
    batch = w["batch"]
    alg_model = build_model(w["model"], w["classes"])
    alg = build_algorithm("fedavg", alg_model, LocalTrainer(optax.sgd(w["lr"]), batch, 1))
    pops = [small_population(w, lognormal_counts(n, w["median"], w["sigma"], seed=0 if equal else s))
            for s in range(seeds)]
    step = make_step(alg, clients=strategy)
    length = batch * grid_ceil(-(-max(int(p.counts.max()) for p in pops) // batch))
    total = max(len(p.y) for p in pops)

    def place(p):  # the flat store padded to the longest seed's (rows past a seed's own are never read)
        pad = total - len(p.y)
        x = np.concatenate([p.x, np.zeros((pad,) + p.x.shape[1:], p.x.dtype)])
        y = np.concatenate([p.y, np.zeros(pad, p.y.dtype)])
        return tuple(jnp.asarray(a) for a in (x, y, p.offsets.astype(np.int32), p.counts.astype(np.int32)))

    def round_fn(server, states, data, r, root):  # Stacked's round: draw, gather, train and aggregate, write back
        ids = sample_cohort(root, r, n, cohort).astype(jnp.int32)
        clients = jax.tree_util.tree_map(lambda a: a[ids], states)
        server, kept, metrics = step(server, clients, client_rows(data, ids, length), ids, r, root)
        return server, jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b), states, kept), metrics["loss"]

    one = jax.jit(round_fn)
    many = jax.jit(jax.vmap(round_fn, in_axes=(0, 0, 0, None, 0)))
    inits = [init_state(alg, jax.random.key(s), pops[s].x[:1], n) for s in range(seeds)]
    roots = [jax.random.key(100 + s) for s in range(seeds)]
    data = [place(p) for p in pops]

    def sequential():
        states = [list(i) for i in inits]
        t = None
        for r in range(rounds + 1):  # round 0 compiles
            for s in range(seeds):
                states[s][0], states[s][1], _ = one(states[s][0], states[s][1], data[s], r, roots[s])
            if r == 0:
                jax.block_until_ready([st[0] for st in states])
                t = time.perf_counter()
        jax.block_until_ready([st[0] for st in states])
        return (time.perf_counter() - t) / rounds, [st[0] for st in states]

    def vectorized():
        server, states, vdata, vroots = stack([i[0] for i in inits]), stack([i[1] for i in inits]), stack(data), \
            jnp.stack(roots)
        t = None
        for r in range(rounds + 1):
            server, states, _ = many(server, states, vdata, r, vroots)
            if r == 0:
                jax.block_until_ready(server)
                t = time.perf_counter()
        jax.block_until_ready(server)
        return (time.perf_counter() - t) / rounds, server

    seq_s, seq_servers = sequential()
    vec_s, vec_server = vectorized()
    # the roofline: the S seeds' real samples of a timed round (rounds 1..rounds) under one step's XLA cost
    real = sum(int(pops[s].counts[np.asarray(sample_cohort(roots[s], r, n, cohort))].sum())
               for s in range(seeds) for r in range(1, rounds + 1)) / rounds
    cost, peaks = roofline.train_step_cost(alg_model, pops[0].x[:1], batch, w["lr"]), roofline.machine_peaks()
    diff = max(float(jnp.max(jnp.abs(a - b))) for s in range(seeds) for a, b in zip(
        jax.tree_util.tree_leaves(seq_servers[s]), jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda v: v[s], vec_server))))
    return {"workload": workload, "clients": n, "cohort": cohort, "seeds": seeds, "strategy": strategy,
            "equal_sizes": equal, "rounds_timed": rounds, "sequential_s": seq_s, "vectorized_s": vec_s,
            "speedup": seq_s / vec_s, "max_param_diff": diff, "real_samples_per_round": real,
            "train_step_cost": cost, **peaks,
            "sequential_roofline": roofline.roofline(real / seq_s, cost, peaks),
            "vectorized_roofline": roofline.roofline(real / vec_s, cost, peaks),
            "device": jax.devices()[0].device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="logreg", help=f"comma-separated, of {', '.join(SMALL)}")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--cohort", type=int, default=100)
    p.add_argument("--seeds", default="3", help="comma-separated seed counts S")
    p.add_argument("--strategy", default=None, help="comma-separated: map, vmap, chunked (default: the platform's)")
    p.add_argument("--rounds", type=int, default=10, help="rounds timed (after one compiling round)")
    p.add_argument("--equal-sizes", action="store_true", help="every seed's population has the same client sizes")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    workloads = parse_list(args.workload, "--workload", choices=tuple(SMALL))
    strategies = parse_list(args.strategy or default_strategy(), "--strategy", choices=STRATEGIES)
    seed_counts = parse_list(args.seeds, "--seeds", int)
    check_at_least("--seeds", seed_counts, 1)
    for flag, value in (("--clients", args.clients), ("--cohort", args.cohort), ("--rounds", args.rounds)):
        check_at_least(flag, value, 1)
    results = []
    for workload in workloads:
        for strategy in strategies:
            for s in seed_counts:
                r = measure(workload, args.clients, args.cohort, s, strategy, args.rounds, args.equal_sizes)
                results.append(r)
                print(f"{workload} N={r['clients']} C={r['cohort']} S={s} {strategy}"
                      f"{' equal sizes' if r['equal_sizes'] else ''} ({r['device']}): {s} rounds one after "
                      f"another {r['sequential_s'] * 1e3:.1f} ms, one round over the seed axis "
                      f"{r['vectorized_s'] * 1e3:.1f} ms: {r['speedup']:.2f}x; FLOP/s / peak "
                      f"{r['sequential_roofline']['flops_fraction']:.3f} and "
                      f"{r['vectorized_roofline']['flops_fraction']:.3f}; largest parameter difference "
                      f"{r['max_param_diff']:.1e}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    raise SystemExit(run_script(main))
