"""The GPU benchmark suite in one command (needs jax with CUDA; torch on CUDA for the torch rows; no network,
nothing to install). Runs, each workload in its own process, the engine (strategies vmap / chunked / map), a
jitted per-client loop and a PyTorch loop on the same GPU, for cohorts from 10 to 1,000 on equal and on
Dirichlet-skewed clients (``throughput.measure``), then writes ``results.json``, ``results.md`` and
``round_time.png`` (round time against cohort size) into ``--out``. Workloads left when ``--budget-s`` is
spent are skipped and listed as such.

    python benchmarks/gpu_suite.py --out gpu_results          # about 9 minutes on one H100
    python benchmarks/gpu_suite.py --out /tmp/smoke --smoke   # any machine, checks the plumbing: 8 min on
                                                              # the 2-core CPU box under load, no budget
    python benchmarks/gpu_suite.py --project --out DIR        # no GPU: the H100 projection of every workload
                                                              # (projection.json / .md; compiles only)
    python benchmarks/gpu_suite.py --out DIR --skip-done benchmarks/results
                                                              # only the workloads no earlier run measured
    python benchmarks/gpu_suite.py --out DIR --lanes          # the lane-plan table against one vmap and
                                                              # the vectorized torch baseline

A workload whose runner fails (e.g. out of GPU memory) keeps its other runners' figures; the failure is a row of
the table. Every workload has been measured on an H200 (2026-11-26 and 2026-11-27,
``benchmarks/results/gpu_h200_*``), so ``--skip-done benchmarks/results`` goes straight to the parts after them
(``extra_parts``), skipping those an earlier run measured too: with the budget left and MNIST under
``$JAXFL_DATA_DIR/digits``, ``benchmarks/backend_choice.py`` (into ``DIR/choice``: does ``jaxfl run`` pick the
faster data backend on that device?), ``benchmarks/seed_axis.py`` (``DIR/seed_axis.json``: does a round over a
seed axis beat one round per seed?), both measured on the H200 on 2026-11-27, then
``benchmarks/time_to_accuracy.py`` with the torch loop on the GPU too (``DIR/time_to_accuracy_gpu.{json,md}``).
The workloads' processes import jaxfl from this checkout.

The small-model workloads (``small:...``) run the engine vmapped (one round per call and 10 rounds per
call, ``Stacked``), the ragged engine's vmap buckets and the two loops (``GPU_SMALL_RUNNERS``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
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
# small models: LEAF-like log-normal clients (throughput.SMALL), the cohort sweep on logreg; first,
# so that the budget never skips them
SUITE = [("small:logreg:10000:10", 10), ("small:logreg:10000:100", 100), ("small:logreg:10000:1000", 1000),
          ("small:2nn:10000:1000", 1000), ("small:femnist_cnn:1000:100", 100),
          ("small:char_lstm:1000:100", 100)] + SUITE
SMOKE = [("skewed:0.3:40:4:1000", 4), ("skewed:0.3:40:8:1000", 8), ("xdev:8", 8), ("small:logreg:40:8", 8)]
# the runners of the small workloads on a GPU: the engine vmapped (one call per round, and 10 rounds per call),
# the streamed and ragged engines (the cohort sent each round: one call; buckets), the per-client loops
GPU_SMALL_RUNNERS = "stacked/vmap/K1,stacked/vmap/K10,streamed/vmap,ragged/vmap,jax_loop,torch_loop"
# --lanes: the padding table (log-normal clients, median 60, sigma 0.8): one vmap over the cohort (/S0) against
# the lane plan (one and 10 rounds per call) and the vectorized torch baseline
# (the rows the H200 table at b65f0a4 lacks first, so that a short lease measures them: the FEMNIST CNN with the
# per-model step overhead, the label-skewed FedAvg CNN at B = 10 (also under map, its fastest runner on the GPU
# before lane plans), the small models at cohort 100; then cohort 1,000 again. The torch loop is left out: the
# earlier GPU tables have it, and at cohort 1,000 it alone costs tens of seconds)
LANES_SUITE = [("small:femnist_cnn:1000:100", 100), ("small:fedavg_cnn_dir0.3_b10:1000:100", 100),
               ("small:2nn:1000:100", 100), ("small:logreg:1000:100", 100),
               ("small:2nn:1000:1000", 1000), ("small:logreg:1000:1000", 1000)]
LANES_EXTRA_RUNNERS = {"small:fedavg_cnn_dir0.3_b10:1000:100": "stacked/map/K1"}
# (the streamed and ragged backends, slower than the plan on all three workloads of the b65f0a4 table and 40-60 s
# of compiling each on the CNN, are left out; `throughput.py --runners` runs them)
LANES_RUNNERS = "stacked/vmap/K1/S0,stacked/vmap/K1,stacked/vmap/K10,torch_vmap"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json, results.md, round_time.png")
    p.add_argument("--strategies", default="vmap,chunked,map")
    p.add_argument("--rounds", type=int, default=1, help="rounds timed per runner (after one compiling pass)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip workloads once this much time is spent (default 540; none with --smoke)")
    p.add_argument("--smoke", action="store_true", help="two tiny workloads, to check the suite runs")
    p.add_argument("--skip-done", default=None, metavar="DIR",
                   help="skip the workloads some results.json under DIR already measured")
    p.add_argument("--lanes", action="store_true",
                   help="only the lane-plan table (LANES_SUITE: logreg, 2NN at cohorts 100 and 1,000, the FEMNIST "
                        "CNN at 100; log-normal clients, median 60, sigma 0.8) with LANES_RUNNERS")
    p.add_argument("--project", action="store_true",
                   help="no GPU needed: XLA's flop / byte / kernel counts per round of every SUITE workload and the "
                        "H100 round time they imply (a projection; see project_workload)")
    args = p.parse_args(argv)
    from jaxfl.core.cohort import STRATEGIES
    from jaxfl.run.script import check_at_least, parse_list
    parse_list(args.strategies, "--strategies", choices=STRATEGIES)
    check_at_least("--rounds", args.rounds, 1)
    check_at_least("--budget-s", args.budget_s, 0)
    if args.project:
        return project_main(args)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.smoke else 540.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # jax and torch share the GPU; the workloads' processes import jaxfl from this checkout (nothing installed)
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    start, results, skipped = time.perf_counter(), [], []
    done = measured_keys(Path(args.skip_done)) if args.skip_done else set()
    for spec, cohort in (SMOKE if args.smoke else LANES_SUITE if args.lanes else SUITE):
        if spec_key(spec) in done and not args.lanes:
            continue
        left = budget - (time.perf_counter() - start)
        if left < 20:
            skipped.append(spec)
            continue
        extra = ["--runners", GPU_SMALL_RUNNERS, "--k", "10"] if spec.startswith("small:") else []
        if args.lanes:
            runners = ",".join(filter(None, (LANES_RUNNERS, LANES_EXTRA_RUNNERS.get(spec))))
            extra = ["--runners", runners, "--k", "10", "--median", "60", "--sigma", "0.8"]
        res = throughput.subprocess_run(_expand(spec, args.smoke), args.strategies, args.rounds, env=env,
                                        timeout=None if left == float("inf") else left, extra=extra)
        if res is None:
            skipped.append(spec)
            continue
        res["suite_cohort"], res["suite_spec"] = cohort, spec
        results.append(res)
        print("\n".join(throughput.report(results[-1:]).splitlines()[2:]), flush=True)
    skip_dir = Path(args.skip_done) if args.skip_done else None
    for name, output, command in ([] if args.smoke or args.lanes else extra_parts(out)):
        left = budget - (time.perf_counter() - start)
        if skip_dir is not None and any(skip_dir.rglob(Path(output).name)):
            continue  # an earlier GPU run measured it
        if left < 60 or (name != "seed_axis" and not mnist_available()):
            skipped.append(f"{name} (no budget left, or no MNIST under $JAXFL_DATA_DIR/digits)")
            continue
        budget_args = ["--budget-s", str(left - 60)] if name == "backend_choice" else []  # keeps what it measured
        try:
            subprocess.run([sys.executable, *command, *budget_args], env=env, timeout=left - 30, check=False)
        except subprocess.TimeoutExpired:
            skipped.append(f"{name} (out of budget)")
    elapsed = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps({"results": results, "skipped": skipped, "elapsed_s": elapsed},
                                                 indent=1))
    device = results[0]["device"] if results else "none"
    md = [f"Device: {device}; backend {results[0]['backend'] if results else '-'}; "
          f"jax {results[0]['jax'] if results else '-'}; suite time {elapsed:.0f} s; "
          f"command: python benchmarks/gpu_suite.py {' '.join(argv if argv is not None else sys.argv[1:])}", "",
          throughput.report([r for r in results if "mean_size" not in r]), "",
          throughput.small_report([r for r in results if "mean_size" in r])]
    if skipped:
        md += ["", f"Skipped (budget or failure): {', '.join(skipped)}"]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plot(results, out / "round_time.png")


# --- the GPU projection (no GPU needed) -----------------------------------------------------------------------
# Assumed H100 SXM5 80 GB figures (NVIDIA H100 datasheet; e.g. glennklockwood.com/garden/processors/h100):
# FP32 (non-tensor) 66.9 TFLOP/s, TF32 tensor 494.7 TFLOP/s dense, HBM3 3.35 TB/s; kernel launch ~5 us (host-side
# launch overhead of 4-6 us per kernel measured by e.g. susun-blog.com/blog/pegainfer-3-cuda-graph; NVIDIA's
# "Getting Started with CUDA Graphs" blog describes the same per-kernel overhead).
H100 = dict(peak_flops=66.9e12, tf32_flops=494.7e12, hbm_bytes_per_s=3.35e12, launch_s=5e-6)
SKIP_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
            "replica-id", "opt-barrier"}


def extra_parts(out: Path) -> list[tuple[str, str, list[str]]]:
    """The suite's parts after the throughput workloads, in order: (name, output file, script and arguments).
    ``--skip-done DIR`` skips a part whose output file's name is somewhere under DIR."""
    here = Path(__file__).parent
    return [
        # does `jaxfl run` pick the faster backend here? (~6 min on an H200; measured 2026-11-27)
        ("backend_choice", str(out / "choice" / "backend_choice.json"),
         [str(here / "backend_choice.py"), "--out", str(out / "choice")]),
        # a lead for `jaxfl run --seeds`: one round over a seed axis against S rounds (measured on the H200, 2026-11-27)
        ("seed_axis", str(out / "seed_axis.json"),
         [str(here / "seed_axis.py"), "--workload", "logreg,2nn", "--seeds", "3,10", "--strategy", "vmap",
          "--rounds", "10", "--out", str(out / "seed_axis.json")]),
        # time to accuracy with the torch loop on the GPU too (jaxfl alone was measured there on 2026-11-27)
        ("time_to_accuracy", str(out / "time_to_accuracy_gpu.json"),
         [str(here / "time_to_accuracy.py"), "--settings", "2nn_iid,cnn_iid,2nn_noniid", "--frameworks",
          "jaxfl,torch", "--lrs", "0.2", "--out", str(out / "time_to_accuracy_gpu.json"),
          "--md", str(out / "time_to_accuracy_gpu.md"), "--resume"]),
    ]


