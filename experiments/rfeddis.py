"""RFedDis against its baselines on `digits` (real MNIST-M, MNIST, USPS) and `pacs`, with reliability reports.

Settings (rfeddis spec section 5): SGD lr 0.01 without momentum, batch 32, 1 local epoch, all clients every
round; digits at 28x28x3 with 743 training images per client (FedBN's 10 % partition) and the full test sets.
PACS (4 domains, 7 classes) stands in for Office-Caltech10, which is not available offline; this machine
cannot train the 256x256 AlexNet, so PACS runs the digits CNN at 32x32 with ``--pacs-samples`` training
images per client and the full validation split as test set. Writes, under --out/<dataset>/:
  <variant>/...            each run (reused when its config matches; interrupted runs resume)
  table.md                 accuracy per client in the paper's format (best over rounds (last)) and the
                           reliability table: accuracy, ECE, mean uncertainty clean / noisy (sigma 1.5) /
                           other domain, AUROC of the uncertainty for noisy and other-domain inputs
  accuracy.png             mean test accuracy per round
  uncertainty.png          density of the uncertainty on clean vs noisy test inputs, per client

    JAXFL_DATA_DIR=../shared/data python experiments/rfeddis.py --rounds 8 --datasets digits
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from common import (parse_list, parse_seeds, plot_mean_accuracy, run_script, run_seeds, run_variant, seed_root,
                    seed_table, table, variant_dir)

from jaxfl.run.checkpoint import read_metrics
from jaxfl.run.config import RunConfig
from jaxfl.run.plots import plot_uncertainty_density


ALGORITHMS = ["rfeddis", "fedbn", "fedavg", "fedprox", "fedrep", "local", "moon", "feddc", "feddyn", "scaffold"]
# RFedDis Table II-a (100 rounds, 5 domains; we have 3 of them): MNIST-M, MNIST, USPS.
PAPER = {"digits": {"local": (77.8, 94.4, 95.2), "fedavg": (76.9, 95.9, 95.6), "fedprox": (76.6, 95.8, 95.6),
                    "fedrep": (78.6, 96.8, 96.9), "fedbn": (78.3, 96.6, 97.0), "rfeddis": (83.9, 97.2, 96.8),
                    "moon": (75.5, 95.7, 95.3), "feddc": (73.6, 96.0, 94.1), "feddyn": (81.4, 97.3, 96.8),
                    "scaffold": (80.8, 97.2, 97.0)},
         "pacs": {}}
NAMES = {"digits": ["MNIST-M", "MNIST", "USPS"], "pacs": ["art_painting", "cartoon", "photo", "sketch"]}
RELIABILITY = ("rfeddis", "fedbn")  # the uncertainty of fedbn is 1 - max softmax probability


def base_config(dataset: str, args) -> RunConfig:
    common = dict(rounds=args.rounds, lr=0.01, momentum=0.0, batch_size=32, local_epochs=1,
                  eval_every=args.eval_every)
    if dataset == "digits":
        return RunConfig(dataset="digits", image_size=28, samples_per_client=743, **common)
    return RunConfig(dataset="pacs", image_size=32, samples_per_client=args.pacs_samples, **common)


def reliability_table(reports: dict, names: list[str]) -> str:
    cols = ["accuracy", "ece", "uncertainty", "uncertainty_noisy", "uncertainty_other", "auroc_noisy", "auroc_other"]
    rows = ["| method | client | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for label, rep in reports.items():
        for j, name in enumerate(names + ["mean"]):
            vals = [rep[c][j] if j < len(names) else float(np.mean(rep[c])) for c in cols]
            rows.append(f"| {label} | {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean ± std over them "
                   "(reliability: the first seed)")
    p.add_argument("--datasets", default="digits,pacs")
    p.add_argument("--pacs-samples", type=int, default=500)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help="comma-separated variants: name or name:key=value:... (e.g. rfeddis:fusion=sum)")
    p.add_argument("--out", default="runs/rfeddis")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--from-logs", nargs="+", metavar="SEED_DIR",
                   help="train nothing: the accuracy tables and figure of --algorithms from finished runs, one "
                        "folder per seed holding <variant>/metrics.jsonl (one dataset), written under --out")
    args = p.parse_args(argv)
    if args.from_logs:
        return tables_from_logs(args)
    seeds = parse_seeds(args.seeds)
    for dataset in parse_list(args.datasets, "--datasets", choices=NAMES):
        out, names = Path(args.out) / dataset, NAMES[dataset]
        results, reports = {}, {}
        for spec in args.algorithms.split(","):
            results[spec] = run_seeds(spec, base_config(dataset, args), out, seeds, args.progress)
            print(dataset, spec, [round(a, 4) for a in results[spec][0][-1].get("test_accuracy", [])], flush=True)
            if spec.split(":")[0] in RELIABILITY:  # the first seed's final states, restored from its checkpoint
                _, exp, res = run_variant(spec, base_config(dataset, args).replace(seed=seeds[0]),
                                          seed_root(out, seeds[0], seeds), keep_state=True)
                reports[spec] = exp.reliability(res.server, res.clients, jax.random.key(seeds[0]), noise_sigma=1.5)
        text = (f"{dataset}, rounds: {args.rounds}, seeds {args.seeds}; cells: best over evaluated rounds "
                "(last round), "
                "mean over seeds\n\n" + table(results, names, PAPER[dataset]) + "\n\nMean accuracy over clients:\n\n"
                + seed_table(results) + "\n\nReliability after the last round (seed " + str(seeds[0])
                + "; noise sigma 1.5 on "
                "the normalised input; 'other' = the next client's test inputs):\n\n"
                + reliability_table(reports, names) + "\n")
        (out / "table.md").write_text(text)
        (out / "reliability.json").write_text(json.dumps(
            {k: {m: v for m, v in r.items() if not m.startswith("u_")} for k, r in reports.items()}, indent=1))
        plot_mean_accuracy(results, out / "accuracy.png", f"{dataset}", highlight="rfeddis")
        if reports:
            plot_uncertainty_density(reports, names, out / "uncertainty.png")
        print(text, flush=True)


def tables_from_logs(args) -> None:
    """``table.md`` (the paper's format, then final / best-mean / last-5 over seeds) and ``accuracy.png`` under
    ``--out`` from the runs in ``--from-logs`` (one folder per seed), as a multi-seed run of this script writes
    them, without the reliability report (it needs the final states)."""
    dataset = args.datasets
    if dataset not in NAMES:
        raise SystemExit(f"rfeddis.py: error: --from-logs takes one dataset, got --datasets {dataset!r}")
    results = {spec: [read_metrics(Path(root) / variant_dir(spec) / "metrics.jsonl") for root in args.from_logs]
               for spec in args.algorithms.split(",")}
    text = (f"{dataset}, runs: {', '.join(args.from_logs)}; cells: best over evaluated rounds (last round), mean "
            f"± std over the {len(args.from_logs)} seeds\n\n" + table(results, NAMES[dataset], PAPER[dataset])
            + "\n\nMean accuracy over clients:\n\n" + seed_table(results) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    plot_mean_accuracy(results, out / "accuracy.png", dataset, highlight="rfeddis")
    print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
