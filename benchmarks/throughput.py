"""Round throughput of jaxfl's engine against the per-client loops that FL papers and simulators run.

Every workload is a population of clients with given sample counts (equal, or a Dirichlet label-skew
partition of 50,000 samples), synthetic uint8 images (speed does not depend on their content), FedAvg, one
local epoch, SGD. For the same sampled cohorts it times, after compilation (each round's shapes are compiled
in a first pass over the same rounds, then the rounds are timed):
  engine/<strategy>   jaxfl's ``Ragged.round`` (ragged data, buckets, per-client store) with the client
                      strategy map | vmap | chunked
  jax_loop            a jitted one-client local update called from a Python loop, each client padded to its
                      own step grid length, then a jitted aggregation (how FedJAX-style simulators run)
  torch_loop          the same round in PyTorch, client after client, each doing only its real steps (the
                      last batch partial), for the two plain CNNs (needs torch: the optional `bench` extra)
  torch_vmap          (--small) the round vectorized in PyTorch: ``torch.func`` vmap of grad over the cohort
                      padded to its longest client, masked, on the device (``torch_vmap_fedavg_round``)
and reports real samples/s (real samples trained / round time), the ratios to the loops, the engine's
padded/real work, buckets and compiled shapes, each runner's roofline (``roofline.py``: its useful FLOP/s and
bytes/s against the machine's measured matmul peak and copy bandwidth) and the peak resident memory of the
process (each workload runs in its own subprocess).

    python benchmarks/throughput.py --quick                       # equal workloads, a few minutes on CPU
    python benchmarks/throughput.py --skewed                      # Dirichlet 0.1/0.3/1 over 100 and 1,000 clients
    python benchmarks/throughput.py --population                  # FedAvg/FedBN at 1k/10k/100k clients, cohort 100
    python benchmarks/throughput.py --workloads fedavg_cnn --clients 4,16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_fedavg import torch_fedavg_round  # noqa: E402  (the torch loop both benchmarks time)
import roofline  # noqa: E402  (the machine's peaks and a step's cost: the roofline columns)

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


def guarded(fn, *args) -> dict:
    """fn(*args), or {"error": its first line} if it raised: one runner's failure (e.g. out of GPU memory) leaves
    the workload's other runners measured."""
    from jaxfl.errors import first_line
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - any failure of a runner is a result to report
        return {"error": first_line(err, 300)}


def measure(model_name, shape, counts, batch, cohort, strategies, rounds=2, algorithm="fedavg", torch=True,
            chunk_size=8) -> dict:
    """Time ``rounds`` rounds (the same cohorts for every runner) of each runner; see the module docstring."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Ragged
    from jaxfl.core.buckets import grid_ceil
    from jaxfl.core.cohort import client_keys, client_map, sample_cohort
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.core.types import RoundInfo
    from jaxfl.models import build_model

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
    def engine(strategy):
        sim = Ragged(alg, data, batch_size=batch, clients=client_map(strategy, chunk_size), cohort_size=cohort)
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
        return {"round_s": sec, "samples_per_s": real / rounds / sec, "compile_s": first - sec * rounds,
                "padded_work": float(np.mean(work)), "buckets": int(m["buckets"]),
                "compiled_shapes": int(m["compiled_shapes"]), "lane_cap": sim.lane_cap}

    for strategy in strategies:
        out[f"engine/{strategy}"] = guarded(engine, strategy)
    # a jitted one-client update in a Python loop, each client padded to its own grid length, then aggregation
    one, agg = jax.jit(alg.local_update), jax.jit(alg.aggregate)
    server, client = alg.init(jax.random.key(0), data.x[:1])

    def loop_round(r, ids):
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
        loop_round(r, cohorts[r])
    first = time.perf_counter() - t
    t = time.perf_counter()
    for r in range(rounds):
        loop_round(r, cohorts[r])
    sec = (time.perf_counter() - t) / rounds
    out["jax_loop"] = {"round_s": sec, "samples_per_s": real / rounds / sec, "compile_s": first - sec * rounds}
    if torch:
        res = torch_loop(model_name, shape, batch, [data.counts[ids] for ids in cohorts])
        if res:
            out["torch_loop"] = dict(res, samples_per_s=real / rounds / res["round_s"])
    # the roofline of every runner that ran: its real samples/s under one step's XLA cost, against the machine
    out["train_step_cost"] = cost = roofline.train_step_cost(build_model(model_name, 10), data.x[:1], batch)
    peaks = roofline.machine_peaks()
    for v in out.values():
        if isinstance(v, dict) and "samples_per_s" in v:
            v.update(roofline.roofline(v["samples_per_s"], cost, peaks))
    out.update(peaks)
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
    last batch partial), then the mean of the states. Returns the mean round time over the rounds, after an
    untimed round of the first round's first 8 clients (CUDA's and the allocator's start-up)."""
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
    round_(cohort_counts[0][:8])
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

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Ragged
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.core.trees import tree_bytes
    from jaxfl.models import build_model

    p = POPULATION
    data = make_population(np.full(n_clients, p["per_client"]), p["shape"])
    alg = build_algorithm(algorithm, build_model(p["model"], 10), LocalTrainer(optax.sgd(0.01), p["batch"], 1))
    sim = Ragged(alg, data, batch_size=p["batch"], clients="map", cohort_size=p["cohort"])
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


