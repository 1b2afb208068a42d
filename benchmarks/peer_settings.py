"""Published peer settings: jaxfl's time (and accuracy, where the data are real) in the settings other simulators
publish timings for, with their published numbers beside.

Settings (``SETTINGS``; the sources are in ``PEERS``):

  flute_lr_mnist     FLUTE's benchmark "LR on MNIST": FedAvg, logistic regression 784 -> 10, MNIST over 1,000
                     clients (FedML's split: two digits per client, power-law sizes), 10 clients a round, batch 10,
                     client SGD lr 0.03, 1 local epoch, 100 rounds, server SGD lr 1 (plain FedAvg), a test every
                     20 rounds. jaxfl runs ``jaxfl run`` on the real MNIST (60,000 training images, 1,000 shards
                     of two digits: the same digits per client as FedML's split, equal sizes instead of its power
                     law) in a fresh process, timed from start to exit, with no compile cache (a first run).
  flute_cnn_femnist  FLUTE's "CNN on FEMNIST": the EMNIST CNN with dropout (Reddi et al. 2021; jaxfl's
                     ``cnn_dropout``), 3,400 clients, 10 a round, batch 20, SGD lr 0.1, 1 epoch, 1,500 rounds.
                     FEMNIST is not on this machine: synthetic 28x28x1 inputs of 62 classes, 3,400 clients of
                     log-normal sizes (sigma 0.35) with the TFF EMNIST-62 mean (671,585 / 3,400 = 197.5
                     samples); time only (the accuracy of random inputs means nothing).
  pfl_cifar10        pfl-research's CIFAR-10 benchmark: IID, 1,000 users x 50 images, cohort 50, batch 10, 1 local
                     epoch, local SGD lr 0.1, central SGD lr 1 (plain FedAvg), 1,500 central iterations, its
                     ``simple_cnn`` (the same network as ``cnn_dropout`` at 32x32x3 and 10 classes). Synthetic
                     32x32x3 inputs (this machine's CIFAR-10 holds 10,000 training images, not 50,000); time only.

The synthetic settings run the engine as ``jaxfl run`` would on this machine (the ``Stacked`` backend, the
platform's default client strategy, the cohort split over one CPU device per core on a CPU): one untimed round
compiles, then ``--rounds`` rounds are timed (one call a round, synchronised at the end). When fewer rounds than
the setting's are timed, the full run's time is a projection (compile + rounds x mean round time) and is
labelled as one.

    python benchmarks/peer_settings.py --out benchmarks/results/peer_settings.json --md peer_settings.md
    python benchmarks/peer_settings.py --settings pfl_cifar10 --rounds 20 --out pfl.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: the library beside this script

import roofline  # noqa: E402  (imports jax only when called: the CPU devices are set up first)
from jaxfl.errors import ConfigError  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, parse_list, run_script  # noqa: E402

SETTINGS = {
    "flute_lr_mnist": dict(kind="cli", rounds=100, model="logreg", shape=(28, 28, 1), batch=10, lr=0.03, cli=[
        "--algorithm", "fedavg", "--dataset", "mnist", "--model", "logreg", "--num-clients", "1000",
        "--partition", "shards", "--classes-per-client", "2", "--clients-per-round", "10", "--batch-size", "10",
        "--lr", "0.03", "--momentum", "0", "--local-epochs", "1", "--rounds", "100", "--eval-every", "20"]),
    "flute_cnn_femnist": dict(kind="synthetic", rounds=1500, clients=3400, cohort=10, batch=20, lr=0.1,
                              shape=(28, 28, 1), classes=62, mean_size=197.5, sigma=0.35),
    "pfl_cifar10": dict(kind="synthetic", rounds=1500, clients=1000, cohort=50, batch=10, lr=0.1,
                        shape=(32, 32, 3), classes=10, mean_size=50, sigma=0.0),
}

# Published numbers: wall time of the whole run in seconds, accuracy in % where published, and where they are.
FLUTE_README = ("microsoft/msrflute README.md, section \"Benchmarking\" (commit 0e8762b); settings in "
                "experiments/cv_lr_mnist and experiments/cv_cnn_femnist (commit 405ac09); hardware not stated")
PEERS = {
    "flute_lr_mnist": [
        dict(framework="FLUTE (NCCL), GPUs", seconds=95, accuracy=81, source=FLUTE_README + ", FedML table"),
        dict(framework="FedML 0.7.303 (MPI), GPUs", seconds=189, accuracy=81, source=FLUTE_README + ", FedML table"),
        dict(framework="FLUTE (Gloo), CPU", seconds=200, accuracy=80, source=FLUTE_README + ", Flower table"),
        dict(framework="Flower 1.0.0 (Ray), CPU", seconds=1814, accuracy=80, source=FLUTE_README + ", Flower table"),
        dict(framework="FLUTE, 4 GPUs", seconds=86, accuracy=81, source=FLUTE_README + ", Flower table"),
        dict(framework="Flower 1.0.0, 4 GPUs", seconds=3405, accuracy=79, source=FLUTE_README + ", Flower table"),
    ],
    "flute_cnn_femnist": [
        dict(framework="FLUTE (NCCL), GPUs", seconds=502, accuracy=83, source=FLUTE_README + ", FedML table"),
        dict(framework="FedML 0.7.303 (MPI), GPUs", seconds=20992, accuracy=83, source=FLUTE_README + ", FedML table"),
    ],
    # pfl-research reports its own and other frameworks' times in its paper (arXiv 2404.06430, Table 1; the
    # abstract: "7-72x faster than alternative open-source frameworks"); the table could not be read here.
    "pfl_cifar10": [],
}
PFL_CONFIG = ("apple/pfl-research benchmarks/image_classification/configs/baseline.yaml (commit 2c77da1) and "
              "benchmarks/model/pytorch/cnn.py (simple_cnn)")


def run_cli(setting: dict, data_dir: str) -> dict:
    """``jaxfl run`` in a fresh process on a temporary --out: wall seconds from start to exit, and the run's
    own record (rounds' seconds, compile seconds, accuracy at each evaluation, the roofline of its plain
    rounds)."""
    import numpy as np

    from jaxfl.models import build_model
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-c", "from jaxfl.run.cli import entry; entry()", "run", *setting["cli"],
               "--out", str(out), "--compile-cache", "none"]
        env = dict(os.environ, JAXFL_DATA_DIR=data_dir)
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise RuntimeError(f"jaxfl run failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [h for h in history if "weighted_accuracy" in h]
    # the roofline over the rounds that neither compile nor evaluate (their time is training's)
    plain = [h for h in history if "weighted_accuracy" not in h and h["compile_s"] == 0.0]
    sps = sum(sum(h["train_samples"]) for h in plain) / max(sum(h["time_s"] for h in plain), 1e-12)
    cost = roofline.train_step_cost(build_model(setting["model"], 10), np.zeros((1,) + setting["shape"], np.uint8),
                                    setting["batch"], setting["lr"])
    return {"command": "jaxfl run " + " ".join(setting["cli"]) + " --out OUT --compile-cache none",
            "wall_s": wall, "rounds_s": sum(h.get("time_s", 0.0) for h in history),
            "compile_s": sum(h.get("compile_s", 0.0) for h in history), "rounds_run": len(history),
            "plain_round_s": sum(h["time_s"] for h in plain) / max(len(plain), 1), "plain_rounds": len(plain),
            "samples_per_s": sps, "train_step_cost": cost,
            **roofline.roofline(sps, cost, roofline.machine_peaks()), "projected": False,
            "accuracy_by_round": {h["round"]: 100 * h["weighted_accuracy"] for h in evals},
            "accuracy": 100 * evals[-1]["weighted_accuracy"],
            "accuracy_statistic": "sample-weighted test accuracy over the clients' test splits, last round"}


def synthetic_population(setting: dict, seed: int = 0):
    """RaggedClients of uint8 images of ``shape`` and uniform labels, with client sizes log-normal around
    ``mean_size`` (sigma 0: all equal)."""
    import numpy as np

    from jaxfl.data.ragged import RaggedClients
    rng = np.random.default_rng(seed)
    n, sigma = setting["clients"], setting["sigma"]
    median = setting["mean_size"] / np.exp(sigma ** 2 / 2)
    counts = np.maximum(1, np.round(median * np.exp(sigma * rng.standard_normal(n)))).astype(np.int64)
    total = int(counts.sum())
    x = rng.integers(0, 256, (total,) + tuple(setting["shape"]), dtype=np.uint8)
    y = rng.integers(0, setting["classes"], total).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return RaggedClients(x, y, offsets, counts)


def run_synthetic(setting: dict, rounds: int) -> dict:
    """The engine on a synthetic population: one untimed round (compiles), then ``rounds`` timed rounds."""
    import jax
    import numpy as np

    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.backends import Stacked
    from jaxfl.core.cohort import client_map, default_strategy
    from jaxfl.core.distributed import client_mesh
    from jaxfl.core.trainer import LocalTrainer, client_optimizer
    from jaxfl.models import build_model
    from jaxfl.run.build import resolve_devices

    data = synthetic_population(setting)
    cohort = setting["cohort"]
    devices = resolve_devices(None, cohort, "fixed")
    model = build_model("cnn_dropout", setting["classes"])
    alg = build_algorithm("fedavg", model,
                          LocalTrainer(client_optimizer("sgd", setting["lr"]), setting["batch"], 1))
    sim = Stacked(alg, data, batch_size=setting["batch"], cohort_size=cohort,
                  clients=client_map(default_strategy(), mesh=client_mesh(devices) if devices > 1 else None))
    server, store = sim.init(jax.random.key(0), data.x[:1])
    root = jax.random.key(1)
    t = time.perf_counter()
    server, _ = sim.round(server, store, 0, root)
    jax.block_until_ready(server)
    compile_s = time.perf_counter() - t
    seen = []
    t = time.perf_counter()
    for r in range(1, rounds + 1):
        server, m = sim.round(server, store, r, root)
        seen.append(m["seen"])  # (device arrays: read after the timing)
    jax.block_until_ready(server)
    round_s = (time.perf_counter() - t) / rounds
    samples = float(sum(np.sum(np.asarray(v)) for v in seen))
    full = setting["rounds"]
    cost = roofline.train_step_cost(model, data.x[:1], setting["batch"], setting["lr"])
    return {"devices": devices, "strategy": default_strategy(), "population_samples": int(data.counts.sum()),
            "compile_s": compile_s, "round_s": round_s, "rounds_timed": rounds,
            "wall_s": compile_s + round_s * (full - 1), "projected": rounds + 1 < full,
            "mean_client_size": float(np.mean(data.counts)), "samples_per_s": samples / rounds / round_s,
            "train_step_cost": cost, **roofline.roofline(samples / rounds / round_s, cost, roofline.machine_peaks())}


def markdown(results: dict) -> str:
    rows = ["| setting | jaxfl: whole run s | jaxfl: round s | FLOP/s / peak | bytes/s / peak | accuracy % | peer | "
            "peer s | peer accuracy % | jaxfl speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["settings"].items():
        mine = r["jaxfl"]
        wall = f"{mine['wall_s']:.1f}" + (" (projected)" if mine["projected"] else "")
        # (a CLI run: the mean of its rounds that neither compile nor evaluate)
        per_round = mine.get("round_s", mine.get("plain_round_s"))
        acc = f"{mine['accuracy']:.1f}" if "accuracy" in mine else "-"
        peers = PEERS[name] or [dict(framework="(not read here)", seconds=None, accuracy=None)]
        for p in peers:
            ratio = f"{p['seconds'] / mine['wall_s']:.1f}x" if p["seconds"] else "-"
            fractions = " | ".join(f"{mine[k]:.4f}" if k in mine else "-" for k in ("flops_fraction", "bytes_fraction"))
            rows.append(f"| {name} | {wall} | {per_round:.4f} | {fractions} | {acc} | {p['framework']} | "
                        f"{p['seconds'] if p['seconds'] else '-'} | {p['accuracy'] if p['accuracy'] else '-'} | "
                        f"{ratio} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--rounds", type=int, default=20,
                   help="synthetic settings: rounds timed after the compiling one (the rest is projected)")
    p.add_argument("--out", required=True, help="JSON of the results (rewritten after every setting)")
    p.add_argument("--md", default=None, help="also write the table here")
    args = p.parse_args(argv)
    names = parse_list(args.settings, "--settings", choices=tuple(SETTINGS))
    check_at_least("--rounds", args.rounds, 1)
    check_output_file(args.out, "--out")
    check_output_file(args.md, "--md")
    data_dir = os.environ.get("JAXFL_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    if "flute_lr_mnist" in names and not Path(data_dir, "digits", "mnist_train.npz").is_file():
        raise ConfigError(f"flute_lr_mnist reads MNIST from JAXFL_DATA_DIR={data_dir!r}, which has no "
                          f"digits/mnist_train.npz; set JAXFL_DATA_DIR or leave the setting out of --settings")
    # one CPU device per core, as `jaxfl run` asks for, before jax starts
    from jaxfl.core.distributed import cpu_cores, use_cpu_devices
    use_cpu_devices(cpu_cores())
    import jax
    results = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
               "cpu": platform.processor() or platform.machine(), "cores": cpu_cores(), "jax": jax.__version__,
               "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip(),
               "pfl_research_config": PFL_CONFIG, "settings": {}}
    for name in names:
        setting = SETTINGS[name]
        mine = run_cli(setting, data_dir) if setting["kind"] == "cli" else run_synthetic(setting, args.rounds)
        results["settings"][name] = {"setting": {k: v for k, v in setting.items() if k != "cli"},
                                     "jaxfl": mine, "peers": PEERS[name]}
        print(name, json.dumps(mine), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
