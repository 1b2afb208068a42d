"""The twelve methods PFLlib and FL-bench both ship beside FedAvg and local training, on PFLlib's
"practical" label skew: MNIST (one channel), 20 clients, Dirichlet(0.1) labels, every client every round, batch
10, one local epoch, plain SGD, each client's test set following its training label mix.

Smaller than PFLlib's benchmark, so that a CPU affords a learning-rate grid and three seeds: at most 500 training
images per client, the FedAvg paper's 2NN (``mlp_2nn``, 784-200-200-10; encoder = the two hidden layers, head =
the last Dense layer) instead of PFLlib's 4-layer CNN, and 50 rounds instead of 2,000. Every method runs with its
own defaults (its reference code's values; see ``docs/algorithms.md``); only the client learning rate is chosen,
per method, from ``--lrs`` on the first seed by the mean test accuracy of the last 5 rounds (there is no
validation split: the choice is made on the test clients, as PFLlib's and FL-bench's published tables do), then
the other seeds run at that rate; if one of them diverges (a non-finite loss), the next best rate is taken
(the diverged runs are listed under the table). Writes, under --out:
  grid/<variant>_lr<lr>/ ...   the grid's runs (seed --seeds[0])
  seed<s>/<variant>/ ...       the chosen rate's runs of the other seeds (the first seed's is its grid run)
  grid.md                      per method and rate: final and last-5 mean accuracy (%), the chosen rate marked
  table.md                     per method at its rate: final, best-mean and last-5 accuracy, mean ± std over seeds
  accuracy.png                 mean accuracy per round, bands over seeds

    JAXFL_DATA_DIR=../shared/data python experiments/pfl_methods.py --seeds 0,1,2 --out ../runs/pfl_methods
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from common import (check_variants, parse_list, parse_seeds, plot_mean_accuracy, run_script, run_variant, seed_stats,
                    seed_table)

from jaxfl.errors import NonFiniteError
from jaxfl.run.config import RunConfig

BASELINES = ["fedavg", "local"]
METHODS = ["fednova", "perfedavg", "perfedavg:variant=hf", "apfl", "fedfomo", "fedamp", "fedphp", "fedala",
           "fedproto", "fedcp", "gpfl", "feddbe", "fedlc"]


def base_config(args) -> RunConfig:
    return RunConfig(dataset="mnist", channels=1, num_clients=20, partition="dirichlet", dirichlet_alpha=0.1,
                     samples_per_client=args.samples_per_client, model=args.model, rounds=args.rounds,
                     batch_size=10, local_epochs=1, momentum=0.0, weight_decay=0.0, eval_every=1)


def tail_mean(hist: list[dict], tail: int = 5) -> float:
    """Mean over the last ``tail`` evaluations of the mean client accuracy, %."""
    return seed_stats([hist], tail=tail)["tail"][0]


def run_or_diverged(spec: str, cfg: RunConfig, root: Path, progress: bool, diverged: list[str]) -> list[dict] | None:
    """The run's history, or None when it stopped on a non-finite loss (then a line is added to ``diverged``;
    rerunning the script resumes it from its last good round and meets the same divergence)."""
    try:
        return run_variant(spec, cfg, root, progress)[0]
    except NonFiniteError as e:
        diverged.append(f"{spec}, seed {cfg.seed}: {str(e).split(';')[0]}")
        print(diverged[-1], flush=True)
        return None


def grid_table(grid: dict[str, dict[float, list[dict]]], chosen: dict[str, float]) -> str:
    lrs = sorted({lr for runs in grid.values() for lr in runs})
    rows = ["| method | " + " | ".join(f"lr {lr:g}: final / last-5" for lr in lrs) + " | chosen lr |",
            "|---" * (len(lrs) + 2) + "|"]
    for spec, runs in grid.items():
        cells = []
        for lr in lrs:
            if runs[lr] is None:
                cells.append("diverged")
                continue
            st = seed_stats([runs[lr]])
            text = f"{st['final'][0]:.1f} / {st['tail'][0]:.1f}"
            cells.append(f"**{text}**" if lr == chosen.get(spec) else text)
        rows.append(f"| {spec} | " + " | ".join(cells) + f" | {chosen.get(spec, 'none')} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--lrs", default="0.005,0.02,0.05", help="the client learning rates tried on the first seed")
    p.add_argument("--model", default="mlp_2nn")
    p.add_argument("--samples-per-client", type=int, default=500)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; the first one chooses the rates")
    p.add_argument("--algorithms", default=",".join(BASELINES + METHODS))
    p.add_argument("--out", default="runs/pfl_methods")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    seeds, lrs = parse_seeds(args.seeds), parse_list(args.lrs, "--lrs", float)
    out, base = Path(args.out), base_config(args)
    specs = parse_list(args.algorithms, "--algorithms")
    check_variants([f"{spec}:lr={lr}" for spec in specs for lr in lrs], base)
    grid, chosen, results, diverged = {}, {}, {}, []
    for spec in specs:
        grid[spec] = {lr: run_or_diverged(f"{spec}:lr={lr}", base.replace(seed=seeds[0]), out / "grid",
                                          args.progress, diverged) for lr in lrs}
        # the best rate on the first seed at which no other seed diverges (the next best otherwise)
        for lr in sorted((lr for lr in lrs if grid[spec][lr] is not None), key=lambda r: -tail_mean(grid[spec][r])):
            hists = [grid[spec][lr]] + [
                run_or_diverged(f"{spec}:lr={lr}", base.replace(seed=s), out / f"seed{s}", args.progress, diverged)
                for s in seeds[1:]]
            chosen[spec], results[spec] = lr, [h for h in hists if h is not None]
            if len(results[spec]) == len(seeds):
                break
        print(spec, "lr", chosen.get(spec), [round(tail_mean(h), 2) for h in results.get(spec, [])], flush=True)
    head = (f"MNIST (1 channel), 20 clients, Dirichlet(0.1), <= {args.samples_per_client} training images per "
            f"client, model {args.model}, batch 10, 1 local epoch, SGD without momentum, {args.rounds} rounds, "
            f"every client every round; seeds {args.seeds}\n\n")
    (out / "grid.md").write_text(head + f"Learning-rate grid, seed {seeds[0]} (bold: the chosen rate, the best "
                                 f"last-5 mean at which no seed diverged):\n\n" + grid_table(grid, chosen) + "\n")
    labelled = {f"{spec} (lr {chosen[spec]:g})": hists for spec, hists in results.items()}
    text = head + seed_table(labelled) + "\n"
    if diverged:
        text += "\nStopped on a non-finite loss (left out of the rows above):\n\n" + "".join(
            f"- {d}\n" for d in diverged)
    (out / "table.md").write_text(text)
    plot_mean_accuracy(labelled, out / "accuracy.png", "MNIST, Dir(0.1), 20 clients, 2NN")
    print(text, flush=True)
    best = max(results, key=lambda s: np.mean([tail_mean(h) for h in results[s]]))
    print(f"best last-5 mean: {best}", flush=True)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
