"""Round throughput of jaxfl's engine against the per-client loops that FL papers and simulators run.

Every workload is a population of clients with given sample counts (equal, or a Dirichlet label-skew
partition of 50,000 samples), synthetic uint8 images (speed does not depend on their content), FedAvg, one
local epoch, SGD. For the same sampled cohorts it times, after compilation (each round's shapes are compiled
in a first pass over the same rounds, then the rounds are timed):
  engine/<strategy>   jaxfl's ``Simulation.round`` (ragged data, buckets, per-client store) with the client
                      strategy map | vmap | chunked
  jax_loop            a jitted one-client local update called from a Python loop, each client padded to its
                      own step grid length, then a jitted aggregation (how FedJAX-style simulators run)
  torch_loop          the same round in PyTorch, client after client, each doing only its real steps (the
                      last batch partial), for the two plain CNNs (needs torch: the optional `bench` extra)
and reports real samples/s (real samples trained / round time), the ratios to the loops, the engine's
padded/real work, buckets and compiled shapes, and the peak resident memory of the process (each workload
runs in its own subprocess).

    python benchmarks/throughput.py --quick                       # equal workloads, a few minutes on CPU
    python benchmarks/throughput.py --skewed                      # Dirichlet 0.1/0.3/1 over 100 and 1,000 clients
    python benchmarks/throughput.py --population                  # FedAvg/FedBN at 1k/10k/100k clients, cohort 100
    python benchmarks/throughput.py --workloads fedavg_cnn --clients 4,16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

WORKLOADS = {
    # name: model, input shape, samples per client (equal clients), batch, client counts, cohort (None: all)
    "fedavg_cnn": dict(model="fedavg_cnn", shape=(28, 28, 1), per_client=320, batch=32, clients=[4, 16, 64, 256]),
    "cross_device": dict(model="pfl_cnn", shape=(28, 28, 1), per_client=50, batch=10, clients=[1000], cohort=50),
    "fedpick_digits": dict(model="digits_cnn", shape=(32, 32, 3), per_client=1000, batch=64, clients=[5],
                           algorithm="fedpick"),
    "vit_cohort": dict(model="vit_small", shape=(32, 32, 3), per_client=64, batch=32, clients=[50], cohort=5),
}
QUICK = {"fedavg_cnn": [4, 16], "cross_device": [1000], "vit_cohort": [50]}
# Label-skewed FedAvg CNN workloads: Dirichlet(alpha) over 50,000 samples; (clients, cohort) pairs.
SKEWED = dict(model="fedavg_cnn", shape=(28, 28, 1), samples=50_000, batch=32, alphas=(0.1, 0.3, 1.0),
              populations=((100, 20), (1000, 50)))
# Population sweep: tiny clients (10 synthetic 28x28 images), cohort 100, a BatchNorm model (small_cnn).
POPULATION = dict(model="small_cnn", shape=(28, 28, 1), per_client=10, batch=10, cohort=100,
                  clients=(1_000, 10_000, 100_000), algorithms=("fedavg", "fedbn"))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def make_population(counts, shape, seed=0):
    """RaggedClients with ``counts[i]`` random images of ``shape`` and labels in [0, 10) for client i."""
    import numpy as np

    from jaxfl.data.ragged import RaggedClients
    rng = np.random.default_rng(seed)
    total = int(sum(counts))
    x = rng.integers(0, 256, (total,) + tuple(shape), dtype=np.uint8)
    y = rng.integers(0, 10, total).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return RaggedClients(x, y, offsets, np.asarray(counts, np.int64))


def skewed_counts(alpha: float, n_clients: int, samples: int, seed: int = 0):
    """Client sizes of jaxfl's Dirichlet(alpha) label-skew partition of ``samples`` (10 balanced classes)."""
    import numpy as np

    from jaxfl.data.partition import dirichlet
    labels = np.repeat(np.arange(10), samples // 10)
    return np.array([len(p) for p in dirichlet(labels, n_clients, alpha, np.random.default_rng(seed))])


def measure(model_name, shape, counts, batch, cohort, strategies, rounds=2, algorithm="fedavg", torch=True,
            chunk_size=8) -> dict:
    """Time ``rounds`` rounds (the same cohorts for every runner) of each runner; see the module docstring."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxfl import build_algorithm
    from jaxfl.engine import LocalTrainer, RoundInfo, client_keys, sample_cohort
    from jaxfl.models import build_model
    from jaxfl.schedule import grid_ceil
    from jaxfl.simulation import Simulation

    data = make_population(counts, shape)
    n = len(counts)
    trainer = LocalTrainer(optax.sgd(0.01, momentum=0.5), batch, 1)
    alg = build_algorithm(algorithm, build_model(model_name, 10), trainer)
    root = jax.random.key(1)
    cohorts = [np.asarray(sample_cohort(root, r, n, cohort)) for r in range(rounds)]
    real = int(sum(data.counts[ids].sum() for ids in cohorts))
    out = {"model": model_name, "clients": n, "cohort": cohort, "batch": batch, "rounds": rounds,
           "real_samples_per_round": real / rounds, "max_over_mean": float(np.max(counts) / np.mean(counts)),
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__}
    for strategy in strategies:
        sim = Simulation(alg, data, batch_size=batch, strategy=strategy, chunk_size=chunk_size, cohort_size=cohort)
        server, store = sim.init(jax.random.key(0), data.x[:1])
        t = time.perf_counter()
        for r in range(rounds):  # compile every bucket shape of these cohorts
            server, m = sim.round(server, store, r, root)
        first = time.perf_counter() - t
        work = []
        t = time.perf_counter()
        for r in range(rounds):
            server, m = sim.round(server, store, r, root)
            work.append(m["padded_work"])
        jax.block_until_ready(server)
        sec = (time.perf_counter() - t) / rounds
        out[f"engine/{strategy}"] = {"round_s": sec, "samples_per_s": real / rounds / sec, "compile_s": first - sec * rounds,
                                     "padded_work": float(np.mean(work)), "buckets": int(m["buckets"]),
                                     "compiled_shapes": int(m["compiled_shapes"])}
        del store
    # a jitted one-client update in a Python loop, each client padded to its own grid length, then aggregation
    one, agg = jax.jit(alg.local_update), jax.jit(alg.aggregate)
    server, client = alg.init(jax.random.key(0), data.x[:1])

    def loop_round(r):
        ids = cohorts[r]
        keys = client_keys(root, r, jnp.asarray(ids))
        new = []
        for i, k in zip(ids, keys):
            d = data.gather(np.array([i]), grid_ceil(-(-int(data.counts[i]) // batch)) * batch)
            row = jax.tree_util.tree_map(lambda a: jnp.asarray(a[0]), d)
            new.append(one(server, client, row, k, RoundInfo(jnp.int32(r), jnp.int32(i)))[0])
        stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *new)
        info = RoundInfo(jnp.int32(r), jnp.asarray(ids, jnp.int32))
        return jax.block_until_ready(agg(server, stacked, jnp.asarray(data.counts[ids], jnp.float32), info))
    t = time.perf_counter()
    for r in range(rounds):
        loop_round(r)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for r in range(rounds):
        loop_round(r)
    sec = (time.perf_counter() - t) / rounds
    out["jax_loop"] = {"round_s": sec, "samples_per_s": real / rounds / sec, "compile_s": first - sec * rounds}
    if torch:
        res = torch_loop(model_name, shape, batch, [data.counts[ids] for ids in cohorts])
        if res:
            out["torch_loop"] = dict(res, samples_per_s=real / rounds / res["round_s"])
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def torch_model(model_name, shape):
    """The FedAvg CNN / pfl_cnn in PyTorch (None for other models or without torch)."""
    try:
        import torch.nn as tnn
    except ImportError:
        return None
    if model_name not in ("fedavg_cnn", "pfl_cnn"):
        return None
    k, pool = (5, [0, 1]) if model_name == "fedavg_cnn" else (3, [1])
    hidden = 512 if model_name == "fedavg_cnn" else 128
    layers, c, side = [], shape[-1], shape[0]
    for i, width in enumerate((32, 64)):
        layers += [tnn.Conv2d(c, width, k, padding=k // 2), tnn.ReLU()]
        if i in pool:
            layers.append(tnn.MaxPool2d(2))
            side //= 2
        c = width
    layers += [tnn.Flatten(), tnn.Linear(c * side * side, hidden), tnn.ReLU(), tnn.Linear(hidden, 10)]
    return tnn.Sequential(*layers)


def torch_loop(model_name, shape, batch, cohort_counts) -> dict | None:
    """Rounds in PyTorch (on CUDA if available): client after client, each doing only its real steps (the
    last batch partial), then the mean of the states. Returns the median round time over the rounds, after
    one untimed pass over the same rounds."""
    model = torch_model(model_name, shape)
    if model is None:
        return None
    import torch
    import torch.nn as tnn
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(dev)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}

    def round_(counts):
        states = []
        for n in counts:
            x = torch.rand(int(n), shape[-1], *shape[:2], device=dev)
            y = torch.randint(0, 10, (int(n),), device=dev)
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
            for s in range(0, int(n), batch):
                opt.zero_grad()
                tnn.functional.cross_entropy(model(x[s:s + batch]), y[s:s + batch]).backward()
                opt.step()
            states.append({k: v.clone() for k, v in model.state_dict().items()})
        w = torch.tensor([float(n) for n in counts], device=dev)
        for k in global_state:
            global_state[k] = torch.tensordot(w / w.sum(), torch.stack([s[k] for s in states]), 1)
        if dev == "cuda":
            torch.cuda.synchronize()
    for counts in cohort_counts:
        round_(counts)
    t = time.perf_counter()
    for counts in cohort_counts:
        round_(counts)
    return {"round_s": (time.perf_counter() - t) / len(cohort_counts), "compile_s": 0.0, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "torch_device": dev}


def population(algorithm: str, n_clients: int, rounds: int = 3) -> dict:
    """Round time and peak RSS of ``algorithm`` over ``n_clients`` tiny clients, cohort POPULATION['cohort']."""
    import jax
    import numpy as np
    import optax

    from jaxfl import build_algorithm
    from jaxfl.engine import LocalTrainer
    from jaxfl.models import build_model
    from jaxfl.simulation import Simulation
    from jaxfl.trees import tree_bytes

    p = POPULATION
    data = make_population(np.full(n_clients, p["per_client"]), p["shape"])
    alg = build_algorithm(algorithm, build_model(p["model"], 10), LocalTrainer(optax.sgd(0.01), p["batch"], 1))
    sim = Simulation(alg, data, batch_size=p["batch"], strategy="map", cohort_size=p["cohort"])
    server, store = sim.init(jax.random.key(0), data.x[:1])
    root = jax.random.key(1)
    t = time.perf_counter()
    server, _ = sim.round(server, store, 0, root)
    first = time.perf_counter() - t
    times = []
    for r in range(1, rounds + 1):
        t = time.perf_counter()
        server, _ = sim.round(server, store, r, root)
        jax.block_until_ready(server)
        times.append(time.perf_counter() - t)
    return {"algorithm": algorithm, "clients": n_clients, "cohort": p["cohort"], "model": p["model"],
            "round_s": float(np.median(times)), "first_round_s": first, "store_gb": tree_bytes(store.state) / 2 ** 30,
            "store_placement": store.placement, "data_gb": data.nbytes / 2 ** 30, "peak_rss_gb": peak_rss_gb(),
            "backend": jax.default_backend()}


def report(results: list[dict]) -> str:
    lines = ["| workload | clients (cohort) | max/mean size | runner | real samples/s | x torch | x jax_loop | "
             "padded/real | buckets (shapes) | round s | peak RSS GB |", "|---" * 11 + "|"]
    for r in results:
        base_j = r["jax_loop"]["samples_per_s"]
        base_t = r.get("torch_loop", {}).get("samples_per_s")
        for runner in [k for k in r if k.startswith("engine/")] + ["jax_loop", "torch_loop"]:
            if runner not in r:
                continue
            v = r[runner]
            work = f"{v['padded_work']:.3f}" if "padded_work" in v else "-"
            shapes = f"{v['buckets']} ({v['compiled_shapes']})" if "buckets" in v else "-"
            xt = f"{v['samples_per_s'] / base_t:.2f}" if base_t else "-"
            lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | {r['max_over_mean']:.1f} | {runner} | "
                         f"{v['samples_per_s']:.0f} | {xt} | {v['samples_per_s'] / base_j:.2f} | {work} | {shapes} | "
                         f"{v['round_s']:.3f} | {r['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def population_report(results: list[dict]) -> str:
    lines = ["| algorithm | clients | cohort | round s (median) | first round s | store GB | data GB | peak RSS GB |",
             "|---" * 8 + "|"]
    for r in results:
        lines.append(f"| {r['algorithm']} | {r['clients']} | {r['cohort']} | {r['round_s']:.3f} | "
                     f"{r['first_round_s']:.1f} | {r['store_gb']:.4f} ({r['store_placement']}) | {r['data_gb']:.2f} | "
                     f"{r['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def run_one(spec: str, strategies, rounds) -> dict:
    """One workload, in this process: ``equal:NAME:CLIENTS[:COHORT]``, ``skewed:ALPHA:CLIENTS:COHORT[:SAMPLES]``
    or ``population:ALGORITHM:CLIENTS``."""
    import numpy as np
    kind, *rest = spec.split(":")
    if kind == "population":
        return population(rest[0], int(rest[1]))
    if kind == "skewed":
        alpha, n, cohort = float(rest[0]), int(rest[1]), int(rest[2])
        s = SKEWED
        samples = int(rest[3]) if len(rest) > 3 else s["samples"]
        res = measure(s["model"], s["shape"], skewed_counts(alpha, n, samples), s["batch"], cohort,
                      strategies, rounds)
        return dict(res, workload=f"dirichlet {alpha}")
    name, n = rest[0], int(rest[1])
    w = WORKLOADS[name]
    cohort = int(rest[2]) if len(rest) > 2 else w.get("cohort") or n
    res = measure(w["model"], w["shape"], np.full(n, w["per_client"]), w["batch"], min(cohort, n),
                  strategies, rounds, algorithm=w.get("algorithm", "fedavg"))
    return dict(res, workload=name)


def subprocess_run(spec: str, strategies: str, rounds: int, env=None, timeout=None) -> dict | None:
    """``run_one(spec)`` in a fresh process (its own peak RSS); None (and its stderr printed) if it failed."""
    cmd = [sys.executable, __file__, "--one", spec, "--strategies", strategies, "--rounds", str(rounds)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{spec} timed out after {timeout} s", file=sys.stderr)
        return None
    if proc.returncode:
        print(f"{spec} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fedavg_cnn at 4 and 16 clients, cross_device, vit_cohort")
    p.add_argument("--skewed", action="store_true", help="the Dirichlet label-skew workloads (SKEWED)")
    p.add_argument("--alphas", default=None, help="with --skewed: comma-separated alphas (default 0.1,0.3,1.0)")
    p.add_argument("--population", action="store_true", help="the population sweep (POPULATION)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--clients", default=None, help="comma-separated client counts (default: the workload's)")
    p.add_argument("--strategies", default="map,vmap,chunked")
    p.add_argument("--rounds", type=int, default=2, help="rounds timed (after one pass that compiles them)")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one workload in a subprocess
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.strategies.split(","), args.rounds)))
        return
    if args.population:
        specs = [f"population:{a}:{n}" for a in POPULATION["algorithms"] for n in
                 ([int(c) for c in args.clients.split(",")] if args.clients else POPULATION["clients"])]
    elif args.skewed:
        alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else SKEWED["alphas"]
        specs = [f"skewed:{a}:{n}:{c}" for n, c in SKEWED["populations"] for a in alphas]
    else:
        plan = QUICK if args.quick else {k: WORKLOADS[k]["clients"] for k in args.workloads.split(",")}
        specs = [f"equal:{name}:{n}" for name, counts in plan.items()
                 for n in ([int(c) for c in args.clients.split(",")] if args.clients else counts)]
    results = []
    fmt = population_report if args.population else report
    for spec in specs:
        res = subprocess_run(spec, args.strategies, args.rounds)
        if res is not None:
            results.append(res)
            print("\n".join(fmt(results[-1:]).splitlines()[2:]), flush=True)
    print("\n" + fmt(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
