"""Time to accuracy: FedAvg on MNIST in the FedAvg paper's settings, jaxfl's engine against a PyTorch loop.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data" (AISTATS,
arXiv 1602.05629): 100 clients of 600 MNIST training images, a cohort of C = 0.1 (10 clients per round,
uniformly without replacement), sample-weighted FedAvg, plain SGD (no momentum), fresh client optimizer each
round. The settings (``SETTINGS``):

  2nn_iid      2NN (784-200-200-10), E = 1, B = 10, IID (shuffle, 100 x 600)          target 97 %
  2nn_noniid   2NN, E = 1, B = 10, non-IID: sorted by label, 200 shards of 300, two per client   target 97 %
  cnn_iid      CNN (conv5x5 32, pool, conv5x5 64, pool, 512, 10), E = 5, B = 10, IID   target 99 %

For each setting, framework and learning rate of the grid it runs rounds until the global model's accuracy on
the full 10,000-image MNIST test set (evaluated after every round) reaches the target, or ``--max-rounds``, and
reports the rounds to the target, the wall seconds of those rounds (training and aggregation only: evaluation
is not counted, nor compilation, which one untimed warm-up round does before the clock starts and which is
reported as ``compile_s``), seconds per round and the accuracies. The best learning rate of a grid is the one
that reaches the target in the fewest rounds (then the fewest seconds); the paper also tuned the learning rate
per entry over a grid. The frameworks:

  jaxfl   the engine: ``Stacked`` backend (population on the device, one jitted call per round that draws the
          cohort, trains it and aggregates), ``fedavg`` from the registry, ``LocalTrainer`` with
          ``client_optimizer("sgd", lr)`` (DataLoader-like: a fresh shuffle per epoch, the last batch partial)
  jaxfl_d2  the same with the cohort split over 2 devices (on a CPU: 2 CPU devices, one per core, what
          ``jaxfl run --devices 2`` does; asked for before jax starts)
  torch   a plain PyTorch loop, client after client: load the global state, a fresh ``torch.optim.SGD``, E epochs
          over ``torch.randperm`` minibatches of B (drop_last False), then the sample-weighted average;
          ``torch.set_num_threads(--threads)``; the clients' float tensors are made (and, where CUDA is
          available, moved to the GPU, where the loop then runs, each round synchronised) before timing

Both see the same partition, the same cohorts (``jaxfl.core.cohort.sample_cohort``), the same initial weights
(jaxfl's init copied into the torch model) and the same inputs x / 255.

The paper's rounds to the target (``PAPER``): Table 1 (effect of C; 2NN with E = 1, CNN with E = 5) and Table 2
(rounds for FedAvg per (E, B)), for C = 0.1 and B = 10; see the comments there for the rows used.

    python benchmarks/time_to_accuracy.py --smoke --out /tmp/tta_smoke.json --md /tmp/tta_smoke.md   # plumbing
    python benchmarks/time_to_accuracy.py --settings 2nn_iid,2nn_noniid,cnn_iid --frameworks jaxfl,torch \\
        --out benchmarks/results/time_to_accuracy.json --md benchmarks/results/time_to_accuracy.md --resume
    python benchmarks/time_to_accuracy.py --settings cnn_iid --lrs 0.05,0.1 --max-rounds 60 --out cnn.json

Each entry also carries its roofline (``roofline.py``: the timed rounds' real samples, every local epoch, over
their seconds, under XLA's cost of one training step, against the machine's measured peaks). The JSON is
rewritten after every (setting, framework, lr); ``--resume`` skips the entries it already holds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # throughput.py: the torch models
import roofline  # noqa: E402  (imports jax only when called: --frameworks jaxfl_d2 sets the devices first)
from torch_fedavg import torch_fedavg_round  # noqa: E402

# Rounds to the target reported by McMahan et al. 2017 (arXiv 1602.05629), C = 0.1, B = 10. ``rounds`` is the
# number the table shows against ``source``; ``other`` the same setting's entry in the other table (None:
# not retrieved here, so not reported).
PAPER = {
    # Table 1 (2NN, E = 1, target 97 %), row C = 0.1, column IID B = 10: 87 rounds.
    "2nn_iid": dict(rounds=87, source="Table 1: 2NN E=1, C=0.1, IID, B=10",
                    other=dict(rounds=None, source="Table 2: 2NN FedAvg E=1 B=10 (u=60), IID")),
    # Table 1 (2NN, E = 1, target 97 %), row C = 0.1, column non-IID B = 10: 664 rounds.
    "2nn_noniid": dict(rounds=664, source="Table 1: 2NN E=1, C=0.1, non-IID, B=10",
                       other=dict(rounds=None, source="Table 2: 2NN FedAvg E=1 B=10 (u=60), non-IID")),
    # Table 2 (CNN, target 99 %), row FedAvg E = 5, B = 10 (u = 300), column IID: 20 rounds (31.3x FedSGD's 626).
    "cnn_iid": dict(rounds=20, source="Table 2: CNN FedAvg E=5 B=10 (u=300), IID",
                    other=dict(rounds=None, source="Table 1: CNN E=5, C=0.1, IID, B=10")),
}

SETTINGS = {
    "2nn_iid": dict(model="mlp_2nn", partition="iid", epochs=1, batch=10, target=0.97, max_rounds=300,
                    lrs=(0.05, 0.1, 0.2)),
    "2nn_noniid": dict(model="mlp_2nn", partition="shards", epochs=1, batch=10, target=0.97, max_rounds=1500,
                       lrs=(0.05, 0.1, 0.2)),
    "cnn_iid": dict(model="fedavg_cnn", partition="iid", epochs=5, batch=10, target=0.99, max_rounds=100,
                    lrs=(0.05, 0.1, 0.2)),
}
POPULATION = dict(clients=100, per_client=600, fraction=0.1, shards_per_client=2, test=None)
SMOKE = dict(clients=10, per_client=60, fraction=0.2, shards_per_client=2, test=1000, rounds=2)
FRAMEWORKS = ("jaxfl", "jaxfl_d2", "torch")
EVAL_BATCH = 500


# ---- data --------------------------------------------------------------------------------------------

def load_mnist(data_dir=None):
    """((x_train uint8 [60000, 28, 28, 1], y_train), (x_test, y_test)) from $JAXFL_DATA_DIR/digits."""
    from jaxfl.data.sources import data_dir as resolve, load_npz
    root = resolve(data_dir)
    return load_npz(root, "digits", "mnist", "train", 10), load_npz(root, "digits", "mnist", "test", 10)


def client_parts(labels, partition: str, pop: dict, seed: int):
    """Per-client training indices: ``iid`` (shuffle, equal parts) or ``shards`` (``label_shards``). With fewer
    samples than clients x per_client (the smoke run) a seeded subset of that size is split."""
    import numpy as np

    from jaxfl.data.partition import iid, label_shards
    rng = np.random.default_rng(seed)
    n = pop["clients"] * pop["per_client"]
    pool = np.arange(len(labels)) if n >= len(labels) else np.sort(rng.choice(len(labels), n, replace=False))
    if partition == "iid":
        parts = iid(labels[pool], pop["clients"], rng)
    else:
        parts = label_shards(labels[pool], pop["clients"], pop["shards_per_client"], rng)
    return [pool[p] for p in parts]


def population(x, y, parts):
    from jaxfl.data.ragged import RaggedClients
    return RaggedClients.from_clients([(x[p], y[p]) for p in parts])


def cohort_ids(seed: int, rounds: int, n: int, k: int):
    """The cohorts of rounds 0 .. rounds-1 as the engine draws them (root key = key(seed + 1))."""
    import jax
    import numpy as np

    from jaxfl.core.cohort import sample_cohort
    root = jax.random.key(seed + 1)
    return [np.asarray(sample_cohort(root, r, n, k)) for r in range(rounds)]


# ---- the round loop shared by both frameworks ----------------------------------------------------------

def track(step, accuracy, state, rounds: int, target: float, stop: bool, label: str = "") -> dict:
    """Run ``state = step(r, state)`` for r = 0.. (timed), then ``accuracy(state)`` (not timed), until the
    accuracy first reaches ``target`` (if ``stop``) or ``rounds`` rounds."""
    accs, secs, hit = [], [], None
    for r in range(rounds):
        t = time.perf_counter()
        state = step(r, state)
        secs.append(time.perf_counter() - t)
        accs.append(accuracy(state))
        if hit is None and accs[-1] >= target:
            hit = r + 1
        if label and (r % 25 == 24 or hit == r + 1 or r == rounds - 1):
            print(f"  {label} round {r + 1}: acc {accs[-1]:.4f}, {secs[-1]:.3f} s", file=sys.stderr, flush=True)
        if stop and hit:
            break
    return {"rounds_to_target": hit, "seconds_to_target": sum(secs[:hit]) if hit else None,
            "rounds_run": len(accs), "sec_per_round": sum(secs) / len(secs), "train_s": sum(secs),
            "final_accuracy": accs[-1], "best_accuracy": max(accs), "accuracy": accs, "round_s": secs}


# ---- jaxfl ---------------------------------------------------------------------------------------------

def preprocess():
    from jaxfl.core.trainer import normalizer
    return normalizer(0.0, 1.0)  # x / 255


def jaxfl_algorithm(model_name: str, lr: float, batch: int, epochs: int):
    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.trainer import LocalTrainer, client_optimizer
    from jaxfl.models import build_model
    trainer = LocalTrainer(client_optimizer("sgd", lr), batch, epochs, preprocess=preprocess())
    return build_algorithm("fedavg", build_model(model_name, 10), trainer)


def initial_params(model_name: str, seed: int, sample_x):
    """The initial global parameters jaxfl's run starts from (``Algorithm.init`` with key(seed)), as numpy."""
    import jax
    import numpy as np
    server, _ = jaxfl_algorithm(model_name, 0.1, 10, 1).init(jax.random.key(seed), sample_x[:1])
    return jax.tree_util.tree_map(np.asarray, server["params"])


