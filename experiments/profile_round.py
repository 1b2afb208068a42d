"""Where a round's time goes: training (the jitted round: local steps and aggregation) and
evaluation, each timed after a first pass that compiles it, at an experiment's settings.

    JAXFL_DATA_DIR=../shared/data python experiments/profile_round.py --algorithm rfeddis --dataset digits \\
        --set image_size=28 samples_per_client=743 lr=0.01 momentum=0 batch_size=32 --rounds 2

Prints one line per phase: compile seconds (first pass), median seconds per round over ``--rounds`` timed
rounds, and the host share the backend reports. ``--set name=value`` sets a RunConfig field or an option of the
algorithm (typed as the experiment scripts type their variants, ``common.parse_variant``).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from common import parse_variant  # the experiment scripts' "name:key=value" variants
from jaxfl.run.config import RunConfig
from jaxfl.run.runner import Experiment
from jaxfl.run.script import check_at_least


def block(tree):
    return jax.block_until_ready(tree)


def profile(cfg: RunConfig, rounds: int) -> dict:
    exp = Experiment(cfg)
    server, store = exp.init()
    t = time.perf_counter()
    server, ms = exp.run_rounds(server, store, 0, 1)  # compiles the round
    block(server)
    train_first = time.perf_counter() - t
    t = time.perf_counter()
    block(exp.evaluate(server, store))  # compiles the evaluation
    eval_first = time.perf_counter() - t
    train, evals, host = [], [], []
    for r in range(1, rounds + 1):
        t = time.perf_counter()
        server, ms = exp.run_rounds(server, store, r, 1)
        block(server)
        train.append(time.perf_counter() - t)
        host.append(float(ms[-1].get("host_share", float("nan"))))
        t = time.perf_counter()
        block(exp.evaluate(server, store))
        evals.append(time.perf_counter() - t)
    return {"algorithm": cfg.algorithm, "dataset": cfg.dataset, "backend": exp.backend_name,
            "strategy": exp.strategy, "clients": len(exp.dataset.client_names), "cohort": exp.cohort,
            "train_first_s": train_first, "eval_first_s": eval_first, "train_s": float(np.median(train)),
            "eval_s": float(np.median(evals)), "host_share": float(np.nanmedian(host)) if host else None,
            "test_samples": int(sum(len(y) for _, y in exp.dataset.test)),
            "train_samples": int(sum(len(y) for _, y in exp.dataset.train))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", required=True)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--set", nargs="*", default=[], help="RunConfig fields, name=value")
    p.add_argument("--rounds", type=int, default=2, help="rounds timed after the compiling one")
    p.add_argument("--json", default=None, help="append the result as one JSON line here")
    args = p.parse_args(argv)
    check_at_least("--rounds", args.rounds, 1)
    name, opts, run = parse_variant(":".join([args.algorithm] + args.set))
    cfg = RunConfig(algorithm=name, dataset=args.dataset, options={name: opts}, **run)
    res = profile(cfg, args.rounds)
    print(f"{res['algorithm']} on {res['dataset']} ({res['clients']} clients, cohort {res['cohort']}, "
          f"{res['backend']}/{res['strategy']}): train {res['train_s']:.2f} s/round "
          f"(first {res['train_first_s']:.1f} s), "
          f"evaluation {res['eval_s']:.2f} s (first {res['eval_first_s']:.1f} s, {res['test_samples']} test samples), "
          f"host share {res['host_share']:.3f}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