# Small-model / cross-device workloads: FedAvg, plain SGD, one local epoch, batch 10, client sizes
# log-normal (median, sigma) like LEAF's statistics (LEAF, Caldas et al. 2018, Table 1):
#   FEMNIST: 3,550 users, mean 226.83 samples, std 88.94 -> log-normal sigma = sqrt(ln(1 + (88.94/226.83)^2)) = 0.38,
#            median = 226.83 / sqrt(1 + (88.94/226.83)^2) = 211;
#   Shakespeare: 1,129 users, mean 3,743, std 6,212 -> sigma 1.15, median 1,932.
# logreg and 2NN use FEMNIST's sizes as they are; the FEMNIST CNN FEMNIST's sigma with a quarter of its median
# (53), and the character LSTM Shakespeare's sigma with 1/200 of its median (10), so that a round of 100 clients
# takes seconds, not minutes, on a 2-core CPU (the LSTM's train step is ~0.38 GFLOP per 80-character sample).
SMALL = {
    "logreg": dict(model="logreg", input="image", classes=10, batch=10, median=211, sigma=0.38, lr=0.01),
    "2nn": dict(model="mlp_2nn", input="image", classes=10, batch=10, median=211, sigma=0.38, lr=0.01),
    "femnist_cnn": dict(model="femnist_cnn", input="image", classes=62, batch=10, median=53, sigma=0.38, lr=0.01,
                        skip=("stacked/vmap/K10",), max_rounds=1),
    "char_lstm": dict(model="char_lstm", input="text", classes=80, batch=10, median=10, sigma=1.15, lr=0.01,
                      skip=("stacked/vmap/K10",), max_rounds=1),
    # the label-skewed FedAvg CNN of SKEWED (batch 32; client sizes of jaxfl's Dirichlet(0.3) split of 50,000
    # samples over the workload's clients) in this harness, whose /D2 runners split the cohort over the cores
    "fedavg_cnn_dir0.3": dict(model="fedavg_cnn", input="image", classes=10, batch=32, dirichlet=0.3,
                              samples=50_000, median=None, sigma=None, lr=0.01, skip=("stacked/vmap/K10",),
                              max_rounds=3),
    # the same clients at the FedAvg paper's batch B = 10
    "fedavg_cnn_dir0.3_b10": dict(model="fedavg_cnn", input="image", classes=10, batch=10, dirichlet=0.3,
                                  samples=50_000, median=None, sigma=None, lr=0.01, skip=("stacked/vmap/K10",),
                                  max_rounds=3),
}
# skip: runners left out by default (a vmapped round of CNN / LSTM clients runs to the cohort's longest client
# and is slower than map on a CPU: see ragged/vmap); max_rounds: at most this many rounds timed per runner (the
# label-skewed CNN's rounds of a few seconds move by 10-25 % from one run to the next on a 2-core CPU: 3 of them)
# (workload, clients, cohort): cohort 100 of 1,000 for every model (the targets), then population and cohort sweeps
SMALL_PLAN = [("logreg", 1000, 100), ("2nn", 1000, 100), ("femnist_cnn", 1000, 100), ("char_lstm", 1000, 100),
              ("logreg", 10000, 10), ("logreg", 10000, 100), ("logreg", 10000, 1000), ("2nn", 10000, 1000)]
SMALL_RUNNERS = ("stacked/map/K1", "stacked/map/K10", "stacked/map/K1/D2", "stacked/map/K10/D2", "stacked/vmap/K10",
                 "ragged/map", "ragged/vmap", "jax_loop", "torch_loop")
# /D2 (stacked and ragged runners): the cohort split over 2 devices (on a CPU, 2 CPU devices: one block of clients
# per core); /S<n>, /O<x> (stacked): the lane plan's segments and step overhead (``lane_options``); /F (stacked): a new
# buffer for the trained rows every call instead of the one kept from the round before (``Stacked(keep_rows=False)``);
# /T (stacked, last):
# each client's partial last batch computed at the smallest size that holds it, of the eighths of B that the
# population's last batches take (``LocalTrainer.tail_sizes``; ``build.tails_chosen``, as the CLI's --tail-batches on)
SEQ_LEN = 80  # LEAF Shakespeare's input: 80 characters


