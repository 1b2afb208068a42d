"""Round throughput of jaxfl's engine against the per-client loops that FL papers and simulators run.

For each workload (synthetic uint8 images; speed does not depend on their content) it times one federated
round, after compilation, of:
  engine/<strategy>   jaxfl's jitted round (make_round) with the client strategy vmap | map | chunked
  jax_loop            a jitted one-client local update called from a Python loop, then a jitted aggregation
                      (how FedJAX-style simulators run clients)
  torch_loop          the same round in PyTorch, one client after another (only if torch is installed: the
                      optional `bench` extra)
and prints samples/s (cohort x local steps x batch / round time), the ratio to the loops, compile time,
achieved FLOP/s (XLA's cost analysis of the round / round time) as a fraction of this machine's measured
f32 matmul peak, and the peak resident memory of the process running the workload (each workload runs in
its own subprocess).

    python benchmarks/throughput.py --quick          # a few minutes on a 2-core CPU
    python benchmarks/throughput.py --workloads fedavg_cnn --clients 4,16,64,256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

WORKLOADS = {
    # name: model, input shape, samples per client, batch, cohort (None: all), clients list, algorithm
    "fedavg_cnn": dict(model="fedavg_cnn", shape=(28, 28, 1), per_client=320, batch=32, clients=[4, 16, 64, 256]),
    "cross_device": dict(model="pfl_cnn", shape=(28, 28, 1), per_client=50, batch=10, clients=[1000], cohort=50),
    "fedpick_digits": dict(model="digits_cnn", shape=(32, 32, 3), per_client=1000, batch=64, clients=[5],
                           algorithm="fedpick"),
    "vit_cohort": dict(model="vit_small", shape=(32, 32, 3), per_client=64, batch=32, clients=[50], cohort=5),
}
QUICK = {"fedavg_cnn": [4, 16], "cross_device": [1000], "vit_cohort": [50]}


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Measured f32 FLOP/s of a jitted n x n matmul on the default device."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def timed(fn, reps):
    """(seconds of the first call, median seconds of ``reps`` further calls); fn() must block."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, sorted(times)[len(times) // 2]


def run_workload(name: str, n_clients: int, strategies: list[str], reps: int) -> dict:
    import jax
    import numpy as np
    import optax

    from jaxfl import build_algorithm, init_state, make_round
    from jaxfl.engine import ClientData, LocalTrainer
    from jaxfl.models import build_model

    w = WORKLOADS[name]
    cohort = min(w.get("cohort") or n_clients, n_clients)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n_clients, w["per_client"]) + w["shape"], dtype=np.uint8)
    y = rng.integers(0, 10, (n_clients, w["per_client"])).astype(np.int32)
    data = ClientData(jax.numpy.asarray(x), jax.numpy.asarray(y), jax.numpy.full((n_clients,), w["per_client"]))
    steps = -(-w["per_client"] // w["batch"])
    trainer = LocalTrainer(optax.sgd(0.01, momentum=0.5), w["batch"], 1)
    alg = build_algorithm(w.get("algorithm", "fedavg"), build_model(w["model"], 10), trainer)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], n_clients)
    samples = cohort * steps * w["batch"]
    root = jax.random.key(1)
    out = {"workload": name, "clients": n_clients, "cohort": cohort, "samples_per_round": samples,
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__}
    # FLOPs of one local step (forward + backward + update of one batch), from XLA's cost analysis; a round
    # does cohort x steps of them (cost analysis of the whole round counts a loop body once, so it is not used)
    step_flops = local_step_flops(alg, server, clients, data)
    out["flops_per_round"] = step_flops * cohort * steps
    for strategy in strategies:
        t = time.perf_counter()
        fn = jax.jit(make_round(alg, strategy=strategy, cohort_size=cohort), donate_argnums=(0, 1))
        compiled = fn.lower(server, clients, data, 0, root).compile()
        compile_s = time.perf_counter() - t
        state = [init_state(alg, jax.random.key(0), data.x[0], n_clients)]

        def call():  # donated buffers: the state is carried from round to round, as the runner does
            s, c, _ = compiled(*state[0], data, 0, root)
            state[0] = jax.block_until_ready((s, c))
        _, sec = timed(call, reps)
        del state
        out[f"engine/{strategy}"] = {"round_s": sec, "samples_per_s": samples / sec, "compile_s": compile_s}
    # a jitted one-client update in a Python loop over the cohort, then a jitted aggregation
    one = jax.jit(alg.local_update)
    agg = jax.jit(alg.aggregate)
    rows = [jax.tree_util.tree_map(lambda a, i=i: a[i], (clients, data)) for i in range(cohort)]
    keys = [jax.random.fold_in(root, i) for i in range(cohort)]

    def loop():
        new = [one(server, c, d, k)[0] for (c, d), k in zip(rows, keys)]
        stacked = jax.tree_util.tree_map(lambda *a: jax.numpy.stack(a), *new)
        return jax.block_until_ready(agg(server, stacked, jax.numpy.full((cohort,), float(w["per_client"]))))
    first, sec = timed(loop, reps)
    out["jax_loop"] = {"round_s": sec, "samples_per_s": samples / sec, "compile_s": first - sec}  # 1st call - steady
    torch_result = torch_loop(w, cohort, steps, reps)
    if torch_result:
        out["torch_loop"] = dict(torch_result, samples_per_s=samples / torch_result["round_s"])
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    out["matmul_peak_flops"] = matmul_peak()
    return out


