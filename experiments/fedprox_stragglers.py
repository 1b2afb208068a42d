"""FedProx's systems-heterogeneity experiment (Li et al., MLSys 2020, section 5.2 and Figure 1) on MNIST:
stragglers that run only part of their local epochs, FedAvg that drops them, FedProx that keeps their partial
work, with and without its proximal term.

The paper's MNIST setting as far as jaxfl's data allows: multinomial logistic regression (``logreg``), 1,000
clients holding two digits each (``shards``; the paper's sizes follow a power law, here ~60 images each), 10
clients a round, E = 20 local epochs, batch 10, SGD at lr 0.03 without momentum, aggregation weighted by sample
counts. At each straggler level s (``--stragglers``, default 0, 0.5, 0.9) three variants run:
  fedavg (drops stragglers)   FedAvg over the round's non-stragglers only: as the paper's code does, a cohort of
                              round(10 (1 - s)) clients (dropping a uniformly random s of the 10 draws the same)
  fedprox mu=0                every client of the 10 reports; a straggler (jaxfl's --stragglers s) ran a uniformly
                              random 1..19 of its 20 epochs
  fedprox mu=<mu>             the same with the proximal term (the paper's best mu for MNIST: 1)
  fednova                     the same partial work, each client's update normalised by the steps it took
                              (Wang et al., NeurIPS 2020: the remedy for the objective inconsistency that unequal
                              local work causes in FedAvg); not in FedProx's paper; also at lr 0.01
Deviation: the paper makes exactly round(10 s) of the 10 clients stragglers; jaxfl draws each client's
straggling on its own stream (``core.cohort.straggler_work``), so their number varies around 10 s.

Writes, under --out: s<s>/[seed<k>/]<variant>/ (the runs), table.md (final, best and last-5 accuracy on the
pooled test set, mean ± std over seeds) and accuracy.png (one panel per straggler level).

    JAXFL_DATA_DIR=../shared/data python experiments/fedprox_stragglers.py --seeds 0,1,2 \\
        --out ../runs/fedprox_stragglers
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import accuracy_curve, check_variants, parse_list, parse_seeds, run_script, run_seeds, seed_table

from jaxfl.errors import ConfigError
from jaxfl.run.config import RunConfig


COHORT = 10


def base_config(args) -> RunConfig:
    return RunConfig(dataset="mnist", channels=1, model="logreg", num_clients=1000, partition="shards",
                     classes_per_client=2, clients_per_round=COHORT, local_epochs=20, batch_size=10, lr=0.03,
                     momentum=0.0, weight_decay=0.0, rounds=args.rounds, eval_every=args.eval_every)


def variants(s: float, mu: float) -> dict[str, str]:
    """{label: variant spec} at straggler level ``s``."""
    partial = f":stragglers={s}" if s else ""
    return {"fedavg (drops stragglers)": f"fedavg:clients_per_round={round(COHORT * (1 - s))}",
            "fedprox mu=0": f"fedprox:mu=0{partial}",
            f"fedprox mu={mu:g}": f"fedprox:mu={mu}{partial}",
            "fednova": f"fednova{partial}",
            "fednova lr=0.01": f"fednova{partial}:lr=0.01"}


def plot(results: dict[float, dict[str, list[list[dict]]]], path: Path, key: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, (s, runs) in zip(axes[0], results.items()):
        for label, hists in runs.items():
            curves = [accuracy_curve(h, key) for h in hists]
            acc = np.stack([c[1] for c in curves]) * 100
            line, = ax.plot(curves[0][0], acc.mean(0), label=label, lw=1.4)
            if len(hists) > 1:
                ax.fill_between(curves[0][0], acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0),
                                color=line.get_color(), alpha=0.2, lw=0)
        ax.set(title=f"{s:.0%} stragglers", xlabel="round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy, all clients' test images (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--stragglers", default="0,0.5,0.9", help="comma-separated straggler levels s in [0, 1)")
    p.add_argument("--mu", type=float, default=1.0, help="FedProx's proximal weight (the paper's MNIST choice: 1)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="runs/fedprox_stragglers")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    seeds, out, base = parse_seeds(args.seeds), Path(args.out), base_config(args)
    key = "weighted_accuracy"  # the global model on every client's test images, pooled (the paper's test accuracy)
    results, text = {}, [f"MNIST, logreg, 1,000 clients of two digits, {COHORT} a round, E = 20, batch 10, lr 0.03, "
                         f"{args.rounds} rounds, seeds {args.seeds}; accuracy on all clients' test images, %\n"]
    levels = parse_list(args.stragglers, "--stragglers", float)
    if not all(0 <= s < 1 for s in levels):
        raise ConfigError(f"--stragglers {args.stragglers!r}: give levels s in [0, 1)")
    for s in levels:
        check_variants(variants(s, args.mu).values(), base)
    for s in levels:
        results[s] = {label: run_seeds(spec, base, out / f"s{s:g}", seeds, args.progress)
                      for label, spec in variants(s, args.mu).items()}
        text += [f"\n{s:.0%} stragglers:\n", seed_table(results[s], key=key)]
        print(text[-2] + text[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(text) + "\n")
    plot(results, out / "accuracy.png", key)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