def run_jaxfl(cfg: dict, train, test, lr: float, k: int, rounds: int, seed: int, stop: bool, label="",
              devices: int = 1) -> dict:
    """FedAvg rounds on the ``Stacked`` backend (the cohort split over ``devices``); accuracy by jaxfl's
    ``Evaluator`` on the one test client."""
    import jax

    from jaxfl.core.backends import Stacked
    from jaxfl.core.cohort import client_map
    from jaxfl.core.distributed import client_mesh
    from jaxfl.core.evaluate import Evaluator
    alg = jaxfl_algorithm(cfg["model"], lr, cfg["batch"], cfg["epochs"])
    sim = Stacked(alg, train, batch_size=cfg["batch"], cohort_size=k,
                  clients=client_map(None, mesh=client_mesh(devices) if devices > 1 else None))
    server, store = sim.init(jax.random.key(seed), train.x[:1])
    root = jax.random.key(seed + 1)
    evaluator = Evaluator(alg, test, eval_batch_size=EVAL_BATCH, preprocess=preprocess())
    t = time.perf_counter()
    sim.round(server, store, 0, root)  # compile (FedAvg keeps no client state: the store is unchanged)
    compile_s = time.perf_counter() - t

    def step(r, server):
        return sim.round(server, store, r, root)[0]

    def accuracy(server):
        return float(evaluator.metrics(server, store)["accuracy"][0])

    out = track(step, accuracy, server, rounds, cfg["target"], stop, label)
    return dict(out, compile_s=compile_s, strategy=sim.strategy, devices=devices, device=jax.devices()[0].device_kind,
                backend=jax.default_backend(), jax=jax.__version__)


