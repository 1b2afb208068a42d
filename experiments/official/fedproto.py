"""FedProto's official code (yuetan031/FedProto) on the inputs of a jaxfl FedProto run in the pfl_methods setting.

    FEDPROTO_OFFICIAL=/path/to/FedProto JAXFL_DATA_DIR=../shared/data python experiments/official/fedproto.py \\
        --jaxfl-run ../runs/fedproto_official_setting/seed0/fedproto_lr0.01 \\
        --out ../runs/official/fedproto/seed0/fedproto
    # the comparison of finished runs (3 seeds of each side)
    python experiments/official/fedproto.py --compare --official-logs experiments/logs/official/fedproto \\
        --jaxfl-logs experiments/logs/fedproto_official_setting

The jaxfl runs: ``jaxfl run --algorithm fedproto`` in ``experiments/pfl_methods.py``'s data setting (MNIST, 20
clients, Dirichlet(0.1), ``mlp_2nn``, batch 10, one local epoch, 50 rounds) with the official code's optimizer, SGD
lr 0.01 momentum 0.5 (``lib/update.py`` hard-codes momentum 0.5, so pfl_methods' plain-SGD runs cannot be
matched from the official side; the commands are in ``experiments/official/fedproto.md``).

What runs unchanged from the checkout named by ``$FEDPROTO_OFFICIAL`` (imported, never copied):
``exps/federated_main.FedProto_taskheter``, the official round loop (every client trains its own model, which is
never averaged, with ``lib/update.LocalUpdate.update_weights_het``: cross-entropy + ld * MSE to the global
prototypes, prototypes collected from the training forward passes of the last local epoch, drop-last batches;
``lib/utils.agg_func`` and ``proto_aggregation``: the unweighted mean over the clients holding a class) and its
final test.

What is replaced, and how it is matched:
- Data. The clients of the jaxfl run named by ``--jaxfl-run`` (``common.jaxfl_inputs``), normalised as jaxfl does,
  as the concatenated ``train_dataset`` / ``test_dataset`` with ``user_groups`` / ``user_groups_lt`` holding each
  client's index range (the official ``get_dataset`` draws its own n-way k-shot split from torchvision's MNIST).
- Model. ``pfl_setting.two_nn``, returning ``(log_softmax(logits), z)`` as ``CNNMnist`` does (z = the input of
  the last Linear layer, fc2's ReLU output), every client's copy starting from jaxfl's initial weights of the run's
  seed (the official code initialises each client's model separately; jaxfl starts all from one draw).
- Arguments. ``local_bs`` 10, ``train_ep`` 1, ``lr`` the jaxfl run's, ``ld`` 1 (both sides' default),
  ``optimizer`` sgd (momentum 0.5, the official code's), ``rounds`` the run's, every client every round.
- Imports. ``federated_main`` imports torchvision (for its MNIST loader and ResNet) and tensorboardX; where they
  are not installed, empty stand-in modules are registered (neither is used on this path), and its
  ``SummaryWriter`` is replaced by one that writes nothing. ``args.dataset`` is ``"jaxfl"``, so it saves no
  prototype file at the end.
- Seeds. torch, numpy and python's ``random`` seeded with the run's seed before the loop.
- Metric. The official code evaluates once, after the last round (and sums correct/total over clients without
  resetting them). The adapter evaluates after every round (a hook on ``proto_aggregation``: this round's trained
  models and global prototypes), each client's model in eval mode on its own test set, as jaxfl's ``fedproto``
  predicts: the nearest global prototype (mean squared distance) over the classes that have one
  (``test_accuracy``, ``mean_accuracy``); also logged: ``head_mean_accuracy`` (the model's own classifier, the
  official "w/o protos") and ``own_classes_mean_accuracy`` (the nearest prototype among the client's training
  classes only, the official "with protos" rule).

Differences by design (``docs/reference_notes/fedproto.md``): jaxfl computes each client's prototypes after local
training, in eval mode, over all its samples; the official code averages the training forward passes' features
(before each step's update) of the last epoch over drop-last batches. Clients with fewer samples than a multiple
of 10 train on up to 9 fewer samples in the official code (drop-last).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

import numpy as np

from common import MetricsLog, jaxfl_inputs, official_repo, stub_unimportable, to_nchw_float
from pfl_setting import add_comparison_arguments, check_setting, compare_and_write, load_jaxfl_init, two_nn

REPO = "yuetan031/FedProto"


class NoWriter:
    """A ``SummaryWriter`` that writes nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def add_scalar(self, *args, **kwargs):
        pass