def local_step_flops(alg, server, clients, data) -> float:
    """FLOPs of one minibatch step of one client with the algorithm's own loss: XLA's cost analysis of
    ``local_update``, which counts the body of each loop (epochs, steps) once. For the FedAvg CNN it gives
    2.36 GFLOP per batch of 32 = 3 x 24.5 MFLOP forward per sample (conv 1.25 + 20.1, dense 3.2)."""
    import jax
    row = jax.tree_util.tree_map(lambda a: a[0], (clients, data))
    cost = jax.jit(alg.local_update).lower(server, *row, jax.random.key(0)).compile().cost_analysis() or {}
    return float(cost.get("flops", float("nan")))


def torch_loop(w: dict, cohort: int, steps: int, reps: int) -> dict | None:
    """The round in PyTorch, client after client (fedavg_cnn / pfl_cnn only); None without torch."""
    try:
        import torch
        import torch.nn as tnn
    except ImportError:
        return None
    if w["model"] not in ("fedavg_cnn", "pfl_cnn"):
        return None
    k, pool = (5, [0, 1]) if w["model"] == "fedavg_cnn" else (3, [1])
    hidden = 512 if w["model"] == "fedavg_cnn" else 128
    layers, c, side = [], w["shape"][-1], w["shape"][0]
    for i, width in enumerate((32, 64)):
        layers += [tnn.Conv2d(c, width, k, padding=k // 2), tnn.ReLU()]
        if i in pool:
            layers.append(tnn.MaxPool2d(2))
            side //= 2
        c = width
    layers += [tnn.Flatten(), tnn.Linear(c * side * side, hidden), tnn.ReLU(), tnn.Linear(hidden, 10)]
    model = tnn.Sequential(*layers)
    x = torch.rand(cohort, steps * w["batch"], w["shape"][-1], *w["shape"][:2])
    y = torch.randint(0, 10, (cohort, steps * w["batch"]))
    global_state = {k2: v.clone() for k2, v in model.state_dict().items()}

    def round_():
        states = []
        for i in range(cohort):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
            for s in range(steps):
                sl = slice(s * w["batch"], (s + 1) * w["batch"])
                opt.zero_grad()
                tnn.functional.cross_entropy(model(x[i, sl]), y[i, sl]).backward()
                opt.step()
            states.append({k2: v.clone() for k2, v in model.state_dict().items()})
        for k2 in global_state:
            global_state[k2] = torch.stack([s[k2] for s in states]).mean(0)
    first, sec = timed(round_, reps)
    return {"round_s": sec, "compile_s": 0.0, "torch": torch.__version__, "threads": torch.get_num_threads()}


def report(results: list[dict]) -> str:
    lines = ["| workload | clients (cohort) | runner | samples/s | x jax_loop | x torch_loop | round s | compile s "
             "| FLOP/s / matmul peak | peak RSS GB |", "|---" * 10 + "|"]
    for r in results:
        base_j = r["jax_loop"]["samples_per_s"]
        base_t = r.get("torch_loop", {}).get("samples_per_s")
        for runner in [k for k in r if k.startswith("engine/")] + ["jax_loop", "torch_loop"]:
            if runner not in r:
                continue
            v = r[runner]
            frac = r["flops_per_round"] / v["round_s"] / r["matmul_peak_flops"]
            lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | {runner} | {v['samples_per_s']:.0f} | "
                         f"{v['samples_per_s'] / base_j:.2f} | "
                         f"{(v['samples_per_s'] / base_t) if base_t else float('nan'):.2f} | {v['round_s']:.3f} | "
                         f"{v['compile_s']:.1f} | {frac:.3f} | {r['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fedavg_cnn at 4 and 16 clients, cross_device, vit_cohort")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--clients", default=None, help="comma-separated client counts (default: the workload's)")
    p.add_argument("--strategies", default="map,vmap,chunked")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: name:clients in a subprocess
    args = p.parse_args(argv)
    strategies = args.strategies.split(",")
    if args.one:
        name, n = args.one.split(":")
        print(json.dumps(run_workload(name, int(n), strategies, args.reps)))
        return
    plan = QUICK if args.quick else {k: WORKLOADS[k]["clients"] for k in args.workloads.split(",")}
    results = []
    for name, counts in plan.items():
        for n in ([int(c) for c in args.clients.split(",")] if args.clients else counts):
            cmd = [sys.executable, __file__, "--one", f"{name}:{n}", "--strategies", args.strategies,
                   "--reps", str(args.reps)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"{name} at {n} clients failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print("\n".join(report(results[-1:]).splitlines()[2:]), flush=True)
    print("\n" + report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