def lognormal_counts(n_clients: int, median: float, sigma: float, seed: int = 0):
    """Client sizes max(1, round(median * exp(sigma * N(0, 1))))."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(median * np.exp(sigma * rng.standard_normal(n_clients)))).astype(np.int64)


def workload_counts(w: dict, n_clients: int):
    """A small workload's client sizes: its Dirichlet label-skew split (``skewed_counts``) or log-normal sizes."""
    if "dirichlet" in w:
        return skewed_counts(w["dirichlet"], n_clients, w["samples"])
    return lognormal_counts(n_clients, w["median"], w["sigma"])


def small_population(w: dict, counts, seed: int = 0):
    """RaggedClients of synthetic samples: uint8 28x28x1 images, or token ids [80] in [0, 80) (speed does not
    depend on the content), labels uniform over the workload's classes."""
    import numpy as np

    from jaxfl.data.ragged import RaggedClients
    rng = np.random.default_rng(seed)
    total = int(sum(counts))
    if w["input"] == "image":
        x = rng.integers(0, 256, (total, 28, 28, 1), dtype=np.uint8)
    else:
        x = rng.integers(0, 80, (total, SEQ_LEN), dtype=np.int32)
    y = rng.integers(0, w["classes"], total).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return RaggedClients(x, y, offsets, np.asarray(counts, np.int64))


def counting_model(w: dict):
    """The workload's model for FLOP counting: the LSTM with its time loop unrolled (XLA's cost analysis counts
    a loop body once), otherwise the model itself."""
    from jaxfl import models
    if w["model"] == "char_lstm":
        return models.Classifier(models.CharLSTMEncoder(unroll=SEQ_LEN, impl="flax"),
                                 models.MLPHead((), w["classes"]))
    return models.build_model(w["model"], w["classes"])


def train_step_cost(w: dict, batch: int | None = None) -> dict:
    """XLA's cost analysis of one jitted train step (forward, backward, SGD update) of the workload's model on
    one batch (``roofline.train_step_cost``): flops and bytes accessed, per batch and per sample."""
    import numpy as np
    x = (np.zeros((1, 28, 28, 1), np.uint8) if w["input"] == "image" else np.zeros((1, SEQ_LEN), np.int32))
    return roofline.train_step_cost(counting_model(w), x, batch or w["batch"], w["lr"])


