"""DapperFL against FedAvg and FedProx on `digits` (3 clients per domain over MNIST-M, MNIST, USPS; device
levels rho = 0, .2, .4, .6, .8 by client index) with the ablations (no fusion, no DAR, both) and the released-code
preset (no fusion, pruned entries averaged as zeros).

Settings (dapperfl spec section 4): ResNet-10, SGD lr 0.01 momentum 0.9, batch 64, E = 5 local epochs (1 dense
+ 4 masked), gamma 0.01, alpha0 0.9, alpha_min 0.1, eps 0.2, sample-size weights, global model evaluated on each
domain's test set, best-over-rounds global accuracy reported. Our digits data has no SVHN/SYN, and
``--samples-per-client`` (default 100) stands in for the paper's 1 % of each domain. PACS with ResNet-18 stands
in for Office-Caltech10 (``--datasets pacs``). Per client the table gives the nominal (1 - rho) and the
effective (nonzeros of the mask) parameter counts.

Diagnostic (``--bn-check``): the global accuracy of every DapperFL variant's final model again after its
BatchNorm running statistics are re-estimated from one train-mode pass over all clients' training images
pooled (``reestimated_bn``). The spec averages the clients' statistics unmasked (the code's rule), so a
client that pruned a channel pulls that channel's averaged variance towards 0; a large gain here points at
that rule rather than at the weights.

    JAXFL_DATA_DIR=../shared/data python experiments/dapperfl.py --rounds 20
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import (parse_list, parse_seeds, plot_mean_accuracy, run_script, run_seeds, run_variant, seed_root,
                    seed_table, table)

from jaxfl.run.config import RunConfig


ALGORITHMS = ["dapperfl", "fedavg", "fedprox:mu=0.1", "dapperfl:use_fusion=false",
              "dapperfl:gamma=0", "dapperfl:use_fusion=false:gamma=0",
              "dapperfl:use_fusion=false:recover_mode=zero:bn_stats=unmasked",  # the released code
              "moon", "feddrop", "fedmp", "heterofl", "nefl", "fedsr", "fpl"]  # the paper's other baselines
PAPER = {}  # the paper's digits domains (MNIST, USPS, SVHN, SYN) overlap ours in MNIST and USPS only
MODELS = {"digits": "resnet10", "pacs": "resnet18"}


def reestimated_bn(experiment, server, momentum: float = 0.1):
    """The global model's BatchNorm statistics on all clients' real training images pooled: one train-mode
    forward pass updates running <- (1 - m) running + m batch, so batch = (new - (1 - m) old) / m exactly."""
    x = np.concatenate([xi for xi, _ in experiment.dataset.train])  # real images only, no padding
    variables = {"params": server["params"], "batch_stats": server["batch_stats"]}
    _, updated = experiment.model.apply(variables, experiment.trainer.preprocess(jnp.asarray(x)), True,
                                        mutable=["batch_stats"])
    return jax.tree_util.tree_map(lambda new, old: (new - (1 - momentum) * old) / momentum,
                                  updated["batch_stats"], server["batch_stats"])


def bn_check_table(specs, base, out) -> str:
    rows = ["| variant | global accuracy, final model % | with re-estimated BN statistics % |", "|---|---|---|"]
    for spec in specs:
        if not spec.startswith("dapperfl"):
            continue
        _, experiment, result = run_variant(spec, base, out, keep_state=True)
        before = experiment.evaluate(result.server, result.clients)["mean_accuracy"]
        server = dict(result.server, batch_stats=reestimated_bn(experiment, result.server))
        after = experiment.evaluate(server, result.clients)["mean_accuracy"]
        rows.append(f"| {spec} | {before * 100:.2f} | {after * 100:.2f} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--samples-per-client", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every this many rounds (and after the last)")
    p.add_argument("--test-per-client", type=int, default=1000)
    p.add_argument("--datasets", default="digits")
    p.add_argument("--model", default=None, help="default: resnet10 (digits), resnet18 (pacs)")
    p.add_argument("--augment", default="none", help="training augmentation (jaxfl run --augment); crop_flip: "
                                                       "the official code's transforms")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean ± std over them")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--out", default="runs/dapperfl")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--bn-check", action="store_true", help="also the BatchNorm re-estimation diagnostic")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    for dataset in parse_list(args.datasets, "--datasets", choices=MODELS):
        base = RunConfig(dataset=dataset, model=args.model or MODELS[dataset], clients_per_domain=3,
                         samples_per_client=args.samples_per_client, test_per_client=args.test_per_client,
                         rounds=args.rounds, local_epochs=args.local_epochs, batch_size=64, lr=0.01,
                         momentum=0.9, image_size=32, eval_every=args.eval_every, augment=args.augment)
        out, results = Path(args.out) / dataset, {}
        for spec in args.algorithms.split(","):
            results[spec] = run_seeds(spec, base, out, seeds, args.progress)
            print(dataset, spec, round(results[spec][0][-1].get("mean_accuracy", float("nan")), 4), flush=True)
        names = [f"client{i}" for i in range(len(results[next(iter(results))][0][-1]["test_accuracy"]))]
        text = (f"{dataset}, rounds {args.rounds}, E {args.local_epochs}, seeds {args.seeds}\n\n"
                + table(results, names, PAPER) + "\n\nMean accuracy over clients:\n\n" + seed_table(results) + "\n")
        last = results.get("dapperfl", [[{}]])[0][-1]
        if "train_kept_params" in last:  # model volume per client: mask entries kept (all parameter leaves)
            total = max(last["train_kept_params"])  # a rho = 0 client keeps the dense model
            text += ("\n| client | rho | kept parameters | fraction of dense | nominal 1 - rho |\n"
                     "|---|---|---|---|---|\n")
            text += "\n".join(f"| {n} | {r:.1f} | {int(k):,} | {k / total:.3f} | {1 - r:.1f} |" for n, r, k in
                               zip(names, last["train_ratio"], last["train_kept_params"])) + "\n"
        if args.bn_check:
            text += "\n" + bn_check_table(args.algorithms.split(","), base.replace(seed=seeds[0]),
                                           seed_root(out, seeds[0], seeds))
        (out / "table.md").write_text(text)
        plot_mean_accuracy(results, out / "accuracy.png", dataset, highlight="dapperfl")
        print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