# ---- torch ---------------------------------------------------------------------------------------------

def torch_net(model_name: str):
    """throughput.py's PyTorch 2NN / FedAvg CNN (the same architectures as jaxfl.models)."""
    import throughput
    if model_name == "mlp_2nn":
        return throughput.torch_small_model({"model": "mlp_2nn", "classes": 10})
    return throughput.torch_model(model_name, (28, 28, 1))


def torch_state_from_flax(model_name: str, params) -> dict:
    """jaxfl parameters -> the torch model's state dict (numpy): Dense kernels [in, out] -> weight [out, in],
    conv kernels HWIO -> OIHW, and the CNN's first Dense rows from NHWC (h, w, c) to NCHW (c, h, w) order."""
    enc, head = params["encoder"], params["head"]["fc1"]["linear"]
    if model_name == "mlp_2nn":
        layers = {"1": enc["fc1"]["linear"], "3": enc["fc2"]["linear"], "5": head}
        return {f"{i}.{n}": (d["kernel"].T if n == "weight" else d["bias"]) for i, d in layers.items()
                for n in ("weight", "bias")}
    fc = enc["fc"]["linear"]
    side, width = 7, enc["conv2"]["kernel"].shape[-1]
    fc_w = fc["kernel"].reshape(side, side, width, -1).transpose(2, 0, 1, 3).reshape(side * side * width, -1).T
    return {"0.weight": enc["conv1"]["kernel"].transpose(3, 2, 0, 1), "0.bias": enc["conv1"]["bias"],
            "3.weight": enc["conv2"]["kernel"].transpose(3, 2, 0, 1), "3.bias": enc["conv2"]["bias"],
            "7.weight": fc_w, "7.bias": fc["bias"], "9.weight": head["kernel"].T, "9.bias": head["bias"]}