def measure_small(name: str, n_clients: int, cohort: int, runners=SMALL_RUNNERS, rounds: int = 2,
                  k: int = 10, median: float | None = None, sigma: float | None = None) -> dict:
    """One small-model workload: every runner of ``runners`` on the same cohorts (see the module docstring)."""
    import dataclasses

    import jax
    import numpy as np
    import optax

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Ragged, Stacked, Streamed
    from jaxfl.core.cohort import client_map, sample_cohort
    from jaxfl.core.distributed import client_mesh
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.models import build_model

    w = dict(SMALL[name])
    runners = [r for r in runners if r not in w.get("skip", ())]
    rounds = min(rounds, w.get("max_rounds", rounds))
    w["median"] = median or w["median"]
    w["sigma"] = sigma if sigma is not None else w["sigma"]
    peaks = roofline.machine_peaks()
    peak, bandwidth = peaks["matmul_peak_gflops"], peaks["copy_bandwidth_gbs"]
    counts = workload_counts(w, n_clients)
    data = small_population(w, counts)
    batch = w["batch"]
    trainer = LocalTrainer(optax.sgd(w["lr"]), batch, 1)
    alg = build_algorithm("fedavg", build_model(w["model"], w["classes"]), trainer)
    root = jax.random.key(1)
    n_rounds = cohorts_needed(runners, rounds, k)
    cohorts = [np.asarray(sample_cohort(root, r, n_clients, cohort)) for r in range(n_rounds)]
    real = [int(counts[ids].sum()) for ids in cohorts]
    cost = train_step_cost(w)
    out = {"workload": name, "model": w["model"], "clients": n_clients, "cohort": cohort, "batch": batch,
           "median": w["median"], "sigma": w["sigma"], "rounds": rounds, "k": k,
           "real_samples_per_round": float(np.mean(real[:rounds])), "mean_size": float(counts.mean()),
           "max_over_mean": float(counts.max() / counts.mean()), "matmul_peak_gflops": peak,
           "copy_bandwidth_gbs": bandwidth,
           "train_step_cost": cost, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "jax": jax.__version__}

    def record(runner, sec_total, n, extra=None):
        samples = sum(real[:n])
        sps = samples / sec_total
        # the roofline: the useful work's rate (XLA's counts for one client-step, per real sample) against the
        # machine's measured matmul peak and copy bandwidth
        out[runner] = dict({"round_s": sec_total / n, "samples_per_s": sps, "rounds_timed": n},
                           **roofline.roofline(sps, cost, peaks), **(extra or {}))

    # the lane plan's step overhead as `jaxfl run` sets it (the model's tau P / (B f), capped, on an accelerator;
    # the backend's platform default on a CPU) unless a runner names one (/O<x>)
    from jaxfl.run.build import model_lane_overhead, tails_chosen
    image = np.zeros((1, 28, 28, 1), np.uint8) if w["input"] == "image" else np.zeros((1, SEQ_LEN), np.int32)
    run_overhead = model_lane_overhead(build_model(w["model"], w["classes"]), image, batch)

    def run(runner):
        kind, *opt = runner.split("/")
        devices = runner_devices(runner)
        mesh = client_mesh(devices) if devices > 1 else None
        if kind == "stacked":
            strategy, kk = opt[0], int(opt[1][1:])
            # a partial last batch at the smallest size that holds it, of those the population's last batches take
            tails = tails_chosen("on", counts, batch) or None if runner.endswith("/T") else None
            tr = dataclasses.replace(trainer, tail_sizes=tails, tail_log=[])
            sim = Stacked(build_algorithm("fedavg", build_model(w["model"], w["classes"]), tr) if tails else alg,
                          data, batch_size=batch, clients=client_map(strategy, mesh=mesh), cohort_size=cohort,
                          rounds_per_call=kk, trainer=tr, keep_rows="F" not in opt[2:],
                          **{"lane_overhead": run_overhead, **lane_options(runner)})
            server, store = sim.init(jax.random.key(0), data.x[:1])
            t = time.perf_counter()
            if kk == 1:
                server, m = sim.round(server, store, 0, root)  # compile
                first = time.perf_counter() - t
                t, ms = time.perf_counter(), []
                for r in range(rounds):  # one call per round (run_rounds would run the K-round program)
                    server, m = sim.round(server, store, r, root)
                    ms.append(m)
                jax.block_until_ready(server)
                n = rounds
            else:
                server, _ = sim.run_rounds(server, store, 0, 1, root)  # compile (the same program runs 1..K)
                first = time.perf_counter() - t
                t = time.perf_counter()
                server, ms = sim.run_rounds(server, store, 0, kk, root)
                jax.block_until_ready(server)
                n = kk
            sec = time.perf_counter() - t
            record(runner, sec, n, {"compile_s": first, "padded_work": float(np.mean([m["padded_work"] for m in ms])),
                                    "host_share": float(np.mean([m["host_share"] for m in ms])),
                                    "lanes": None if sim.lanes is None else [list(g) for g in sim.lanes.segments],
                                    "lane_overhead": sim.lane_overhead})
            del sim, store
        elif kind in ("ragged", "streamed"):
            lanes = {} if kind == "ragged" else {"lane_overhead": run_overhead}
            sim = (Ragged if kind == "ragged" else Streamed)(alg, data, batch_size=batch, cohort_size=cohort,
                                                             clients=client_map(opt[0], mesh=mesh), **lanes)
            server, store = sim.init(jax.random.key(0), data.x[:1])
            t = time.perf_counter()
            for r in range(rounds):  # compile every bucket shape of these cohorts
                server, m = sim.round(server, store, r, root)
            first = time.perf_counter() - t
            t = time.perf_counter()
            server, ms = sim.run_rounds(server, store, 0, rounds, root)
            jax.block_until_ready(server)
            sec = time.perf_counter() - t
            record(runner, sec, rounds, {"compile_s": first - sec,
                                         "padded_work": float(np.mean([m["padded_work"] for m in ms])),
                                         "host_share": float(np.mean([m["host_share"] for m in ms])),
                                         "buckets": int(ms[-1]["buckets"]),
                                         "compiled_shapes": int(ms[-1]["compiled_shapes"]),
                                         **({} if kind == "ragged" or sim.lanes is None else
                                            {"lanes": [list(g) for g in sim.lanes.segments]})})
            del sim, store
        elif kind == "jax_loop":
            sec = small_jax_loop(alg, data, batch, cohorts[:rounds], root)
            record(runner, sec * rounds, rounds)
        elif kind == "torch_vmap":
            res = small_torch_vmap(w, data, cohorts[:rounds])
            if res:
                record(runner, res["round_s"] * rounds, rounds, {k_: v for k_, v in res.items() if k_ != "round_s"})
        elif kind == "torch_loop":
            res = small_torch_loop(w, data, cohorts[:rounds])
            if res:
                record(runner, res["round_s"] * rounds, rounds, {k_: v for k_, v in res.items() if k_ != "round_s"})

    for runner in runners:
        failed = guarded(run, runner)
        if failed:
            out[runner] = failed
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def cohorts_needed(runners, rounds: int, k: int) -> int:
    """Rounds whose cohorts a workload draws: ``rounds`` timed, or K if a ``stacked/S/K`` runner with K > 1
    (``stacked/map/K10``, ``stacked/map/K10/D2``) times K rounds in one call."""
    return max(rounds, k if any(r.startswith("stacked/") and r.split("/")[2] != "K1" for r in runners) else 0)