def model_with_protos(num_classes: int):
    """``two_nn`` returning ``(log_softmax(logits), z)``, z = the input of its last Linear (``CNNMnist``'s output)."""
    import torch.nn as nn

    class TwoNNProto(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = two_nn(num_classes, with_features=True)

        def forward(self, x):
            z, logits = self.net(x)
            return nn.functional.log_softmax(logits, dim=1), z

    return TwoNNProto()


def prototype_accuracy(z, y, protos: dict, allowed=None) -> float:
    """Accuracy of ŷ = argmin_j mean((z - P_j)^2) over the classes j with a prototype (and in ``allowed``).
    z: [n, d]; y: [n]; protos: {class: [P_j]}, FedProto's global prototype dict."""
    import torch
    classes = sorted(j for j in protos if allowed is None or j in allowed)
    if not classes:
        return float("nan")
    P = torch.stack([protos[j][0] for j in classes])                    # [c, d]
    dist = ((z[:, None, :] - P[None]) ** 2).mean(-1)                    # [n, c]
    pred = np.asarray(classes)[dist.argmin(1).numpy()]
    return float((pred == y).mean())


def run(args) -> None:
    """The official FedProto loop on the inputs, lr, seed and rounds of the jaxfl run ``args.jaxfl_run``."""
    import torch
    from jaxfl.run.config import RunConfig

    cfg = RunConfig.from_dict(json.loads((Path(args.jaxfl_run) / "config.json").read_text()))
    check_setting(cfg, args.jaxfl_run, "fedproto", momentum=0.5, algorithm="fedproto")  # the official optimizer
    repo = official_repo("FEDPROTO_OFFICIAL", REPO)  # before loading any data
    inputs = jaxfl_inputs(cfg)
    # federated_main and lib/ import torchvision (lib/utils.py builds its CIFAR transforms at import) and
    # tensorboardX at the top; this path uses neither
    stub_unimportable("torchvision", ("datasets", "transforms", "models"))
    stub_unimportable("tensorboardX")
    spec = importlib.util.spec_from_file_location("federated_main", repo / "exps" / "federated_main.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)  # puts lib/ and lib/models/ on sys.path itself
    torch.set_num_threads(1)

    def concat(parts):
        xs = [to_nchw_float(x, inputs.normalize) for x, _ in parts]
        ys = [np.asarray(y, np.int64) for _, y in parts]
        bounds = np.cumsum([0] + [len(y) for y in ys])
        data = list(zip(np.concatenate(xs), np.concatenate(ys).tolist()))  # dataset[i] -> (image, label)
        return data, {i: np.arange(bounds[i], bounds[i + 1]) for i in range(len(parts))}, xs, ys

    train_dataset, user_groups, _, train_ys = concat(inputs.train)
    test_dataset, user_groups_lt, test_xs, test_ys = concat(inputs.test)
    classes_list = [sorted(set(y.tolist())) for y in train_ys]
    first = model_with_protos(inputs.num_classes)
    load_jaxfl_init(first.net, cfg)
    models = [first] + [copy.deepcopy(first) for _ in range(inputs.num_clients - 1)]
    oargs = types.SimpleNamespace(rounds=cfg.rounds, num_users=inputs.num_clients, train_ep=1, local_bs=10, lr=cfg.lr,
                                  optimizer="sgd", ld=1.0, num_classes=inputs.num_classes, device="cpu", verbose=0,
                                  dataset="jaxfl", mode="task_heter", ways=0, shots=0, stdev=0)

    config = {"official": REPO, "commit": args.commit, "algorithm": "FedProto_taskheter", "jaxfl_variant": "fedproto",
              "jaxfl_run": Path(args.jaxfl_run).name, "seed": cfg.seed, "lr": cfg.lr, "momentum": 0.5,
              "rounds": cfg.rounds, "arguments": vars(oargs), "out": str(args.out)}
    log = MetricsLog(args.out, inputs.client_names, config)
    losses: dict[int, float] = {}
    rounds_done = [0]
    aggregate, local_update = fm.proto_aggregation, fm.LocalUpdate

    class LoggedLocalUpdate(local_update):
        def update_weights_het(self, oargs, idx, *a, **kw):
            out = super().update_weights_het(oargs, idx, *a, **kw)
            losses[int(idx)] = float(out[1]["total"])
            return out

    def logged_aggregation(local_protos):
        protos = aggregate(local_protos)
        rounds_done[0] += 1
        acc, head, own = [], [], []
        with torch.no_grad():
            for i, model in enumerate(models):
                model.eval()
                log_probs, z = model(torch.from_numpy(test_xs[i]))
                acc.append(prototype_accuracy(z, test_ys[i], protos))
                own.append(prototype_accuracy(z, test_ys[i], protos, allowed=classes_list[i]))
                head.append(float((log_probs.argmax(1).numpy() == test_ys[i]).mean()))
        trained = sorted(losses)
        rec = log.round(rounds_done[0], trained, train_loss=[losses[i] for i in trained], test_accuracy=acc,
                        test_count=[len(y) for y in test_ys], head_mean_accuracy=float(np.mean(head)),
                        own_classes_mean_accuracy=float(np.mean(own)))
        losses.clear()
        if args.progress:
            print(f"round {rounds_done[0]}: mean accuracy {rec['mean_accuracy']:.4f} (head "
                  f"{rec['head_mean_accuracy']:.4f})", file=sys.stderr, flush=True)
        return protos

    fm.proto_aggregation, fm.LocalUpdate, fm.SummaryWriter = logged_aggregation, LoggedLocalUpdate, NoWriter
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    fm.FedProto_taskheter(oargs, train_dataset, test_dataset, user_groups, user_groups_lt, models, classes_list)


def compare(args) -> None:
    """The comparison table (``pfl_setting.compare_methods``: final and last-5 mean accuracy, the agreement
    criterion) and, with ``--figure``, the curves."""
    compare_and_write(args, "official", {"fedproto": True},
                      f"FedProto's official code ({REPO} {args.commit[:7]}) vs jaxfl on jaxfl's inputs (pfl_methods' "
                      f"data, SGD momentum 0.5)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jaxfl-run", help="the jaxfl fedproto run (folder with config.json) whose inputs, lr, seed and "
                   "rounds the official run takes")
    p.add_argument("--out", help="output folder of the run")
    p.add_argument("--commit", default="97e42e2741e1ae2e2fce2465e80f38f6997f8836", help="the checkout's commit")
    p.add_argument("--progress", action="store_true")
    add_comparison_arguments(p, jaxfl_logs=None)
    args = p.parse_args(argv)
    if args.compare:
        if not (args.official_logs and args.jaxfl_logs):
            p.error("--compare needs --official-logs and --jaxfl-logs")
        compare(args)
    else:
        if not (args.out and args.jaxfl_run):
            p.error("a run needs --jaxfl-run and --out (or use --compare)")
        run(args)


if __name__ == "__main__":
    main()
