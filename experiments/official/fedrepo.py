"""FedRepo's code (lxcnju/FedRepo, by FedPHP's first author) on the inputs of ``experiments/pfl_methods.py``'s runs.

    FEDREPO_OFFICIAL=/path/to/FedRepo JAXFL_DATA_DIR=../shared/data python experiments/official/fedrepo.py \\
        --method fedphp --jaxfl-run experiments/logs/pfl_methods/seed0/fedphp_lr0.05 \\
        --out ../runs/official/fedrepo/seed0/fedphp
    # every method FedRepo ships that jaxfl's logs hold, 3 seeds, then the comparison
    FEDREPO_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/fedrepo.py --all \\
        --seeds 0,1,2 --out ../runs/official/fedrepo --table fedrepo.md --figure fedrepo.png

For FedPHP, FedRepo *is* the official code (``algorithms/fedphp.py``; jaxfl's ``fedphp`` follows it, not PFLlib's
port, see ``docs/reference_notes/fedphp.md``). FedRepo's FedNova is a port of the official JYWa/FedNova optimizer
(its ``NovaOptimizer``) with one change of its own, uniform client weights; its FedAvg is the control.

What runs unchanged from the checkout named by ``$FEDREPO_OFFICIAL`` (imported, never copied): the method's
class in ``algorithms/`` (its ``train()`` loop: client order, local training with its step count
max(int(E len(loader)), 5) cycling a shuffled loader, its losses, HPM update, gradient clip at norm 100 and
aggregation) and ``tools.construct_dataloaders`` / ``construct_optimizer``.

What is replaced, and how it is matched:
- Data. FedRepo's ``csets`` ({client: (train set, test set)}) are the clients of the jaxfl run named by
  ``--jaxfl-run`` (``common.jaxfl_inputs``: MNIST, one channel, 20 clients, Dirichlet(0.1) labels, at most 500
  training images, a test set following each client's label mix), normalised as jaxfl does; the global test set
  ``gset`` is all clients' test sets together (FedRepo only reports the global model on it; it is never evaluated:
  ``test_round`` is set past the last round).
- Model. ``pfl_setting.two_nn(with_features=True)``: jaxfl's ``mlp_2nn`` returning ``(features, logits)`` as FedRepo's
  networks do (features = fc2's ReLU output, what FedPHP's MMD variant would compare), with jaxfl's initial
  weights of the run's seed.
- Hyperparameters. The jaxfl run's lr, batch 10, one local epoch, momentum 0, weight decay 0 (jaxfl's setting;
  FedRepo's configs use 0.9 and 1e-5), every client every round (``c_ratio`` 1), FedRepo's own gradient clip at
  norm 100 kept (jaxfl does not clip: far above this setting's gradient norms). FedPHP: ``reg_way`` KD,
  ``reg_lamb`` 0.1 (FedRepo's grid's first pair, jaxfl's defaults). FedNova: ``gmf`` 0, ``prox_mu`` 0 (plain SGD).
- Compatibility. FedRepo calls ``loader_iter.next()``, which DataLoader iterators lost in PyTorch 1.x; the adapter
  gives them ``next`` = ``__next__`` (otherwise its ``except`` branch raises the same error again).
- Seeds. torch, numpy and python's ``random`` seeded with the run's seed once the method's object is built
  (client order, data order).
- Metric. After each round (a hook after ``update_global``): each client's accuracy (correct / test samples, the
  model in eval mode) of the model the method predicts with: FedPHP's HPM (what FedRepo's ``PAcAft`` reports,
  after this round's HPM update), the global model for FedAvg and FedNova (jaxfl's evaluation after aggregation);
  ``mean_accuracy`` is the mean over clients. FedRepo's own ``test`` averages per-batch accuracies, which
  weighs a partial last batch as a full one; the adapter counts samples, as jaxfl does.

Differences by design (``METHODS``): FedAvg and FedNova weight clients uniformly in FedRepo, by training samples in
jaxfl (and in the official FedNova); 2 of the 20 clients hold fewer than 500 images (187 and 363 on seed 0).

``--compare``: per method, final and last-5 mean accuracy of both sides, the difference and issue 32's criterion
(``pfl_setting.compare_methods``), as the PFLlib adapter reports it. See experiments/official/fedrepo.md.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common import MetricsLog, jaxfl_inputs, to_nchw_float
from pfl_setting import Library, check_setting, load_jaxfl_init, two_nn

REPO = "lxcnju/FedRepo"


class FedrepoMethod(NamedTuple):
    """How one jaxfl variant runs in FedRepo."""

    module: str             # algorithms/<module>.py
    cls: str                # its class
    arguments: dict         # the method's arguments, carrying jaxfl's defaults
    official: bool          # FedRepo's code is the method's official code
    personal_model: str     # the attribute holding per-client models it predicts with ("" = the global model)
    note: str = ""          # where jaxfl differs from FedRepo by design


METHODS = {
    "fedavg": FedrepoMethod("fedavg", "FedAvg", {}, False, "", "FedRepo averages uniformly, jaxfl by samples"),
    "fednova": FedrepoMethod("fednova", "FedNova", dict(gmf=0.0, prox_mu=0.0), False, "",
                             "FedRepo's p_i uniform (1 / cohort), jaxfl's and the official code's by samples"),
    "fedphp": FedrepoMethod("fedphp", "FedPHP", dict(reg_way="KD", reg_lamb=0.1), True, "hpms"),
}

# FedRepo's arguments in jaxfl's setting (its configs' keys; the method's own ones come from METHODS)
SETTING_ARGUMENTS = dict(local_epochs=1, local_steps=None, batch_size=10, optimizer="SGD", momentum=0.0,
                         weight_decay=0.0, max_grad_norm=100.0, c_ratio=1.0, cuda=False)


def client_sets(inputs):
    """FedRepo's ``csets`` and ``gset`` from jaxfl's clients: torch datasets with ``xs`` (float32 [n, 1, 28, 28],
    normalised as jaxfl does) and ``ys`` (int64 [n], which FedPHP counts per class)."""
    import torch
    from torch.utils.data import Dataset

    class Arrays(Dataset):
        def __init__(self, x, y):
            self.xs = to_nchw_float(x, inputs.normalize)
            self.ys = np.asarray(y, np.int64)

        def __len__(self):
            return len(self.ys)

        def __getitem__(self, i):
            return torch.from_numpy(self.xs[i]), torch.tensor(self.ys[i])

    csets = {name: (Arrays(*tr), Arrays(*te)) for name, tr, te in zip(inputs.client_names, inputs.train, inputs.test)}
    gset = Arrays(np.concatenate([x for x, _ in inputs.test]), np.concatenate([y for _, y in inputs.test]))
    return csets, gset


def accuracy(model, dataset) -> float:
    """correct / samples of ``model`` (eval mode, FedRepo's ``(features, logits)`` output) on a whole dataset."""
    import torch
    model.eval()
    with torch.no_grad():
        _, logits = model(torch.from_numpy(dataset.xs))
    return float((logits.argmax(1).numpy() == dataset.ys).mean())


def run(args) -> None:
    """One FedRepo run of ``args.method`` on the inputs, lr, seed and rounds of the jaxfl run ``args.jaxfl_run``."""
    import importlib
    import types
    import warnings

    import torch
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    from jaxfl.run.config import RunConfig

    warnings.simplefilter("ignore")
    _BaseDataLoaderIter.next = _BaseDataLoaderIter.__next__  # FedRepo's loader_iter.next() (PyTorch < 1.x)
    method = METHODS[args.method]
    cfg = RunConfig.from_dict(json.loads((Path(args.jaxfl_run) / "config.json").read_text()))
    check_setting(cfg, args.jaxfl_run, "fedrepo")
    inputs = jaxfl_inputs(cfg)
    csets, gset = client_sets(inputs)
    torch.set_num_threads(1)
    model = two_nn(inputs.num_classes, with_features=True)
    load_jaxfl_init(model, cfg)
    arguments = dict(SETTING_ARGUMENTS, n_classes=inputs.num_classes, lr=cfg.lr, max_round=cfg.rounds,
                     test_round=cfg.rounds + 1, **method.arguments)  # test_round: FedRepo's global test never runs
    cls = getattr(importlib.import_module(f"algorithms.{method.module}"), method.cls)
    algo = cls(csets, gset, model, types.SimpleNamespace(**arguments))
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)

    config = {"official": REPO, "commit": args.commit, "algorithm": method.cls, "jaxfl_variant": args.method,
              "jaxfl_run": Path(args.jaxfl_run).name, "seed": cfg.seed, "lr": cfg.lr, "rounds": cfg.rounds,
              "arguments": arguments, "out": str(args.out)}
    log = MetricsLog(args.out, inputs.client_names, config)
    index = {name: i for i, name in enumerate(inputs.client_names)}
    losses: dict[str, float] = {}
    update_local, update_global = algo.update_local, algo.update_global

    # which client an update_local call trains: FedRepo passes only its loader
    client_of = {id(loader): name for name, loader in algo.train_loaders.items()}

    def logged_update_local(*a, **kw):
        out = update_local(*a, **kw)
        losses[client_of[id(kw["train_loader"])]] = float(out[-1])  # every update_local returns its loss last
        return out

    def logged_update_global(*a, **kw):
        update_global(*a, **kw)
        personal = getattr(algo, method.personal_model) if method.personal_model else None
        acc = [accuracy(personal[name] if personal else algo.model, csets[name][1]) for name in inputs.client_names]
        trained = sorted(index[name] for name in losses)
        rec = log.round(kw["r"], trained, train_loss=[losses[inputs.client_names[i]] for i in trained],
                        test_accuracy=acc, test_count=[len(csets[name][1]) for name in inputs.client_names])
        losses.clear()
        if args.progress:
            print(f"round {kw['r']}: mean accuracy {rec['mean_accuracy']:.4f}", flush=True)

    algo.update_local, algo.update_global = logged_update_local, logged_update_global
    algo.train()


LIBRARY = Library("FedRepo", REPO, "617ee015046409d95dbd76ba39eebb92d313ab94", "FEDREPO_OFFICIAL",
                  {v: m.official for v, m in METHODS.items()})


def main(argv=None) -> None:
    LIBRARY.main(argv, __doc__, __file__, run)


if __name__ == "__main__":
    main()