def torch_images(x):
    """uint8 NHWC -> float32 NCHW tensor x / 255."""
    import numpy as np
    import torch
    return torch.from_numpy(x.astype(np.float32) / 255.0).permute(0, 3, 1, 2).contiguous()


def torch_inputs(x, y, parts) -> list:
    """Per part, (images float32 NCHW x / 255, labels int64) tensors, made once before any timing."""
    import numpy as np
    import torch
    return [(torch_images(x[q]), torch.from_numpy(y[q].astype(np.int64))) for q in parts]


def torch_round(model, global_state: dict, clients, ids, lr: float, batch: int, epochs: int, seed: int, r: int):
    """One FedAvg round, client after client (``torch_fedavg_round``), each client's batch order from its own
    seeded generator on the clients' device (on a GPU no index crosses from the host); returns the new global
    state."""
    import torch
    device = clients[0][1].device
    gen = lambda i: torch.Generator(device=device).manual_seed((seed * 1_000_003 + r) * 100_003 + i)
    return torch_fedavg_round(model, global_state, clients, ids, lr, batch, epochs, generator=gen)


def torch_accuracy(model, state: dict, x, y, batch: int = 1000) -> float:
    import torch
    model.load_state_dict(state)
    correct = 0
    with torch.no_grad():
        for s in range(0, len(y), batch):
            correct += int((model(x[s:s + batch]).argmax(1) == y[s:s + batch]).sum())
    return correct / len(y)