def lane_options(runner: str) -> dict:
    """A stacked runner's lane-plan options: ``/S<n>`` at most n segments (``/S0``: one vmap over the cohort, every
    lane to its longest client), ``/O<x>`` a step's overhead of x lanes; absent: the backend's defaults."""
    out = {}
    for part in runner.split("/")[3:]:
        if part.startswith("S") and part[1:].isdigit():
            out["lane_segments"] = int(part[1:])
        elif part.startswith("O"):
            out["lane_overhead"] = float(part[1:])
    return out


def runner_devices(runner: str) -> int:
    """The devices a runner splits the cohort over: ``stacked/map/K1/D2`` -> 2 (no ``/D``: 1)."""
    return next((int(p[1:]) for p in runner.split("/")[1:] if p.startswith("D") and p[1:].isdigit()), 1)


def small_jax_loop(alg, data, batch, cohorts, root) -> float:
    """FedJAX-style rounds: for each cohort client, its samples gathered on the host (padded to its own step grid
    length) and one jitted call that trains it and adds its weighted state to a running sum (donated); then the
    sum is divided by the total weight. Returns the median round time after one untimed pass."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfl.core.buckets import grid_ceil
    from jaxfl.core.cohort import client_keys
    from jaxfl.core.types import RoundInfo

    def one(server, client, acc, row, key, info, weight):
        new = alg.local_update(server, client, row, key, info)[0]
        return jax.tree_util.tree_map(lambda a, b: a + weight * b, acc, new)

    one = jax.jit(one, donate_argnums=(2,))
    finish = jax.jit(lambda acc, total: jax.tree_util.tree_map(lambda a: a / total, acc))
    server, client = alg.init(jax.random.key(0), data.x[:1])

    def loop_round(r, ids):
        keys = client_keys(root, r, jnp.asarray(ids))
        acc = jax.tree_util.tree_map(jnp.zeros_like, server)
        for i, key in zip(ids, keys):
            d = data.gather(np.array([i]), grid_ceil(-(-int(data.counts[i]) // batch)) * batch)
            row = jax.tree_util.tree_map(lambda a: jnp.asarray(a[0]), d)
            acc = one(server, client, acc, row, key, RoundInfo(jnp.int32(r), jnp.int32(i)),
                      jnp.float32(data.counts[i]))
        return jax.block_until_ready(finish(acc, jnp.float32(data.counts[ids].sum())))

    for r, ids in enumerate(cohorts):
        loop_round(r, ids)
    times = []
    for r, ids in enumerate(cohorts):
        t = time.perf_counter()
        loop_round(r, ids)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def torch_small_model(w: dict):
    """The workload's model in PyTorch (same architecture as jaxfl.models; None without torch)."""
    try:
        import torch.nn as tnn
    except ImportError:
        return None
    c = w["classes"]
    if w["model"] == "logreg":
        return tnn.Sequential(tnn.Flatten(), tnn.Linear(784, c))
    if w["model"] == "mlp_2nn":
        return tnn.Sequential(tnn.Flatten(), tnn.Linear(784, 200), tnn.ReLU(), tnn.Linear(200, 200), tnn.ReLU(),
                              tnn.Linear(200, c))
    if w["model"] == "fedavg_cnn":
        return torch_model("fedavg_cnn", (28, 28, 1))
    if w["model"] == "femnist_cnn":
        return tnn.Sequential(tnn.Conv2d(1, 32, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2),
                              tnn.Conv2d(32, 64, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Flatten(),
                              tnn.Linear(7 * 7 * 64, 2048), tnn.ReLU(), tnn.Linear(2048, c))
    if w["model"] == "char_lstm":
        class CharLSTM(tnn.Module):  # LEAF's Shakespeare model
            def __init__(self):
                super().__init__()
                self.embed = tnn.Embedding(80, 8)
                self.lstm = tnn.LSTM(8, 256, num_layers=2, batch_first=True)
                self.head = tnn.Linear(256, c)

            def forward(self, x):
                return self.head(self.lstm(self.embed(x))[0][:, -1])
        return CharLSTM()
    return None


def small_torch_loop(w: dict, data, cohorts) -> dict | None:
    """The same rounds in PyTorch, client after client: load the global state, a fresh SGD, one epoch over a
    random permutation (``torch.randperm``) in batches (the last partial), add the weighted state to a running
    sum; the clients' tensors are made before timing (float images in [-1, 1] / int64 tokens). Returns the
    median round time after an untimed round of the first round's first 8 clients; on a CPU at 1 thread and at
    torch's default (the machine's cores): the faster setting is ``round_s`` (intra-op threads do not help
    batches of 10, and busy-waiting OpenMP threads are slow on a shared machine), both are kept in
    ``round_s_by_threads``; on a GPU at the default only."""
    model = torch_small_model(w)
    if model is None:
        return None
    import numpy as np
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(dev)
    b = w["batch"]
    tensors = {}
    for ids in cohorts:
        for i in ids:
            if int(i) not in tensors:
                lo, n = int(data.offsets[i]), int(data.counts[i])
                x = data.x[lo:lo + n]
                x = (torch.from_numpy(x.astype(np.float32)).permute(0, 3, 1, 2) / 127.5 - 1.0
                     if w["input"] == "image" else torch.from_numpy(x.astype(np.int64)))
                tensors[int(i)] = (x.to(dev), torch.from_numpy(data.y[lo:lo + n].astype(np.int64)).to(dev))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}

    def round_(ids):
        global_state.update(torch_fedavg_round(model, global_state, tensors, ids, w["lr"], b))
        if dev == "cuda":
            torch.cuda.synchronize()

    by_threads = {}
    default = torch.get_num_threads()
    for threads in sorted({default} if dev == "cuda" else {1, default}):
        torch.set_num_threads(threads)
        round_(cohorts[0][:8])
        times = []
        for ids in cohorts:
            t = time.perf_counter()
            round_(ids)
            times.append(time.perf_counter() - t)
        by_threads[threads] = float(np.median(times))
    torch.set_num_threads(default)
    best = min(by_threads, key=by_threads.get)
    return {"round_s": by_threads[best], "threads": best, "round_s_by_threads": by_threads,
            "torch": torch.__version__, "torch_device": dev}


