"""User-level differential privacy on MNIST: DP-FedAvg's accuracy against its (ε, δ) (``--dp-clip``,
``--dp-noise``; McMahan et al., ICLR 2018), beside FedAvg without privacy and with clipping alone.

Setting (the FedProx-stragglers experiment's data): multinomial logistic regression (``logreg``), 1,000 clients
holding two digits each (``shards``, ~60 training images each), 100 clients a round (sampling rate q = 0.1),
E = 1 local epoch, batch 10, SGD lr 0.1 without momentum, equal client weights (DP-FedAvg's; FedAvg here too, so
that the rows differ only by clipping and noise). Each client's update is clipped to l2 norm C (default 1: the
unclipped updates' median norm falls from ~2.6 in round 1 to ~1.8 by round 10), and the server adds Gaussian
noise of std z C / 100 to the mean. ε is the run's (user-level, replace-one, fixed-size cohort; RDP accountant)
at δ = N^-1.1 (5.0e-4), as the run logs it. Variants: fedavg (no clipping, no noise), clip only (z = 0: no
guarantee), z in --noise, z = 3 with adaptive clipping (``--dp-quantile 0.5``: C starts at 0.1 and tracks the
median update norm, TFF's defaults: lr 0.2, count noise 0.05 k = 5, the update's noise multiplier then 3.15 for
the same ε), z = 2 with server momentum 0.9 at server lr 0.1 (DP-FedAvgM: the same effective step as lr 1
without momentum, the noise averaged over ~10 rounds), and Poisson sampling (``--cohort-sampling poisson``: each
client joins a round with probability 0.1, the clipped updates summed over the expected 100; add/remove
accounting) without DP, at each z in --noise and with the noise calibrated to the fixed cohort's ε at the
largest z (6.37 at z = 4 over 200 rounds).

Writes, under --out: [seed<k>/]<variant>/ (the runs), table.md (final, best and last-5 accuracy on the pooled
test set, mean ± std over seeds, and the ε each row spent) and accuracy.png (ε in the legend).

    JAXFL_DATA_DIR=../shared/data python experiments/dp_fedavg.py --seeds 0,1,2 --out ../runs/dp_fedavg
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import (check_at_least, check_variants, parse_list, parse_seeds, run_script, run_seeds,
                    write_privacy_results)

from jaxfl.core.privacy import Accountant
from jaxfl.run.config import RunConfig


def base_config(args) -> RunConfig:
    return RunConfig(dataset="mnist", channels=1, model="logreg", num_clients=1000, partition="shards",
                     classes_per_client=2, clients_per_round=100, local_epochs=1, batch_size=10, lr=0.1,
                     momentum=0.0, weight_decay=0.0, weighting="uniform", rounds=args.rounds,
                     eval_every=args.eval_every)


def variants(clip: float, noises: list[float], rounds: int) -> dict[str, str]:
    """{label: variant spec}."""
    dp = f"fedavg:dp_clip={clip:g}"
    out = {"fedavg (no DP)": "fedavg", f"clip {clip:g} only (z = 0)": f"{dp}:dp_noise=0"}
    out.update({f"DP-FedAvg z = {z:g}": f"{dp}:dp_noise={z:g}" for z in noises})
    out["DP-FedAvg z = 3, adaptive clip (median, from 0.1)"] = "fedavg:dp_clip=0.1:dp_noise=3:dp_quantile=0.5"
    out["DP-FedAvgM z = 2, server lr 0.1, momentum 0.9"] = (f"{dp}:dp_noise=2:server_opt=sgd:server_lr=0.1:"
                                                            f"server_momentum=0.9")
    # Poisson sampling (each client joins with q = 0.1; the sum over qN = 100): add/remove accounting
    out["fedavg (no DP), Poisson sampling"] = "fedavg:cohort_sampling=poisson"
    out.update({f"DP-FedAvg z = {z:g}, Poisson sampling": f"{dp}:dp_noise={z:g}:cohort_sampling=poisson"
                for z in noises})
    # ... and at the ε of the fixed cohort's noisiest row: the two samplings at equal ε
    eps = float(f"{Accountant(0.1, max(noises), 1000 ** -1.1).epsilon(rounds):.3g}")
    out[f"DP-FedAvg, Poisson sampling, noise for ε = {eps:g}"] = f"{dp}:dp_epsilon={eps:g}:cohort_sampling=poisson"
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="the clipping norm C")
    p.add_argument("--noise", default="1,2,3,4", help="comma-separated noise multipliers z")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="runs/dp_fedavg")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    seeds, out, base = parse_seeds(args.seeds), Path(args.out), base_config(args)
    key = "weighted_accuracy"  # the global model on every client's test images, pooled
    noises = parse_list(args.noise, "--noise", float)
    check_at_least("--noise", noises, 0, strict=True)
    specs = variants(args.clip, noises, args.rounds)
    check_variants(specs.values(), base)
    results = {label: run_seeds(spec, base, out, seeds, args.progress) for label, spec in specs.items()}
    head = (f"MNIST, logreg, 1,000 clients of two digits, 100 a round, E = 1, batch 10, lr 0.1, equal weights, "
            f"clip C = {args.clip:g}, δ = 1000^-1.1, {args.rounds} rounds, seeds {args.seeds}; accuracy on all "
            f"clients' test images, %\n")
    write_privacy_results(results, out, head, "DP-FedAvg on MNIST (logreg), all clients' test images", key)

if __name__ == "__main__":
    raise SystemExit(run_script(main))
