"""Evaluation time against the evaluation batch size: seconds per real test sample of ``Evaluator.metrics``
(``--algorithm``, FedAvg by default: every client's model on its own test set, clients one at a time under
``map``, one device) for each model and batch size, on equal test sets that every size divides (no partial
batch: the batch size alone changes).

Synthetic uint8 inputs (speed does not depend on their content) of the shape the model's data set has
(28x28x1 for the MNIST models, 32x32x3 for the CIFAR ones, 64x64x3 for AlexNet (PACS); ``--input-shape`` sets
another, e.g. 28,28,3 for ``digits``), ``--clients`` clients of ``--per-client`` test samples; each size's
evaluator is compiled once, then the sizes run in turn ``--reps`` times (a load change falls on all of them);
reported: the median seconds per real sample and the least, and each size's time over the fastest size's.

    python benchmarks/eval_batch.py --models fedavg_cnn,vit_tiny --sizes 16,32,64,128,256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxfl.algorithms import build_algorithm, options_class  # noqa: E402
from jaxfl.core.evaluate import Evaluator  # noqa: E402
from jaxfl.core.step import init_state  # noqa: E402
from jaxfl.core.trainer import LocalTrainer, normalizer  # noqa: E402
from jaxfl.core.trees import count_params  # noqa: E402
from jaxfl.core.types import RunContext  # noqa: E402
from jaxfl.data.ragged import RaggedClients  # noqa: E402
from jaxfl.errors import ConfigError  # noqa: E402
from jaxfl.models import MODELS, build_model  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, parse_list, run_script  # noqa: E402

CIFAR_MODELS = ("vit_tiny", "vit_small", "resnet10_slim", "resnet10", "resnet18", "resnet18_imagenet", "digits_cnn")
PACS_MODELS = ("alexnet_bn",)  # (63x63 at least: PACS's 64x64)


def input_shape(model: str) -> tuple[int, ...]:
    if model in PACS_MODELS:
        return (64, 64, 3)
    return (32, 32, 3) if model in CIFAR_MODELS else (28, 28, 1)


def measure(model_name: str, sizes: list[int], clients: int, per_client: int, reps: int,
            algorithm: str = "fedavg", shape: tuple[int, ...] | None = None) -> dict:
    rng = np.random.default_rng(0)
    total = clients * per_client
    shape = shape or input_shape(model_name)
    x = rng.integers(0, 256, (total,) + shape, dtype=np.uint8)
    y = rng.integers(0, 10, total).astype(np.int32)
    test = RaggedClients(x, y, np.arange(clients) * per_client, np.full(clients, per_client))
    alg = build_algorithm(algorithm, build_model(model_name, 10), LocalTrainer(None, 10, 1),
                          RunContext(num_clients=clients, num_rounds=1))
    server, states = init_state(alg, jax.random.key(0), test.x[:1], clients)
    evaluators = {b: Evaluator(alg, test, eval_batch_size=b, preprocess=normalizer(), clients="map") for b in sizes}
    for ev in evaluators.values():  # compile
        ev.metrics(server, states)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(reps):
        for b, ev in evaluators.items():
            t = time.perf_counter()
            ev.metrics(server, states)  # (returns numpy: the evaluation is done)
            times[b].append((time.perf_counter() - t) / total)
    med = {b: float(np.median(v)) for b, v in times.items()}
    best = min(med.values())
    # the parameters held for one client's evaluation: the server's and the client's own state's
    return {"model": model_name, "algorithm": algorithm, "input_shape": list(shape),
            "parameters": count_params(server) + count_params(states) // clients, "clients": clients,
            "per_client": per_client, "reps": reps,
            "sizes": {str(b): {"median_s_per_sample": med[b], "min_s_per_sample": float(min(times[b])),
                               "over_fastest": med[b] / best} for b in sizes},
            "fastest": min(med, key=med.get)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="logreg,mlp_2nn,fedavg_cnn,femnist_cnn,vit_tiny,vit_small,resnet10_slim")
    p.add_argument("--sizes", default="16,32,64,128,256")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=256, help="test samples a client (every size must divide it)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--algorithm", default="fedavg", help="the algorithm whose evaluation is timed")
    p.add_argument("--input-shape", default=None, help="H,W,C of the inputs (default: the model's data set's)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    models = parse_list(a.models, "--models", choices=tuple(MODELS))
    sizes = parse_list(a.sizes, "--sizes", kind=int)
    check_at_least("--sizes", sizes, 1)
    for flag, v in (("--clients", a.clients), ("--per-client", a.per_client), ("--reps", a.reps)):
        check_at_least(flag, v, 1)
    if any(a.per_client % b for b in sizes):
        raise ConfigError(f"--per-client {a.per_client}: give a multiple of every --sizes value ({a.sizes})")
    options_class(a.algorithm)  # (an unknown name: one line listing the valid ones)
    shape = None if a.input_shape is None else tuple(parse_list(a.input_shape, "--input-shape", kind=int))
    if shape is not None:
        check_at_least("--input-shape", shape, 1)
        if len(shape) != 3:
            raise ConfigError(f"--input-shape {a.input_shape!r}: give three sizes, H,W,C")
    check_output_file(a.json, "--json")
    results = {"device": jax.devices()[0].device_kind, "machine": platform.processor() or platform.machine(),
               "jax": jax.__version__, "command": "benchmarks/eval_batch.py " + " ".join(
                   argv if argv is not None else sys.argv[1:]), "models": []}
    print("| model | " + " | ".join(f"B = {b}: us a sample (x fastest)" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for m in models:
        r = measure(m, sizes, a.clients, a.per_client, a.reps, a.algorithm, shape)
        results["models"].append(r)
        cells = [f"{v['median_s_per_sample'] * 1e6:.0f} ({v['over_fastest']:.2f})" for v in r["sizes"].values()]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