def run_torch(cfg: dict, clients, test, init, lr: float, cohorts, seed: int, threads: int, stop: bool,
              label="") -> dict:
    """FedAvg rounds in the PyTorch loop from jaxfl's initial weights ``init`` (numpy state dict)."""
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine, the loop runs on the GPU too
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)  # a round's time includes its kernels
    model = torch_net(cfg["model"]).to(dev)
    state = {k: torch.from_numpy(np.array(v, np.float32)).to(dev) for k, v in init.items()}
    clients = [(x.to(dev), y.to(dev)) for x, y in clients]  # (once, before any timing)
    x_test, y_test = (v.to(dev) for v in test)
    b, e = cfg["batch"], cfg["epochs"]
    t = time.perf_counter()
    torch_round(model, state, clients, cohorts[0], lr, b, e, seed, -1)  # warm-up, discarded
    sync()
    warm_s = time.perf_counter() - t

    def step(r, state):
        new = torch_round(model, state, clients, cohorts[r], lr, b, e, seed, r)
        sync()
        return new

    out = track(step, lambda s: torch_accuracy(model, s, x_test, y_test), state, len(cohorts), cfg["target"],
                stop, label)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    return dict(out, compile_s=0.0, warmup_s=warm_s, threads=torch.get_num_threads(), torch=torch.__version__,
                torch_device=device)


def same_model_check(model_name: str, init, x) -> float:
    """Max |logits| difference of jaxfl's and torch's models from the same weights on images x (a sanity
    check of ``torch_state_from_flax``)."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jaxfl.models import build_model
    ours = build_model(model_name, 10).apply({"params": init}, preprocess()(jnp.asarray(x)), train=False)
    model = torch_net(model_name)
    state = torch_state_from_flax(model_name, init)
    model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()})
    with torch.no_grad():
        theirs = model(torch_images(x)).numpy()
    return float(np.max(np.abs(np.asarray(ours) - theirs)))


# ---- the plan, results and report ---------------------------------------------------------------------

def entry_key(e: dict) -> tuple:
    return (e["setting"], e["framework"], float(e["lr"]), bool(e["smoke"]), int(e["seed"]))


def finished(e: dict, max_rounds: int) -> bool:
    return e["rounds_to_target"] is not None or e["rounds_run"] >= max_rounds


def best_entry(entries: list[dict]) -> dict:
    """The lr that reached the target in the fewest rounds (then seconds); else the highest accuracy."""
    hit = [e for e in entries if e["rounds_to_target"] is not None]
    if hit:
        return min(hit, key=lambda e: (e["rounds_to_target"], e["seconds_to_target"]))
    return max(entries, key=lambda e: e["best_accuracy"])


def step_cost(cfg: dict, x) -> dict:
    """``roofline.train_step_cost`` of the setting's model at its batch size on MNIST images like ``x``'s."""
    from jaxfl.models import build_model
    return roofline.train_step_cost(build_model(cfg["model"], 10), x[:1], cfg["batch"])


def write_json(path: str, meta: dict, entries: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "entries": entries}, f, indent=1)
    os.replace(tmp, path)


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def devices_note(entries: list[dict]) -> str:
    """" jaxfl on X; torch on Y." from the entries' devices (older entries lack ``torch_device``: the CPU)."""
    jax_dev = sorted({e["device"] for e in entries if e["framework"].startswith("jaxfl") and "device" in e})
    torch_dev = sorted({e.get("torch_device", "cpu") for e in entries if e["framework"] == "torch"})
    parts = [f"{name} on {', '.join(d)}" for name, d in (("jaxfl", jax_dev), ("torch", torch_dev)) if d]
    return f" {'; '.join(parts)}." if parts else ""