def mnist_available() -> bool:
    """Whether ``jaxfl run --dataset mnist`` finds its files under ``$JAXFL_DATA_DIR`` (jaxfl's own lookup)."""
    from jaxfl.data.sources import data_dir, npz_path
    from jaxfl.errors import DataError
    try:
        root = data_dir()
    except DataError:
        return False
    return all(npz_path(root, "digits", "mnist", split).is_file() for split in ("train", "test"))


def hlo_launches(text: str) -> int:
    """Kernel launches of one execution of an optimized HLO module: every instruction of the entry computation
    that is not free (parameters, constants, tuples, bitcasts), calls counted through their computations, a
    while loop as trip count x (its body + its condition) (XLA annotates known trip counts) plus one condition,
    a conditional as its most expensive branch. The optimized HLO is XLA:CPU's, a proxy for XLA:GPU's fusions."""
    import re
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur and "=" in line and not line.strip().startswith("}"):
            comps[cur].append(line)
    memo = {}

    def count(name):
        if name in memo:
            return memo[name]
        memo[name] = 0
        total = 0
        for line in comps.get(name, []):
            m = re.search(r"=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(", line)
            op = m.group(1) if m else ""
            if op in SKIP_OPS or not op:
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trip.group(1)) if trip else 1
                total += n * (count(body) + max(count(cond), 1)) + max(count(cond), 1)
            elif op == "call":
                total += count(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
            elif op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[-1]) if \
                    "branch_computations" in line else []
                total += 1 + max((count(b) for b in branches), default=0)
            else:
                total += 1  # a fusion, custom call (dot, conv), copy, gather, sort, ...: one kernel
        memo[name] = total
        return total

    return count(entry)


