"""Partial last test batches at a smaller size (``Evaluator``'s ``tail_sizes``, the CLI's
``--eval-tail-batches``): one evaluation of every client with every test batch at B against the partial last
batches at the smallest size that holds them, of the eighths of B the clients' last test batches take.

Test sets of a label-skewed population as the CLI's Dirichlet partition gives them (``throughput.skewed_counts``
of ``--test-samples`` over ``--clients``: MNIST's 10,000 test images over 100 clients at alpha 0.3 are 19-306 a
client), synthetic 28x28x1 images (speed does not depend on their content), B = min(``--eval-batch-size``, the
largest test set) as the CLI sets it, FedAvg with ``--model``, one CPU device, clients one at a time (``map``):
``Evaluator.metrics`` over the population. The two evaluators run alternately, ``--reps`` times each after
compiling, so that a load change falls on both; reported: each one's median and least seconds, compile seconds
(the first call, minus a timed one), the computed/real test samples (``buckets.padded_work``) and the largest
difference of the per-client losses between them (float rounding).

    python benchmarks/eval_tails.py --model fedavg_cnn --clients 100 --alpha 0.3 --json out.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from throughput import skewed_counts, small_population  # noqa: E402

from jaxfl.algorithms import build_algorithm  # noqa: E402
from jaxfl.core.buckets import padded_work  # noqa: E402
from jaxfl.core.evaluate import Evaluator  # noqa: E402
from jaxfl.core.step import init_state  # noqa: E402
from jaxfl.core.trainer import LocalTrainer, normalizer  # noqa: E402
from jaxfl.core.types import RunContext  # noqa: E402
from jaxfl.models import MODELS, build_model  # noqa: E402
from jaxfl.run.build import tails_chosen  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, parse_list, run_script  # noqa: E402


def measure(model_name: str, clients: int, alpha: float, test_samples: int, eval_batch_size: int, reps: int) -> dict:
    counts = skewed_counts(alpha, clients, test_samples)
    test = small_population({"input": "image", "classes": 10}, counts)
    batch = min(eval_batch_size, int(counts.max()))
    model = build_model(model_name, 10)
    alg = build_algorithm("fedavg", model, LocalTrainer(None, 10, 1), RunContext(num_clients=clients))
    server, states = init_state(alg, jax.random.key(0), test.x[:1], clients)
    sizes = tails_chosen("on", counts, batch) or (batch,)  # the sizes the last test batches take
    evaluators = {"every batch at B": Evaluator(alg, test, eval_batch_size=batch, preprocess=normalizer(),
                                                clients="map"),
                  "tail sizes " + "/".join(map(str, sizes)):
                      Evaluator(alg, test, eval_batch_size=batch, preprocess=normalizer(), clients="map",
                                tail_sizes=sizes)}
    first, result = {}, {}
    for name, ev in evaluators.items():
        t = time.perf_counter()
        result[name] = ev.metrics(server, states)
        first[name] = time.perf_counter() - t
    times = {name: [] for name in evaluators}
    for _ in range(reps):  # alternately, so that a load change falls on both
        for name, ev in evaluators.items():
            t = time.perf_counter()
            ev.metrics(server, states)  # (returns numpy: the evaluation is done)
            times[name].append(time.perf_counter() - t)
    real = int(counts.sum())
    names = list(evaluators)
    work = {names[0]: padded_work([], counts, batch, per_client_trips=True)[0],
            names[1]: padded_work([], counts, batch, per_client_trips=True, tail_sizes=sizes)[0]}
    out = {}
    for name in names:
        median = float(np.median(times[name]))
        out[name] = {"median_s": median, "min_s": float(min(times[name])), "compile_s": first[name] - median,
                     "padded_work": work[name] / real, "real_samples_per_s": real / median}
    diff = float(np.max(np.abs(result[names[0]]["loss"] - result[names[1]]["loss"])))
    same_accuracy = bool(np.array_equal(result[names[0]]["accuracy"], result[names[1]]["accuracy"]))
    return {"model": model_name, "clients": clients, "alpha": alpha, "test_samples": test_samples,
            "eval_batch_size": batch, "test_sizes": [int(counts.min()), int(np.median(counts)), int(counts.max())],
            "reps": reps, "runs": out, "max_abs_loss_diff": diff, "same_accuracy": same_accuracy,
            "speedup_median": out[names[0]]["median_s"] / out[names[1]]["median_s"],
            "device": jax.devices()[0].device_kind, "machine": platform.processor() or platform.machine(),
            "jax": jax.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fedavg_cnn", help="a jaxfl model for 28x28x1 inputs and 10 classes")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--alpha", type=float, default=0.3, help="the Dirichlet label-skew concentration")
    p.add_argument("--test-samples", type=int, default=10_000, help="test samples over the population")
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    parse_list(a.model, "--model", choices=tuple(MODELS))
    for flag, v in (("--clients", a.clients), ("--test-samples", a.test_samples),
                    ("--eval-batch-size", a.eval_batch_size), ("--reps", a.reps)):
        check_at_least(flag, v, 1)
    check_at_least("--alpha", a.alpha, 0, strict=True)
    check_output_file(a.json, "--json")
    r = measure(a.model, a.clients, a.alpha, a.test_samples, a.eval_batch_size, a.reps)
    lo, mid, hi = r["test_sizes"]
    print(f"{a.model}, {a.clients} clients, test sets {lo}/{mid}/{hi} (least/median/largest), "
          f"B = {r['eval_batch_size']}")
    for name, v in r["runs"].items():
        print(f"{name}: median {v['median_s']:.3f} s, least {v['min_s']:.3f} s, compile {v['compile_s']:.2f} s, "
              f"padded/real {v['padded_work']:.3f}")
    print(f"speed-up (medians) {r['speedup_median']:.2f}x; largest per-client loss difference "
          f"{r['max_abs_loss_diff']:.2e}; accuracies equal: {r['same_accuracy']}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
