"""FedSelect against its baselines on CIFAR-10 (2-class shards, 100 training images per client, 10 clients)
and on `pacs` (one client per domain, the feature-shift case), plus the alpha sweep.

Settings (fedselect spec sections 4 and 6): plain SGD lr 0.05 without momentum, batch 32, K = 3 rounds between
mask growths, p = 0.25, alpha = 0.8, last-round accuracy of each client's personalized model on its own test
split (same classes as its training shards). ``--model`` defaults to the ResNet-18 the official code runs
(torchvision's, ImageNet stem, on 32x32 inputs: ``resnet18_imagenet``); ``--model fedavg_cnn`` is a smaller
CNN. Fewer rounds and LocalAlt alternations than the paper: a scaled-down check of the ordering, not a
reproduction. Writes, under --out/<dataset>/:
  <variant>/...     each run (reused when its config matches)
  table.md          per-client mean accuracy, best over rounds (last round), with the paper's Table 1
  accuracy.png      mean test accuracy per round; masks.png: FedSelect's personal fraction per round
  masks_by_layer.md FedSelect's final personal fraction per weight tensor (mean, min, max over clients, and
                    the clients' mutual overlap) and per client (all entries), from the final checkpoint

    JAXFL_DATA_DIR=../shared/data python experiments/fedselect.py --model fedavg_cnn --rounds 20
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from common import (parse_list, parse_seeds, plot_mean_accuracy, run_script, run_seeds, run_variant, seed_root,
                    seed_table)

from jaxfl.core.trees import leaf_paths
from jaxfl.ops.diagnostics import overlap_ratio
from jaxfl.run.config import RunConfig


ALGORITHMS = ["fedselect", "local", "fedavg", "fedper", "fedrep", "lg_fedavg", "ditto", "fedavg_ft", "fedbabu",
              "fedpac"]
SWEEP = ["fedselect:alpha=0.2", "fedselect:alpha=0.5", "fedselect:alpha=0.95"]
# FedSelect Table 1, CIFAR-10 column (ResNet-18, 10 clients, 100 images each, mean personalized accuracy).
PAPER = {"local": 74.60, "fedavg": 27.70, "ditto": 72.75, "fedrep": 67.60, "fedper": 75.40, "lg_fedavg": 77.65,
         "fedselect": 82.25, "fedavg_ft": 75.30, "fedbabu": 75.45, "fedpac": 77.20}


def base_config(dataset: str, args) -> RunConfig:
    common = dict(rounds=args.rounds, lr=0.05, momentum=0.0, batch_size=32, local_epochs=1,
                  options={"fedselect": {"la_epochs": args.la_epochs}}, model=args.model, eval_every=args.eval_every,
                  eval_point="local",  # the official code's protocol: each model right after local training
                  augment=args.augment)
    if dataset == "cifar10":
        return RunConfig(dataset="cifar10", num_clients=10, partition="shards", classes_per_client=2,
                         samples_per_client=100, test_per_client=args.test_per_client, **common)
    return RunConfig(dataset="pacs", samples_per_client=args.pacs_samples, image_size=32, **common)


def plot_masks(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec, hists in results.items():
        hist = hists[0]  # the first seed's
        if spec.startswith("fedselect") and hist and "train_personal_fraction" in hist[0]:
            ax.plot([h["round"] for h in hist], [np.mean(h["train_personal_fraction"]) for h in hist], label=spec)
    ax.set(xlabel="round", ylabel="personal fraction of parameters", title="FedSelect masks, mean over clients")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def layer_density_table(masks, names: list[str]) -> str:
    """Markdown: personal fraction of each mask leaf [clients, ...] (mean / min / max over clients), then of
    every entry per client. Equal fractions per tensor are by design (each growth takes p of every tensor's
    global entries); the overlap shows how much the clients' choices of entries differ."""
    leaves = [np.asarray(m, bool) for m in jax.tree_util.tree_leaves(masks)]
    rows = ["| tensor | entries | personal fraction: mean | min | max over clients | mean pairwise Jaccard "
            "overlap of the clients' personal entries (1: both empty) |", "|---|---|---|---|---|---|"]
    for path, m in zip(leaf_paths(masks), leaves):
        per_client = m.reshape(m.shape[0], -1).mean(1)
        pairs = [float(overlap_ratio(m[i], m[j])) for i in range(len(m)) for j in range(i + 1, len(m))]
        rows.append(f"| {'/'.join(path)} | {m[0].size:,} | {per_client.mean():.3f} | {per_client.min():.3f} | "
                    f"{per_client.max():.3f} | {np.mean(pairs):.3f} |")
    total = sum(m.reshape(m.shape[0], -1).sum(1) for m in leaves) / sum(m[0].size for m in leaves)
    rows += ["", "| client | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
             "| personal fraction | " + " | ".join(f"{t:.3f}" for t in total) + " |"]
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--la-epochs", type=int, default=1)
    p.add_argument("--model", default="resnet18_imagenet")
    p.add_argument("--augment", default="none", help="training augmentation (jaxfl run --augment); crop_flip: "
                                                       "the official code's CIFAR-10 transforms")
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--test-per-client", type=int, default=200)
    p.add_argument("--pacs-samples", type=int, default=500)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean ± std over them")
    p.add_argument("--datasets", default="cifar10,pacs")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS + SWEEP))
    p.add_argument("--out", default="runs/fedselect")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    for dataset in parse_list(args.datasets, "--datasets", choices=("cifar10", "pacs")):
        out, results = Path(args.out) / dataset, {}
        for spec in args.algorithms.split(","):
            results[spec] = run_seeds(spec, base_config(dataset, args), out, seeds, args.progress)
            print(dataset, spec, round(results[spec][0][-1].get("mean_accuracy", float("nan")), 4), flush=True)
        hist = results.get("fedselect", [[]])[0]
        saved = [1 - np.mean(h["train_uploaded"]) / hist[0]["train_uploaded"][0] for h in hist[-1:]] if hist else []
        text = (f"{dataset}, model {args.model}, rounds {args.rounds}, LocalAlt alternations {args.la_epochs}, "
                f"seeds {args.seeds}\n\n" + seed_table(results, paper=PAPER if dataset == "cifar10" else None,
                                                          paper_label="paper (CIFAR-10, ResNet-18, last round)")
                + "\n"
                + (f"\nFedSelect (alpha 0.8) upload in the last round: {saved[0] * 100:.1f} % fewer entries than "
                   f"round 1 (personal entries are not sent).\n" if saved else ""))
        (out / "table.md").write_text(text)
        (out / "results.json").write_text(json.dumps({k: [h[-1] for h in v] for k, v in results.items()}, indent=1))
        plot_mean_accuracy(results, out / "accuracy.png", dataset, highlight="fedselect")
        plot_masks(results, out / "masks.png")
        if "fedselect" in results:  # the final masks, restored from the run's last checkpoint
            _, experiment, result = run_variant("fedselect", base_config(dataset, args).replace(seed=seeds[0]),
                                                seed_root(out, seeds[0], seeds), keep_state=True)
            (out / "masks_by_layer.md").write_text(
                layer_density_table(result.clients["mask"], experiment.dataset.client_names))
        print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