def _cost(compiled) -> tuple[float, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def workload_spec(spec: str) -> dict:
    """Model, batch, optimizer, client sizes and round-0 cohort of a SUITE spec (as throughput.run_one builds it)."""
    import jax
    import numpy as np

    from jaxfl.core.cohort import sample_cohort
    kind, *rest = spec.split(":")
    if kind == "small":
        w = dict(throughput.SMALL[rest[0]])
        n, cohort = int(rest[1]), int(rest[2])
        counts = throughput.lognormal_counts(n, w["median"], w["sigma"])
        out = dict(model=w["model"], classes=w["classes"], input=w["input"], batch=w["batch"], momentum=None,
                   counts=counts, cohort=cohort, w=w)
    elif kind == "skewed":
        alpha, n, cohort = float(rest[0]), int(rest[1]), int(rest[2])
        counts = throughput.skewed_counts(alpha, n, int(rest[3]) if len(rest) > 3 else throughput.SKEWED["samples"])
        out = dict(model="fedavg_cnn", classes=10, input="image", batch=32, momentum=0.5, counts=counts, cohort=cohort)
    else:
        if spec.startswith("xdev:"):
            name, n, cohort = "cross_device", 1000, int(rest[0])
        else:
            name, n = rest[0], int(rest[1])
            cohort = int(rest[2]) if len(rest) > 2 else n
        wl = throughput.WORKLOADS[name]
        counts = np.full(n, wl["per_client"])
        out = dict(model=wl["model"], classes=10, input="image", batch=wl["batch"], momentum=0.5, counts=counts,
                   cohort=min(cohort, n))
    ids = np.asarray(sample_cohort(jax.random.key(1), 0, len(out["counts"]), out["cohort"]))
    return dict(out, ids=ids, spec=spec)


def project_workload(spec: str) -> dict:
    """Flops, bytes and kernel launches of one round (the round-0 cohort) and the H100 time they imply, for
    the engine under vmap (``Ragged``'s vmap buckets: each bucket runs its longest client's steps with every lane)
    and for the per-client loops (each client its own steps, one at a time).

    How loops are counted: XLA's cost analysis counts a loop body once, so the round is built from pieces
    compiled without loops: one SGD step of L clients (vmapped, L = a bucket's lanes) or of one client,
    multiplied by the steps run (engine: sum over buckets of steps x step(L); loops: sum over clients of
    ceil(n_i / B) x step(1)), plus the aggregation (one compiled call). The LSTM's time loop is unrolled for
    the flop and byte counts (flax cells, unroll 80) and counted by trip count for launches (the model as it
    runs). Launches: ``hlo_launches`` of the same pieces, plus one while-condition per step; per client in the
    jitted loop one more call (its accumulation); for the torch loop, the leaf ATen operators of one training
    step (forward, backward, SGD, zero_grad) counted with torch.profiler on the CPU, each taken as one kernel,
    plus one copy per state tensor (load_state_dict) and one add per tensor (the running weighted sum).
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxfl import models
    from jaxfl.algorithms._common import ce_loss, init_variables
    from jaxfl.core.buckets import plan_buckets
    from jaxfl.core.trainer import LocalTrainer
    ws = workload_spec(spec)
    b, counts, ids = ws["batch"], ws["counts"], ws["ids"]
    tx = optax.sgd(0.01, momentum=ws["momentum"])
    trainer = LocalTrainer(tx, b, 1)
    run_model = models.build_model(ws["model"], ws["classes"])
    count_model = throughput.counting_model(ws["w"]) if "w" in ws else run_model
    x1 = (jnp.zeros((b, 28, 28, 1), jnp.uint8) if ws["input"] == "image" else
          jnp.zeros((b, throughput.SEQ_LEN), jnp.int32))
    y1 = jnp.zeros((b,), jnp.int32)

    def step_fn(model):
        loss = ce_loss(model)

        def step(params, opt, x, y):
            g = jax.grad(lambda p: loss(p, {}, trainer.preprocess(x), y, jnp.ones(b), None)[0])(params)
            u, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, u), opt
        return step

    def compiled(model, lanes):
        v = init_variables(model, trainer, jax.random.key(0), x1)
        p, o = v["params"], tx.init(v["params"])
        f = step_fn(model)
        if lanes:
            stack = lambda t: jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (lanes,) + a.shape), t)
            return jax.jit(jax.vmap(f)).lower(stack(p), stack(o), stack(x1), stack(y1)).compile()
        return jax.jit(f).lower(p, o, x1, y1).compile()

    cache = {}

    def piece(lanes):  # (flops, bytes, launches) of one step of `lanes` clients (0: one client, not vmapped)
        if lanes not in cache:
            fl, by = _cost(compiled(count_model, lanes))
            cache[lanes] = (fl, by, hlo_launches(compiled(run_model, lanes).as_text()) + 1)
        return cache[lanes]

    steps = -(-counts[ids] // b)
    v = init_variables(run_model, trainer, jax.random.key(0), x1)
    k = len(ids)
    stacked = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (k,) + a.shape), v)
    agg = jax.jit(lambda s, t, w: jax.tree_util.tree_map(
        lambda a: jnp.tensordot(w / w.sum(), a, 1), t)).lower(v, stacked, jnp.ones(k)).compile()
    agg_fl, agg_by = _cost(agg)
    agg_l = hlo_launches(agg.as_text())
    engine = dict(flops=agg_fl, bytes=agg_by, launches=agg_l, buckets=0, steps=0)
    for bucket in plan_buckets(steps, max_lanes=k):
        present = bucket.positions[bucket.positions >= 0]
        s = int(steps[present].max())
        fl, by, la = piece(bucket.lanes)
        engine["flops"] += s * fl
        engine["bytes"] += s * by
        engine["launches"] += s * la + 1  # + the bucket's call
        engine["buckets"] += 1
        engine["steps"] += s
    fl, by, la = piece(0)
    n_leaves = len(jax.tree_util.tree_leaves(v["params"]))
    loop = dict(flops=float(steps.sum()) * fl + agg_fl, bytes=float(steps.sum()) * by + agg_by,
                launches=int(steps.sum()) * la + k * (1 + n_leaves) + agg_l, steps=int(steps.sum()))
    tl = torch_step_kernels(ws)
    torch_ = None if tl is None else dict(flops=loop["flops"], bytes=loop["bytes"], steps=int(steps.sum()),
                                          launches=int(steps.sum()) * tl + k * 2 * n_leaves + n_leaves)
    out = {"spec": spec, "model": ws["model"], "clients": len(counts), "cohort": k, "batch": b,
           "real_samples": int(counts[ids].sum()),
           "step_launches": {"engine_by_lanes": {str(l): cache[l][2] for l in cache if l},
                             "one_client": cache[0][2], "torch": tl}}
    for name, r in (("engine/vmap", engine), ("jax_loop", loop), ("torch_loop", torch_)):
        if r is None:
            continue
        compute = max(r["flops"] / H100["peak_flops"], r["bytes"] / H100["hbm_bytes_per_s"])
        r["launch_s"] = r["launches"] * H100["launch_s"]
        r["roofline_s"] = compute
        r["round_s"] = compute + r["launch_s"]
        out[name] = r
    return out


def torch_step_kernels(ws) -> int | None:
    """Leaf ATen operators of one PyTorch training step of the workload's model (forward, loss, backward, SGD
    step, zero_grad), counted on the CPU with torch.profiler: each taken as one CUDA kernel."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    w = ws.get("w") or {"model": ws["model"], "classes": ws["classes"]}
    model = throughput.torch_small_model(w) if "w" in ws else throughput.torch_model(ws["model"], (28, 28, 1))
    if model is None:
        return None
    b = ws["batch"]
    x = torch.rand(b, 1, 28, 28) if ws["input"] == "image" else torch.randint(0, 80, (b, throughput.SEQ_LEN))
    y = torch.randint(0, ws["classes"], (b,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=ws["momentum"] or 0.0)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    # a leaf: an aten op with no aten op inside it (time interval containment on the same thread)
    leaves = 0
    for e in events:
        inner = [c for c in e.cpu_children if c.name.startswith("aten::")]
        if not inner:
            leaves += 1
    return leaves


def project_main(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # resumable: the workloads already in out/projection.json are kept, not recomputed (compiling them all
    # takes ~25 min on 2 cores)
    done = json.loads((out / "projection.json").read_text())["rows"] if (out / "projection.json").is_file() else []
    rows = []
    for spec, _ in (SMOKE if args.smoke else SUITE):
        spec = _expand(spec, args.smoke)
        kept = [r for r in done if r["spec"] == spec]
        if kept:
            rows.append(kept[0])
            continue
        t = time.perf_counter()
        res = project_workload(spec)
        res["seconds"] = time.perf_counter() - t
        rows.append(res)
        print(project_report(rows[-1:]).splitlines()[-1], flush=True)
        (out / "projection.json").write_text(json.dumps({"h100": H100, "rows": rows}, indent=1))
    md = ["A PROJECTION, not a measurement: XLA's flop and byte counts and XLA:CPU's kernel (fusion) counts per "
          "round, turned into H100 time as max(flops / 66.9 TFLOP/s, bytes / 3.35 TB/s) + launches x 5 us. "
          f"command: python benchmarks/gpu_suite.py --project --out {args.out}", "", project_report(rows)]
    (out / "projection.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def project_report(rows) -> str:
    lines = ["| workload | clients (cohort) | real samples | runner | GFLOP / round | GB / round | "
             "kernel launches / round "
             "| steps run | compute s (roofline) | launch s | projected H100 round s | x torch_loop |",
             "|---" * 12 + "|"]
    for r in rows:
        base = r.get("torch_loop", {}).get("round_s")
        for name in ("engine/vmap", "jax_loop", "torch_loop"):
            if name not in r:
                continue
            v = r[name]
            xt = f"{base / v['round_s']:.1f}" if base else "-"
            lines.append(f"| {r['spec']} | {r['clients']} ({r['cohort']}) | {r['real_samples']} | {name} | "
                         f"{v['flops'] / 1e9:.1f} | {v['bytes'] / 1e9:.2f} | {v['launches']} | {v['steps']} | "
                         f"{v['roofline_s']:.5f} | {v['launch_s']:.4f} | {v['round_s']:.4f} | {xt} |")
    return "\n".join(lines)


def spec_key(spec: str) -> tuple[str, int, int]:
    """(workload label, clients, cohort) that ``throughput.run_one`` reports for a suite spec."""
    kind, *rest = _expand(spec, False).split(":")
    if kind == "small":
        return rest[0], int(rest[1]), int(rest[2])
    if kind == "skewed":
        return f"dirichlet {float(rest[0])}", int(rest[1]), int(rest[2])
    name, n = rest[0], int(rest[1])
    cohort = int(rest[2]) if len(rest) > 2 else throughput.WORKLOADS[name].get("cohort") or n
    return name, n, min(cohort, n)


def measured_keys(folder: Path) -> set:
    """``spec_key``s of the workloads measured (a result without failed runners) in any results.json under
    ``folder``."""
    keys = set()
    for f in folder.rglob("results.json"):
        for r in json.loads(f.read_text())["results"]:
            if not any(isinstance(v, dict) and "error" in v for v in r.values()):
                keys.add((r["workload"], int(r["clients"]), int(r["cohort"])))
    return keys


def _expand(spec: str, smoke: bool) -> str:
    """``xdev:C``: the cross-device workload (1,000 pfl_cnn clients of 50 samples) at cohort C."""
    if spec.startswith("xdev:"):
        return f"equal:cross_device:{40 if smoke else 1000}:{spec.split(':')[1]}"
    return spec


def plot(results, path):
    from jaxfl.run.plots import plotting_available
    if not plotting_available():  # (a device machine's python may lack it: the figure is the only thing lost)
        print(f"no matplotlib: {path} not drawn")
        return
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
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
