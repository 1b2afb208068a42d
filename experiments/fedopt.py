"""The FedOpt paper's settings (Reddi et al., "Adaptive Federated Optimization", ICLR 2021) on TFF's files:
FedAvg, FedAvgM, FedAdagrad, FedAdam and FedYogi (client SGD, a server optimizer: ``jaxfl.core.server_opt``) on
EMNIST character recognition, the EMNIST autoencoder (a reconstruction task, scored by 1 - MSE), Shakespeare
next-character prediction, Stack Overflow next-word prediction, Stack
Overflow tag prediction (multi-label logistic regression, scored by recall@5) and CIFAR-100.

Source of every number below: google-research/federated, ``optimization/docs/hyperparameters.md`` (commit
0f29cad, "Best hyperparameters", base-10 logarithms) and ``optimization/README.md`` (the tasks' models): one
client epoch, clients per round, batch size and rounds per task; the best client and server learning rates and
adaptivity (epsilon, tau in the paper's Algorithm 2) per task and method; FedAvgM's server momentum 0.9; Adam's
and Yogi's beta1 0.9 and beta2 0.999 (Keras' defaults, which the experiments kept). The paper's accuracies:
only FedAvg's, for four tasks, as FedML's benchmark table quotes them from the paper's Table 1 (``PAPER_FEDAVG``,
FedML-AI/FedML ``benchmark/README.md``, commit 46e34dc: EMNIST CR 84.9, CIFAR-100 44.7, Shakespeare 56.9,
Stack Overflow NWP 19.5, % accuracy); the paper's own tables could not be read from this machine, so the
adaptive methods' accuracies and Stack Overflow LR's are not given here.

    task         data (TFF's HDF5, ``jaxfl.data.tff``)      model          cohort  batch  rounds
    emnist_cr    fed_emnist_{train,test}.h5 (62 classes)     cnn_dropout    10      20     1500
    emnist_ae    fed_emnist_{train,test}.h5 (1 - pixels)     emnist_ae      10      20     3000
    shakespeare  shakespeare_{train,test}.h5                 char_lstm      10      4      1200
    stackoverflow_nwp  stackoverflow_{train,test}.h5         word_lstm      50      16     1500
    stackoverflow_lr   stackoverflow_{train,test}.h5         bow_logreg     10      100    1500
    cifar100     fed_cifar100_{train,test}.h5                resnet18_gn    10      20     4000

Deviations: jaxfl's server optimizers follow the paper's Algorithm 2 (no bias correction, v_-1 = tau^2) where the
code ran Keras' Adam, Adagrad and Yogi; the learning rates were tuned there. Each client is evaluated on its own
test split (``weighted_accuracy``, the sample-weighted mean over clients, is the pooled test accuracy TFF
reports for EMNIST and Shakespeare); CIFAR-100's test clients are other clients, so each training client's test
split is a fifth of its own images (``jaxfl.data.tff``), and its images are not cropped to 24 x 24. The EMNIST
autoencoder's inputs are the targets rounded to 1/255 (jaxfl keeps images as uint8; the targets are FedOpt's
exact 1 - pixels), and its table cells are 100 (1 - MSE), where the paper reports the MSE. Shakespeare
and Stack Overflow predict the token after each window (80 characters, 20 words), where the FedOpt tasks
predict every position; Stack Overflow's vocabulary comes from the users read (``--num-clients``, all by
default) and its accuracy counts every target (``jaxfl.data.tff``). Stack Overflow tag prediction: the client
learning rate is FedOpt's 10^2 times the batch size 100, since TFF's task sums a batch's losses where jaxfl
averages them (the same step on full batches; a client's last, partial batch takes a larger one); its score
(the table's accuracy) is recall@5 averaged over posts, where TFF's Keras Recall pools the posts' tags, and its
vocabularies come from the users read (``jaxfl.data.tff``).

    python experiments/fedopt.py --write experiments/configs/fedopt      # one TOML per (task, method)
    jaxfl run --config experiments/configs/fedopt/emnist_cr_fedadam.toml --dataset tff_emnist:DATA --out runs/x
    python experiments/fedopt.py --data DATA --tasks emnist_cr --methods fedavg,fedadam --seeds 0 --out runs/fedopt

``--data DATA``: the folder holding TFF's files; a task whose file is missing is skipped with a line naming it.
Outputs in --out: one run folder per (seed, task, method) (reused when finished, resumed when not), ``table.md``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import check_at_least, parse_list, parse_seeds, run_script, run_seeds

from jaxfl.errors import ConfigError
from jaxfl.run.config import RunConfig

SOURCE = "google-research/federated optimization/docs/hyperparameters.md (commit 0f29cad)"
# FedAvg's accuracy in the paper's Table 1 (%), as FedML-AI/FedML benchmark/README.md (commit 46e34dc) quotes it
PAPER_FEDAVG_SOURCE = "the paper's Table 1 as quoted by FedML-AI/FedML benchmark/README.md (commit 46e34dc)"
PAPER_FEDAVG = {"emnist_cr": 84.9, "cifar100": 44.7, "shakespeare": 56.9, "stackoverflow_nwp": 19.5}
METHODS = {"fedavg": {"server_opt": "sgd"},
           "fedavgm": {"server_opt": "sgd", "server_momentum": 0.9},
           "fedadagrad": {"server_opt": "adagrad"},
           "fedadam": {"server_opt": "adam", "server_beta1": 0.9, "server_beta2": 0.999},
           "fedyogi": {"server_opt": "yogi", "server_beta1": 0.9, "server_beta2": 0.999}}
# per task: the run's settings, and log10 of the best client lr, server lr and epsilon (tau) per method
TASKS = {
    "emnist_cr": {"prefix": "tff_emnist", "file": "fed_emnist_train.h5",
                  "run": {"model": "cnn_dropout", "channels": 1, "clients_per_round": 10, "batch_size": 20,
                          "rounds": 1500},
                  "client_lr": {"fedadagrad": -1.5, "fedadam": -1.5, "fedyogi": -1.5, "fedavgm": -1.5, "fedavg": -1},
                  "server_lr": {"fedadagrad": -1, "fedadam": -2.5, "fedyogi": -2.5, "fedavgm": -0.5, "fedavg": 0},
                  "epsilon": {"fedadagrad": -2, "fedadam": -4, "fedyogi": -4}},
    # the targets are the inputs (FedOpt's 1 - pixels); the loss the mean squared error of sigmoid outputs
    "emnist_ae": {"prefix": "tff_emnist_ae", "file": "fed_emnist_train.h5",
                  "run": {"model": "emnist_ae", "channels": 1, "clients_per_round": 10, "batch_size": 20,
                          "rounds": 3000},
                  "client_lr": {"fedadagrad": 1.5, "fedadam": 1, "fedyogi": 1, "fedavgm": 0.5, "fedavg": 1},
                  "server_lr": {"fedadagrad": -1.5, "fedadam": -1.5, "fedyogi": -1.5, "fedavgm": 0, "fedavg": 0},
                  "epsilon": {"fedadagrad": -3, "fedadam": -3, "fedyogi": -3}},
    "shakespeare": {"prefix": "tff_shakespeare", "file": "shakespeare_train.h5",
                    "run": {"model": "char_lstm", "clients_per_round": 10, "batch_size": 4, "rounds": 1200},
                    "client_lr": {"fedadagrad": 0, "fedadam": 0, "fedyogi": 0, "fedavgm": 0, "fedavg": 0},
                    "server_lr": {"fedadagrad": -0.5, "fedadam": -2, "fedyogi": -2, "fedavgm": -0.5, "fedavg": 0},
                    "epsilon": {"fedadagrad": -1, "fedadam": -3, "fedyogi": -3}},
    "stackoverflow_nwp": {"prefix": "tff_stackoverflow", "file": "stackoverflow_train.h5",
                          "run": {"model": "word_lstm", "clients_per_round": 50, "batch_size": 16, "rounds": 1500},
                          "client_lr": {m: -0.5 for m in ("fedadagrad", "fedadam", "fedyogi", "fedavgm", "fedavg")},
                          "server_lr": {"fedadagrad": -1.5, "fedadam": -2, "fedyogi": -2, "fedavgm": 0, "fedavg": 0},
                          "epsilon": {"fedadagrad": -4, "fedadam": -5, "fedyogi": -5}},
    # the client lr is FedOpt's 10^2 times the batch size: TFF's tag-prediction task sums the per-post losses of a
    # batch (Keras' Reduction.SUM), jaxfl's trainer averages them (the same step on a full batch of 100)
    "stackoverflow_lr": {"prefix": "tff_stackoverflow_tags", "file": "stackoverflow_train.h5",
                         "run": {"model": "bow_logreg", "clients_per_round": 10, "batch_size": 100, "rounds": 1500},
                         "client_lr": {m: 4 for m in ("fedadagrad", "fedadam", "fedyogi", "fedavgm", "fedavg")},
                         "server_lr": {"fedadagrad": 1, "fedadam": -0.5, "fedyogi": -0.5, "fedavgm": 0, "fedavg": 0},
                         "epsilon": {"fedadagrad": -2, "fedadam": -5, "fedyogi": -5}},
    "cifar100": {"prefix": "tff_cifar100", "file": "fed_cifar100_train.h5",
                 "run": {"model": "resnet18_gn", "clients_per_round": 10, "batch_size": 20, "rounds": 4000},
                 "client_lr": {"fedadagrad": -1, "fedadam": -1.5, "fedyogi": -1.5, "fedavgm": -1.5, "fedavg": -1},
                 "server_lr": {"fedadagrad": -1, "fedadam": 0, "fedyogi": 0, "fedavgm": 0, "fedavg": 0.5},
                 "epsilon": {"fedadagrad": -2, "fedadam": -1, "fedyogi": -1}},
}


def settings(task: str, method: str) -> dict:
    """The RunConfig fields of ``task`` under ``method`` (all but the dataset's PATH)."""
    t = TASKS[task]
    out = {"algorithm": "fedavg", **t["run"], "local_epochs": 1, "optimizer": "sgd", "momentum": 0.0,
           "lr": round(10.0 ** t["client_lr"][method], 6), "server_lr": round(10.0 ** t["server_lr"][method], 6),
           **METHODS[method], "eval_every": 100}
    if method in t["epsilon"]:
        out["server_tau"] = 10.0 ** t["epsilon"][method]
    return out


def toml_text(task: str, method: str) -> str:
    """A config file for ``jaxfl run --config`` (give ``--dataset PREFIX:PATH`` beside it)."""
    t = TASKS[task]
    lines = [f"# FedOpt, {task}, {method}: {SOURCE}; run with --dataset {t['prefix']}:PATH",
             f"# (PATH: the folder holding TFF's {t['file']} and its test file; experiments/fedopt.py)"]
    if method == "fedavg" and task in PAPER_FEDAVG:
        lines.append(f"# accuracy reported: {PAPER_FEDAVG[task]}% ({PAPER_FEDAVG_SOURCE})")
    for k, v in settings(task, method).items():
        lines.append(f"{k} = {json.dumps(v) if isinstance(v, str) else repr(v)}")
    return "\n".join(lines) + "\n"


def write_configs(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for task in TASKS:
        for method in METHODS:
            path = folder / f"{task}_{method}.toml"
            path.write_text(toml_text(task, method))
            written.append(path)
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", help="write one TOML config per (task, method) into this folder, and stop")
    p.add_argument("--data", help="the folder holding TFF's HDF5 files")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="0")
    p.add_argument("--rounds", type=int, default=None, help="fewer rounds than the task's (default: the task's)")
    p.add_argument("--out", default="runs/fedopt")
    args = p.parse_args(argv)
    if args.write:
        for path in write_configs(Path(args.write)):
            print(path)
        return
    tasks = parse_list(args.tasks, "--tasks", choices=tuple(TASKS))
    methods = parse_list(args.methods, "--methods", choices=tuple(METHODS))
    seeds = parse_seeds(args.seeds)
    if args.rounds is not None:
        check_at_least("--rounds", args.rounds, 1)
    if not args.data:
        raise ConfigError("--data DIR (the folder holding TFF's HDF5 files) or --write DIR is needed")
    rows = ["| task | method | rounds | weighted accuracy % (pooled test; mean ± std over seeds) | "
            "mean accuracy % over clients | paper % (FedAvg only) |", "|---|---|---|---|---|---|"]
    for task in tasks:
        t = TASKS[task]
        train = Path(args.data) / t["file"]
        test = train.with_name(t["file"].replace("train", "test"))
        missing = [str(f) for f in (train, test) if not f.is_file()]
        if missing:
            print(f"{task}: skipped, missing {', '.join(missing)}", flush=True)
            continue
        for method in methods:
            fields = settings(task, method)
            if args.rounds is not None:
                fields.update(rounds=args.rounds, eval_every=min(fields["eval_every"], args.rounds))
            base = RunConfig(dataset=f"{t['prefix']}:{args.data}", **fields)
            hists = run_seeds("fedavg", base, Path(args.out) / task / method, seeds)
            last = [[h for h in hist if "mean_accuracy" in h][-1] for hist in hists]
            cell = lambda key: (f"{100 * np.mean([r[key] for r in last]):.2f} ± "  # noqa: E731
                                f"{100 * np.std([r[key] for r in last]):.2f}")
            paper = PAPER_FEDAVG.get(task) if method == "fedavg" else None
            rows.append(f"| {task} | {method} | {last[0]['round']} | {cell('weighted_accuracy')} | "
                        f"{cell('mean_accuracy')} | {'' if paper is None else paper} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + f"\n\npaper: {PAPER_FEDAVG_SOURCE}\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