def small_torch_vmap(w: dict, data, cohorts) -> dict | None:
    """The same rounds as a vectorized PyTorch program (``torch_vmap_fedavg_round``: ``torch.func`` vmap of grad
    over the cohort padded to its longest client, masked): the population padded to its longest client and kept
    on the device (uint8 images, scaled to [-1, 1] inside the loss), the cohort gathered there each round.
    Returns the median round time after an untimed first round (compiles nothing, but warms the allocator), at
    torch's default threads."""
    model = torch_small_model(w)
    if model is None:
        return None
    import numpy as np
    import torch
    from torch_fedavg import torch_vmap_fedavg_round
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(dev)
    n, m = len(data.counts), int(data.counts.max())
    x = np.zeros((n, m) + data.x.shape[1:], data.x.dtype)
    y = np.zeros((n, m), np.int64)
    for i in range(n):
        lo, c = int(data.offsets[i]), int(data.counts[i])
        x[i, :c], y[i, :c] = data.x[lo:lo + c], data.y[lo:lo + c]
    image = w["input"] == "image"
    x = torch.from_numpy(x).to(dev)
    x = x.permute(0, 1, 4, 2, 3) if image else x.long()  # [N, M, C, H, W] / tokens
    y, counts = torch.from_numpy(y).to(dev), torch.from_numpy(data.counts.astype(np.int64)).to(dev)

    class Scaled(torch.nn.Module):  # uint8 images -> [-1, 1] inside the vectorized loss
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, xb):
            return self.inner(xb.float() / 127.5 - 1.0 if image else xb)

    scaled = Scaled(model)
    params = {k: v.detach() for k, v in scaled.named_parameters()}

    def round_(ids):
        nonlocal params
        ids = torch.as_tensor(np.asarray(ids), device=dev)
        params = torch_vmap_fedavg_round(scaled, params, x[ids], y[ids], counts[ids], w["lr"], w["batch"])
        if dev == "cuda":
            torch.cuda.synchronize()

    round_(cohorts[0])
    times = []
    for ids in cohorts:
        t = time.perf_counter()
        round_(ids)
        times.append(time.perf_counter() - t)
    steps = [-(-data.counts[ids] // w["batch"]) for ids in cohorts]  # every lane to the cohort's longest client
    padded = sum(len(s) * int(s.max()) for s in steps) / float(sum(int(s.sum()) for s in steps))
    return {"round_s": float(np.median(times)), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "torch_device": dev, "padded_work": padded}


SMALL_COLUMNS = ("| workload | clients (cohort) | mean size (max/mean) | runner | real samples/s | x torch | "
                 "x jax_loop | padded/real | host share | FLOP/s / peak | bytes/s / peak | round s | peak RSS GB |")


def small_report(results: list[dict]) -> str:
    lines = [SMALL_COLUMNS, "|---" * 13 + "|"]
    for r in results:
        base_j = r.get("jax_loop", {}).get("samples_per_s")
        base_t = r.get("torch_loop", {}).get("samples_per_s")
        for runner in [k for k in r if isinstance(r[k], dict) and "error" in r[k]]:
            lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | - | {runner} | "
                         f"failed: {r[runner]['error'][:120]} |" + " - |" * 8)
        for runner in [k for k in r if isinstance(r[k], dict) and "samples_per_s" in r[k]]:
            v = r[runner]
            f = lambda key, fmt: format(v[key], fmt) if key in v else "-"
            xt = f"{v['samples_per_s'] / base_t:.2f}" if base_t else "-"
            xj = f"{v['samples_per_s'] / base_j:.2f}" if base_j else "-"
            lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | {r['mean_size']:.0f} "
                         f"({r['max_over_mean']:.1f}) | {runner} | {v['samples_per_s']:.0f} | {xt} | {xj} | "
                         f"{f('padded_work', '.3f')} | {f('host_share', '.3f')} | {v['flops_fraction']:.3f} | "
                         f"{f('bytes_fraction', '.3f')} | "
                         f"{v['round_s']:.3f} | {r['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def fraction(v: dict, key: str) -> str:
    """A roofline fraction as a table cell ("-" in results recorded before the column existed)."""
    return f"{v[key]:.3f}" if key in v else "-"


def report(results: list[dict]) -> str:
    lines = ["| workload | clients (cohort) | max/mean size | runner | real samples/s | x torch | x jax_loop | "
             "padded/real | buckets (shapes) | FLOP/s / peak | bytes/s / peak | round s | peak RSS GB |",
             "|---" * 13 + "|"]
    for r in results:
        base_j = r.get("jax_loop", {}).get("samples_per_s")
        base_t = r.get("torch_loop", {}).get("samples_per_s")
        for runner in [k for k in r if k.startswith("engine/")] + ["jax_loop", "torch_loop"]:
            if runner not in r:
                continue
            v = r[runner]
            if "error" in v:
                lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | {r['max_over_mean']:.1f} | "
                             f"{runner} | failed: {v['error'][:120]} |" + " - |" * 8)
                continue
            work = f"{v['padded_work']:.3f}" if "padded_work" in v else "-"
            shapes = f"{v['buckets']} ({v['compiled_shapes']})" if "buckets" in v else "-"
            if v.get("lane_cap"):
                shapes += f", capped at {v['lane_cap']} lanes"
            xt = f"{v['samples_per_s'] / base_t:.2f}" if base_t else "-"
            xj = f"{v['samples_per_s'] / base_j:.2f}" if base_j else "-"
            lines.append(f"| {r['workload']} | {r['clients']} ({r['cohort']}) | {r['max_over_mean']:.1f} | {runner} | "
                         f"{v['samples_per_s']:.0f} | {xt} | {xj} | {work} | {shapes} | "
                         f"{fraction(v, 'flops_fraction')} | {fraction(v, 'bytes_fraction')} | "
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


SMALL_OPTIONS: dict = {}  # --runners, --k, --median, --sigma of the small workloads (set by main)


def run_one(spec: str, strategies, rounds) -> dict:
    """One workload, in this process: ``equal:NAME:CLIENTS[:COHORT]``, ``skewed:ALPHA:CLIENTS:COHORT[:SAMPLES]``
    or ``population:ALGORITHM:CLIENTS``."""
    import numpy as np
    kind, *rest = spec.split(":")
    if kind == "small":
        o = SMALL_OPTIONS
        return measure_small(rest[0], int(rest[1]), int(rest[2]), runners=o.get("runners", SMALL_RUNNERS),
                             rounds=rounds, k=o.get("k", 10), median=o.get("median"), sigma=o.get("sigma"))
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


def subprocess_run(spec: str, strategies: str, rounds: int, env=None, timeout=None, extra=()) -> dict | None:
    """``run_one(spec)`` in a fresh process (its own peak RSS); None (and its stderr printed) if it failed."""
    cmd = [sys.executable, __file__, "--one", spec, "--strategies", strategies, "--rounds", str(rounds), *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{spec} timed out after {timeout} s", file=sys.stderr)
        return None
    if proc.returncode:
        print(f"{spec} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


RUNNER = re.compile(r"stacked/(map|vmap|chunked)/K[1-9][0-9]*(/D[1-9][0-9]*)?(/S[0-9]+)?(/O[0-9]+(\.[0-9]+)?)?"
                    r"(/F)?(/T)?|(ragged|streamed)/(map|vmap|chunked)(/D[1-9][0-9]*)?|jax_loop|torch_loop|torch_vmap")


def check_plan_item(item: str) -> None:
    """ConfigError (one line) unless ``item`` is NAME:CLIENTS:COHORT with NAME a small workload (``SMALL``)."""
    from jaxfl.errors import ConfigError
    name, *sizes = item.split(":")
    if name not in SMALL or len(sizes) != 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise ConfigError(f"--plan {item!r}: give NAME:CLIENTS:COHORT with NAME one of {', '.join(SMALL)}")


def check_args(args) -> None:
    """ConfigError (one line, exit 2 through ``run_script``) for a flag no workload could take, before any."""
    from jaxfl.core.cohort import STRATEGIES
    from jaxfl.errors import ConfigError
    from jaxfl.run.script import check_at_least, check_output_file, parse_list
    parse_list(args.strategies, "--strategies", choices=STRATEGIES)
    check_at_least("--rounds", args.rounds, 1)
    check_at_least("--k", args.k, 1)
    parse_list(args.workloads, "--workloads", choices=tuple(WORKLOADS))
    if args.clients:
        check_at_least("--clients", parse_list(args.clients, "--clients", int), 1)
    if args.alphas:
        check_at_least("--alphas", parse_list(args.alphas, "--alphas", float), 0, strict=True)
    bad = [r for r in args.runners.split(",") if not RUNNER.fullmatch(r)]
    if bad:
        raise ConfigError(f"--runners: {', '.join(map(repr, bad))} is not "
                          f"stacked/STRATEGY/K<k>[/D<d>][/S<n>][/O<x>][/F][/T], ragged/STRATEGY[/D<d>], "
                          f"streamed/STRATEGY[/D<d>], jax_loop, torch_loop or torch_vmap")
    for item in (args.plan.split(",") if args.plan else []):
        check_plan_item(item)
    check_output_file(args.json, "--json")


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
    p.add_argument("--json", default=None, help="write the raw results here (rewritten after every workload)")
    p.add_argument("--small", action="store_true", help="the small-model / cross-device workloads (SMALL_PLAN)")
    p.add_argument("--plan", default=None, help="with --small: NAME:CLIENTS:COHORT,... instead of SMALL_PLAN")
    p.add_argument("--runners", default=",".join(SMALL_RUNNERS), help="with --small: the runners")
    p.add_argument("--k", type=int, default=10, help="with --small: rounds per call of the stacked/*/K runners")
    p.add_argument("--median", type=float, default=None, help="with --small: override the client size median")
    p.add_argument("--sigma", type=float, default=None, help="with --small: override the client size sigma")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one workload in a subprocess
    args = p.parse_args(argv)
    check_args(args)
    SMALL_OPTIONS.update(runners=args.runners.split(","), k=args.k, median=args.median, sigma=args.sigma)
    if args.one:
        if args.one.startswith("small:"):  # /D runners: CPU devices, one per core, asked for before jax starts
            from jaxfl.core.distributed import use_cpu_devices
            use_cpu_devices(max(runner_devices(r) for r in SMALL_OPTIONS["runners"]))
        print(json.dumps(run_one(args.one, args.strategies.split(","), args.rounds)))
        return
    extra = []
    if args.small:
        extra = ["--runners", args.runners, "--k", str(args.k)]
        extra += ["--median", str(args.median)] if args.median else []
        extra += ["--sigma", str(args.sigma)] if args.sigma is not None else []
        plan = ([tuple(t.split(":")) for t in args.plan.split(",")] if args.plan else SMALL_PLAN)
        specs = [f"small:{name}:{n}:{c}" for name, n, c in plan]
    elif args.population:
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
    fmt = population_report if args.population else small_report if args.small else report
    for spec in specs:
        res = subprocess_run(spec, args.strategies, args.rounds, extra=extra)
        if res is not None:
            res["command"] = " ".join(sys.argv)
            results.append(res)
            print("\n".join(fmt(results[-1:]).splitlines()[2:]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print("\n" + fmt(results))


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