def report(entries: list[dict], meta: dict) -> str:
    """Markdown: one summary row per (setting, framework) at its best lr, then every lr."""
    lines = [f"Time to accuracy, FedAvg on MNIST (McMahan et al. 2017 settings): {meta['clients']} clients of "
             f"{meta['per_client']}, cohort {meta['cohort']} per round, SGD, evaluation on {meta['test']} test "
             f"images after every round. Wall seconds: the rounds' training + aggregation only (no evaluation, no "
             f"compilation). {meta['machine']}.{devices_note(entries)}", "",
             "| setting | framework | lr grid | best lr | rounds to target | paper rounds | wall s to target | "
             "s / round | FLOP/s / peak | compile s | final acc |", "|---" * 11 + "|"]
    groups: dict = {}
    for e in entries:
        groups.setdefault((e["setting"], e["framework"]), []).append(e)
    speed = {}
    for (setting, fw), es in groups.items():
        b = best_entry(es)
        grid = ", ".join(f"{x['lr']:g}" for x in sorted(es, key=lambda x: x["lr"]))
        rtt = (str(b["rounds_to_target"]) if b["rounds_to_target"] else f"not reached in {b['rounds_run']}")
        paper = PAPER[setting]
        lines.append(f"| {setting} (target {b['target']:.0%}) | {fw} | {grid} | {b['lr']:g} | {rtt} | "
                     f"{paper['rounds']} ({paper['source']}) | {fmt(b['seconds_to_target'], '.1f')} | "
                     f"{b['sec_per_round']:.3f} | {fmt(b.get('flops_fraction'), '.3f')} | {b['compile_s']:.1f} | "
                     f"{b['final_accuracy']:.4f} |")
        speed.setdefault(setting, {})[fw] = b["seconds_to_target"]
    ratios = [f"{s}: {v['torch'] / v[fw]:.2f}x ({fw})" for s, v in speed.items() for fw in ("jaxfl", "jaxfl_d2")
              if v.get(fw) and v.get("torch")]
    if ratios:
        lines += ["", "torch wall seconds to target / jaxfl's (each at its best lr): " + "; ".join(ratios)]
    lines += ["", "Every learning rate:", "",
              "| setting | framework | lr | rounds to target | rounds run | wall s to target | s / round | "
              "best acc | final acc |", "|---" * 9 + "|"]
    for e in sorted(entries, key=lambda e: (e["setting"], e["framework"], e["lr"])):
        lines.append(f"| {e['setting']} | {e['framework']} | {e['lr']:g} | {fmt(e['rounds_to_target'], 'd')} | "
                     f"{e['rounds_run']} | {fmt(e['seconds_to_target'], '.1f')} | {e['sec_per_round']:.3f} | "
                     f"{e['best_accuracy']:.4f} | {e['final_accuracy']:.4f} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores visible, {usable} usable by this process "
            f"(taskset), {platform.python_version()}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--frameworks", default="jaxfl,torch",
                   help=f"comma-separated, of {', '.join(FRAMEWORKS)} (jaxfl_d2 needs 2 devices: 2 CPU cores)")
    p.add_argument("--lrs", default=None, help="comma-separated learning rates for every setting "
                                                "(default: the setting's grid, 0.05,0.1,0.2)")
    p.add_argument("--max-rounds", type=int, default=None,
                   help="rounds at most per run (default: per setting, 300 / 1500 / 100)")
    p.add_argument("--no-stop", action="store_true", help="keep training to --max-rounds after the target")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="default: $JAXFL_DATA_DIR")
    p.add_argument("--out", default="time_to_accuracy.json", help="JSON results, rewritten after every run")
    p.add_argument("--md", default=None, help="also write the markdown report here")
    p.add_argument("--resume", action="store_true", help="keep --out's finished entries and skip them")
    p.add_argument("--smoke", action="store_true",
                   help="plumbing check: 10 clients of 60, 2 rounds, one lr, 1,000 test images")
    args = p.parse_args(argv)
    from jaxfl.run.script import check_at_least, check_output_file, parse_list
    parse_list(args.settings, "--settings", choices=tuple(SETTINGS))
    parse_list(args.frameworks, "--frameworks", choices=FRAMEWORKS)
    if args.lrs:
        check_at_least("--lrs", parse_list(args.lrs, "--lrs", float), 0, strict=True)
    check_at_least("--max-rounds", args.max_rounds, 1)
    check_at_least("--threads", args.threads, 1)
    check_output_file(args.out, "--out")
    check_output_file(args.md, "--md")
    if "jaxfl_d2" in args.frameworks.split(","):
        from jaxfl.core.distributed import use_cpu_devices
        use_cpu_devices(2)  # before jax starts (on a machine with an accelerator, its devices are used)

    import numpy as np
    pop = SMOKE if args.smoke else POPULATION
    k = max(1, round(pop["fraction"] * pop["clients"]))
    (x, y), (xt, yt) = load_mnist(args.data_dir)
    if pop["test"]:
        xt, yt = xt[: pop["test"]], yt[: pop["test"]]
    from jaxfl.data.ragged import RaggedClients
    test = RaggedClients(xt, yt.astype(np.int32), np.zeros(1, np.int64), np.array([len(yt)], np.int64))
    meta = {"clients": pop["clients"], "per_client": pop["per_client"], "cohort": k, "test": len(yt),
            "machine": machine(), "command": " ".join(sys.argv), "paper": PAPER, "settings": SETTINGS,
            "smoke": args.smoke}
    entries = []
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            entries = json.load(f)["entries"]
    for setting in args.settings.split(","):
        cfg = SETTINGS[setting]
        lrs = [float(v) for v in args.lrs.split(",")] if args.lrs else list(cfg["lrs"])
        lrs = lrs[:1] if args.smoke else lrs
        rounds = SMOKE["rounds"] if args.smoke else args.max_rounds or cfg["max_rounds"]
        parts = client_parts(y, cfg["partition"], pop, args.seed)
        train = population(x, y, parts)
        cohorts = cohort_ids(args.seed, rounds, len(parts), k)
        init = initial_params(cfg["model"], args.seed, x)
        torch_data, cost = None, None
        for fw in args.frameworks.split(","):
            for lr in lrs:
                key = (setting, fw, lr, args.smoke, args.seed)
                done = [e for e in entries if entry_key(e) == key]
                if done and finished(done[0], rounds):
                    print(f"{setting} {fw} lr {lr:g}: done, skipped", file=sys.stderr)
                    continue
                entries = [e for e in entries if entry_key(e) != key]
                label = f"{setting} {fw} lr {lr:g}"
                load = os.getloadavg()[0]  # other jobs on the machine slow both, torch's 2 OpenMP threads most
                if fw.startswith("jaxfl"):
                    res = run_jaxfl(cfg, train, test, lr, k, rounds, args.seed, not args.no_stop, label,
                                    devices=2 if fw == "jaxfl_d2" else 1)
                else:
                    if torch_data is None:
                        torch_data = torch_inputs(x, y, parts), torch_inputs(xt, yt, [np.arange(len(yt))])[0]
                        meta.setdefault("init_logits_max_diff", {})[setting] = same_model_check(
                            cfg["model"], init, xt[:64])
                    res = run_torch(cfg, torch_data[0], torch_data[1], torch_state_from_flax(cfg["model"], init),
                                    lr, cohorts, args.seed, args.threads, not args.no_stop, label)
                # the roofline of the timed rounds: their real samples (every local epoch) over their seconds
                samples = cfg["epochs"] * sum(int(train.counts[cohorts[r]].sum()) for r in range(res["rounds_run"]))
                if cost is None:  # (once a setting: every framework and lr trains the same step)
                    cost = step_cost(cfg, x)
                res.update(samples_per_s=samples / res["train_s"], **roofline.roofline(
                    samples / res["train_s"], cost, roofline.machine_peaks()))
                entries.append(dict(res, setting=setting, framework=fw, lr=lr, smoke=args.smoke, seed=args.seed,
                                    target=cfg["target"], max_rounds=rounds, model=cfg["model"],
                                    partition=cfg["partition"], epochs=cfg["epochs"], batch=cfg["batch"],
                                    lr_grid=lrs, paper=PAPER[setting], loadavg=[load, os.getloadavg()[0]]))
                write_json(args.out, meta, entries)
                e = entries[-1]
                print(f"{label}: rounds to target {e['rounds_to_target']}, {fmt(e['seconds_to_target'], '.1f')} s, "
                      f"{e['sec_per_round']:.3f} s/round, final acc {e['final_accuracy']:.4f}", flush=True)
    text = report(entries, meta)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print("\n" + text)


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
