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

``--compare``: per method, final and last-5 mean accuracy of both sides, the difference and the agreement criterion
(``pfl_setting.compare_methods``), as the PFLlib adapter reports it. See experiments/official/fedrepo.md.

Stragglers (``experiments/fedprox_stragglers.py``'s setting; chosen when the jaxfl run's model is ``logreg``):

    FEDREPO_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/fedrepo.py --method fednova \
        --jaxfl-run experiments/logs/fedprox_stragglers/s0.9/seed0/fednova_stragglers0.9 --out ../runs/x
    # FedNova at s = 0.5, 0.9 (lr 0.03 and 0.01) and FedAvg keeping partial work (against jaxfl's fedprox mu=0)
    FEDREPO_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/fedrepo.py --stragglers-grid \
        --levels 0.5,0.9 --seeds 0,1,2 --out experiments/logs/official/fedrepo_stragglers
    python experiments/official/fedrepo.py --stragglers-compare --out experiments/logs/official/fedrepo_stragglers

MNIST, ``logreg`` (784-10), 1,000 ``shards`` clients of two digits, 10 a round, E = 20, batch 10, plain SGD, and
each client of a round a straggler with chance s that runs a uniformly random 1..19 of its 20 epochs. The same
parts of FedRepo run unchanged (the class's ``train()`` loop, ``update_local`` with its step count
max(int(E len(loader)), 5) over a reshuffled loader, the gradient clip at norm 100, ``update_global``); what
differs from the setting above:
- Model. ``logreg``: flatten - ``fc`` (784 -> classes), returning ``(flattened input, logits)``, with jaxfl's
  initial weights of the run's seed (``head.fc1.linear``; jaxfl flattens NHWC, the same order at one channel).
- Cohorts. FedRepo's ``train()`` draws each round's clients with ``np.random.choice(self.clients, k, replace=False)``
  (k = int(c_ratio N); c_ratio is set to 10 / 1000). The adapter gives the method's module a ``numpy`` whose
  ``random.choice`` returns jaxfl's cohort of that round instead (``common.jaxfl_inputs``: ``sample_cohort`` on the
  run's root key), every other attribute being numpy's own; what FedRepo does with the cohort is unchanged.
- Local epochs. FedRepo reads ``args.local_epochs`` inside ``update_local``; the adapter's wrapper of
  ``update_local`` sets it, before each call, to jaxfl's draw for that client and round
  (``jaxfl.core.trainer.local_epochs(jaxfl.core.cohort.straggler_work(root, round, cohort, s), 20)``: the very
  functions jaxfl's engine calls) and restores 20 after. Each client's FedRepo step count is checked against the
  ``train_steps`` the jaxfl run logged for it in that round (a mismatch stops the run: cohorts, draws and client
  sizes are then not jaxfl's).
- Clip. ``torch.nn.utils.clip_grad_norm_`` is wrapped to record the norms it returns (unchanged otherwise): each
  evaluated record holds ``max_grad_norm_seen`` and ``clipped_steps`` since the previous record.
- Metric (jaxfl's ``weighted_accuracy``, the experiment's metric): the global model on all clients' test images
  pooled, after aggregation, every ``eval_every``-th round and the last (jaxfl's schedule); ``mean_accuracy`` is
  the mean of the per-client accuracies (clients with test images). Per-client arrays are not written (the
  committed jaxfl logs drop them too); each record keeps ``train_steps`` and ``train_count`` of the cohort.
- FedAvg's control is jaxfl's ``fedprox:mu=0`` run (partial work kept, averaged by samples).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common import MetricsLog, jaxfl_inputs, read_log, to_nchw_float
from pfl_setting import LOGREG_LAYERS, Library, check_setting, load_jaxfl_init, two_nn

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
    if cfg.model == "logreg":
        return run_stragglers(args, cfg)
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


# --- experiments/fedprox_stragglers.py's setting ----------------------------------------------------------------

STRAGGLERS_SETTING = dict(model="logreg", partition="shards", batch_size=10, optimizer="sgd", momentum=0.0,
                          weight_decay=0.0, weighting="samples", server_opt="none")
# which jaxfl run each FedRepo method is compared with: FedNova with FedNova, FedAvg with fedprox mu=0 (partial
# work kept and averaged; FedRepo's FedAvg keeps every client's work)
STRAGGLERS_JAXFL = {"fednova": ("fednova", {}), "fedavg": ("fedprox", {"mu": 0.0})}


def check_stragglers_setting(cfg, run: str, method: str) -> None:
    """Exit with one line unless ``cfg`` is a run of ``fedprox_stragglers.py``'s setting whose algorithm is the
    counterpart of FedRepo's ``method`` (``STRAGGLERS_JAXFL``)."""
    algorithm, opts = STRAGGLERS_JAXFL.get(method, (None, None))
    if algorithm is None:
        raise SystemExit(f"fedrepo: error: --method {method} has no counterpart in the stragglers setting "
                         f"(one of {', '.join(STRAGGLERS_JAXFL)})")
    wrong = [f"{k} {getattr(cfg, k)!r} (needs {v!r})" for k, v in STRAGGLERS_SETTING.items() if getattr(cfg, k) != v]
    if cfg.algorithm != algorithm or any(cfg.options.get(algorithm, {}).get(k, v) != v for k, v in opts.items()):
        wrong.append(f"algorithm {cfg.algorithm} {dict(cfg.options)} (needs {algorithm} {opts})")
    if not cfg.clients_per_round:
        wrong.append("clients_per_round None (needs a cohort size)")
    if wrong:
        raise SystemExit(f"fedrepo: error: {run} is not a run of fedprox_stragglers.py's setting for {method}: "
                         f"{', '.join(wrong)}")


def logreg(num_classes: int = 10):
    """jaxfl's ``logreg`` in torch: logits = fc(flatten(x)); ``forward`` returns ``(flatten(x), logits)`` as
    FedRepo's networks return ``(features, logits)``."""
    import torch.nn as nn

    class LogReg(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(784, num_classes)

        def forward(self, x):
            h = x.flatten(1)
            return h, self.fc(h)

    return LogReg()


def straggler_epochs(cfg, cohorts) -> list[dict[int, int]]:
    """Per round (0-based): {client id: local epochs} of the cohort, as jaxfl's engine draws them
    (``core.step.cohort_train``: ``straggler_work(root, round, ids, s)``, root = key(seed); then
    ``core.trainer.local_epochs(work, E)``: 1 + floor(work (E - 1))); every client runs E when s = 0."""
    import jax
    import jax.numpy as jnp
    from jaxfl.core.cohort import straggler_work
    from jaxfl.core.trainer import local_epochs

    root = jax.random.key(cfg.seed)
    out = []
    for r, ids in enumerate(cohorts):
        ids = jnp.asarray(ids, jnp.int32)
        if cfg.stragglers:
            epochs = np.asarray(local_epochs(straggler_work(root, r, ids, cfg.stragglers), cfg.local_epochs))
        else:
            epochs = np.full(len(ids), cfg.local_epochs)
        out.append({int(i): int(e) for i, e in zip(np.asarray(ids), epochs)})
    return out


class _CohortNumpy:
    """numpy for a FedRepo algorithm module, except ``random.choice``: it returns the next round's jaxfl cohort
    (client names), checking that FedRepo asks for that many clients without replacement."""

    def __init__(self, cohorts: list[list[str]]):
        self.cohorts, self.drawn = cohorts, 0
        outer = self

        class Random:
            def __getattr__(self, name):
                return getattr(np.random, name)

            @staticmethod
            def choice(a, size=None, replace=True, p=None):
                names = outer.cohorts[outer.drawn]
                if size != len(names) or replace or p is not None or not set(names) <= set(a):
                    raise RuntimeError(f"FedRepo drew {size} of {len(a)} clients (replace={replace}); jaxfl's "
                                       f"cohort has {len(names)}")
                outer.drawn += 1
                return np.array(names)

        self.random = Random()

    def __getattr__(self, name):
        return getattr(np, name)


def run_stragglers(args, cfg) -> None:
    """One FedRepo run of ``args.method`` in ``fedprox_stragglers.py``'s setting, on the jaxfl run's clients,
    cohorts, straggler draws, initial weights, lr and rounds (see the module docstring)."""
    import importlib
    import types

    import torch

    check_stragglers_setting(cfg, args.jaxfl_run, args.method)
    method = METHODS[args.method]
    jaxfl_log = read_log(Path(args.jaxfl_run) / "metrics.jsonl")
    jaxfl_steps = {rec["round"]: dict(zip(rec["clients_trained"], rec["train_steps"])) for rec in jaxfl_log
                   if "train_steps" in rec}
    inputs = jaxfl_inputs(cfg)
    csets, gset = client_sets(inputs)
    names, n = inputs.client_names, inputs.num_clients
    k = len(inputs.cohorts[0])
    epochs = straggler_epochs(inputs.cfg, inputs.cohorts)
    cohort_names = [[names[int(i)] for i in ids] for ids in inputs.cohorts]
    torch.set_num_threads(1)
    model = logreg(inputs.num_classes)
    load_jaxfl_init(model, cfg, LOGREG_LAYERS)
    c_ratio = k / n
    assert int(c_ratio * n) == k, (k, n)
    arguments = dict(SETTING_ARGUMENTS, local_epochs=cfg.local_epochs, c_ratio=c_ratio, n_classes=inputs.num_classes,
                     lr=cfg.lr, max_round=cfg.rounds, test_round=cfg.rounds + 1, **method.arguments)
    module = importlib.import_module(f"algorithms.{method.module}")
    module.np = _CohortNumpy(cohort_names)  # FedRepo's train(): np.random.choice -> jaxfl's cohort
    algo = getattr(module, method.cls)(csets, gset, model, types.SimpleNamespace(**arguments))
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)

    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def observed_clip(*a, **kw):  # FedRepo's clip, unchanged; the norm it returns is recorded
        total = clip(*a, **kw)
        norms.append(float(total))
        return total

    torch.nn.utils.clip_grad_norm_ = observed_clip

    config = {"official": REPO, "commit": args.commit, "algorithm": method.cls, "jaxfl_variant": args.method,
              "setting": "fedprox_stragglers", "jaxfl_run": str(args.jaxfl_run), "jaxfl_algorithm": cfg.algorithm,
              "seed": cfg.seed, "lr": cfg.lr, "rounds": cfg.rounds, "stragglers": cfg.stragglers,
              "eval_every": cfg.eval_every, "arguments": arguments, "out": str(args.out)}
    log = MetricsLog(args.out, names, config)
    index = {name: i for i, name in enumerate(names)}
    counts = np.array([len(csets[name][1]) for name in names])
    starts = np.concatenate([[0], np.cumsum(counts)])
    client_of = {id(loader): name for name, loader in algo.train_loaders.items()}
    update_local, update_global = algo.update_local, algo.update_global
    losses: dict[str, float] = {}
    steps: dict[str, int] = {}
    clip_since: list[float] = []

    def straggling_update_local(*a, **kw):
        r, name = kw["r"], client_of[id(kw["train_loader"])]
        if algo_np.drawn != r:
            raise RuntimeError(f"update_local of round {r} after {algo_np.drawn} cohort draws")
        algo.args.local_epochs = epochs[r - 1][index[name]]  # jaxfl's draw for this client and round
        norms.clear()
        try:
            out = update_local(*a, **kw)
        finally:
            algo.args.local_epochs = cfg.local_epochs
        steps[name] = len(norms)  # one clip per optimizer step
        clip_since.extend(norms)
        want = jaxfl_steps.get(r, {}).get(name)
        if want is not None and int(want) != steps[name]:
            raise RuntimeError(f"round {r}, {name}: FedRepo ran {steps[name]} steps, the jaxfl run {int(want)}")
        losses[name] = float(out[-1])
        return out

    def evaluated_update_global(*a, **kw):
        update_global(*a, **kw)
        r = kw["r"]
        trained = sorted(index[name] for name in losses)
        extra = {"train_steps": [steps[names[i]] for i in trained],
                 "train_count": [len(csets[names[i]][0]) for i in trained]}
        if r % cfg.eval_every == 0 or r == cfg.rounds:
            algo.model.eval()
            with torch.no_grad():
                _, logits = algo.model(torch.from_numpy(gset.xs))
            right = logits.argmax(1).numpy() == gset.ys
            per_client = [right[a:b].mean() for a, b in zip(starts[:-1], starts[1:]) if b > a]
            extra.update(mean_accuracy=float(np.mean(per_client)), weighted_accuracy=float(right.mean()),
                         max_grad_norm_seen=max(clip_since), clipped_steps=int(sum(v > 100.0 for v in clip_since)))
            clip_since.clear()
        rec = log.round(r, trained, train_loss=[losses[names[i]] for i in trained], **extra)
        losses.clear()
        steps.clear()
        if args.progress and "weighted_accuracy" in rec:
            print(f"round {r}: pooled test accuracy {rec['weighted_accuracy']:.4f}", flush=True)

    algo_np = module.np
    algo.update_local, algo.update_global = straggling_update_local, evaluated_update_global
    algo.train()


def stragglers_runs(levels, seeds, root: Path) -> list[tuple[str, float, int, Path, dict]]:
    """(FedRepo method, s, seed, jaxfl run, its config.json) of fedprox_stragglers.py's logs under ``root``:
    FedNova (lr 0.03 and 0.01) and FedAvg against fedprox mu=0, where present."""
    out = []
    for s in levels:
        tail = f"_stragglers{s:g}" if s else ""  # s = 0: the runs without stragglers
        for label, folder in [("fednova", f"fednova{tail}"), ("fednova", f"fednova{tail}_lr0.01"),
                              ("fedavg", f"fedprox_mu0{tail}")]:
            for seed in seeds:
                run = root / f"s{s:g}" / f"seed{seed}" / folder
                if (run / "config.json").exists():
                    out.append((label, s, seed, run, json.loads((run / "config.json").read_text())))
    return out


def stragglers_main(argv) -> None:
    """``--stragglers-grid``: run FedRepo's FedNova / FedAvg against ``fedprox_stragglers.py``'s logs (each run in
    a process of its own, skipped when finished), then ``--stragglers-compare``: the table."""
    import argparse
    import subprocess
    import sys

    from common import agreement_bound
    from pfl_setting import finished
    p = argparse.ArgumentParser(description="FedRepo in fedprox_stragglers.py's setting")
    p.add_argument("--stragglers-grid", action="store_true")
    p.add_argument("--stragglers-compare", action="store_true")
    p.add_argument("--levels", default="0.5,0.9")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default="fednova,fedavg", help="FedRepo methods; fednova@0.01: only lr 0.01 ...")
    p.add_argument("--jaxfl-logs", default=str(Path(__file__).resolve().parent.parent / "logs" / "fedprox_stragglers"))
    p.add_argument("--out", required=True, help="the adapter's runs: s<s>/seed<k>/<jaxfl run folder>/")
    p.add_argument("--commit", default=LIBRARY.commit)
    p.add_argument("--table", help="also write the markdown table here")
    args = p.parse_args(argv)
    levels = [float(x) for x in args.levels.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = stragglers_runs(levels, seeds, Path(args.jaxfl_logs))
    wanted = set(args.methods.split(","))
    runs = [run for run in runs if run[0] in wanted or f"{run[0]}@{run[4]['lr']:g}" in wanted]
    if args.stragglers_grid:
        for method, s, seed, run, config in runs:
            out = Path(args.out) / f"s{s:g}" / f"seed{seed}" / run.name
            if finished(out, config["rounds"]):
                continue
            print(f"FedRepo {method}, s {s:g}, seed {seed} ({run.name})", flush=True)
            subprocess.run([sys.executable, __file__, "--method", method, "--jaxfl-run", str(run), "--out", str(out),
                            "--commit", args.commit], check=True)
    load = lambda path: read_log(path / "metrics.jsonl")
    from common import experiments_common
    ec = experiments_common()
    rows = ["| s | FedRepo method | jaxfl run | lr | FedRepo final | jaxfl final | difference | bound | verdict | "
            "FedRepo last-5 | jaxfl last-5 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for method, s, seed, run, config in runs:
        out = Path(args.out) / f"s{s:g}" / f"seed{seed}" / run.name
        if finished(out, config["rounds"]):
            groups.setdefault((s, method, run.name, config["lr"]), []).append((load(out), load(run)))
    for (s, method, folder, lr), pairs in groups.items():
        off = ec.seed_stats([o for o, _ in pairs], key="weighted_accuracy")
        jax_ = ec.seed_stats([j for _, j in pairs], key="weighted_accuracy")
        (o_m, o_s), (j_m, j_s) = off["final"], jax_["final"]
        bound = agreement_bound(o_s, j_s)
        seeds_note = "" if len(pairs) == len(seeds) else f" ({len(pairs)} seeds)"
        rows.append(f"| {s:g} | {method} | {folder}{seeds_note} | {lr:g} | {o_m:.2f} ± {o_s:.2f} | "
                    f"{j_m:.2f} ± {j_s:.2f} | {j_m - o_m:+.2f} | {bound:.2f} | "
                    f"{'agree' if abs(o_m - j_m) <= bound else 'DIFFER'} | "
                    f"{off['tail'][0]:.2f} ± {off['tail'][1]:.2f} | {jax_['tail'][0]:.2f} ± {jax_['tail'][1]:.2f} |")
    # paired by seed and round (the two sides share cohorts, straggler draws and initial weights): the mean
    # over all evaluations, and the mean |difference| of the two curves at an evaluation
    rows += ["", "| s | FedRepo method | jaxfl run | FedRepo, all 20 evaluations | jaxfl, all 20 evaluations | "
             "difference | mean abs difference per evaluation | correlation of the curves |",
             "|---|---|---|---|---|---|---|---|"]
    for (s, method, folder, lr), pairs in groups.items():
        o = np.array([ec.accuracy_curve(o, "weighted_accuracy")[1] for o, _ in pairs]) * 100
        j = np.array([ec.accuracy_curve(j, "weighted_accuracy")[1] for _, j in pairs]) * 100
        corr = np.corrcoef(o.ravel(), j.ravel())[0, 1]
        rows.append(f"| {s:g} | {method} | {folder} | {o.mean():.2f} | {j.mean():.2f} | {j.mean() - o.mean():+.2f} | "
                    f"{np.abs(o - j).mean():.2f} | {corr:.2f} |")
    # the inputs: each round's cohort and each client's step count against the jaxfl log; FedRepo's clip
    rows += ["", "| s | FedRepo method | jaxfl run | rounds with jaxfl's cohort and step counts | clipped steps | "
             "largest gradient norm | jaxfl's p_i (samples) vs FedRepo's 1/k: max abs difference, "
             "mean total variation |",
             "|---|---|---|---|---|---|---|"]
    for (s, method, folder, lr), pairs in groups.items():
        same = sum(a["clients_trained"] == b["clients_trained"]
                   and a["train_steps"] == [int(x) for x in b["train_steps"]]
                   for o, j in pairs for a, b in zip(o, j))
        clipped = sum(a.get("clipped_steps", 0) for o, _ in pairs for a in o)
        largest = max(a.get("max_grad_norm_seen", 0.0) for o, _ in pairs for a in o)
        p = [np.array(a["train_count"], float) / sum(a["train_count"]) for o, _ in pairs for a in o]
        rows.append(f"| {s:g} | {method} | {folder} | {same} of {sum(len(o) for o, _ in pairs)} | {clipped} | "
                    f"{largest:.1f} | {max(np.abs(q - 1 / len(q)).max() for q in p):.4f}, "
                    f"{np.mean([0.5 * np.abs(q - 1 / len(q)).sum() for q in p]):.4f} |")
    # FedNova's extrapolation: tau_eff / min_i tau_i of an evaluated round (the largest factor by which that
    # round's aggregate scales a client's per-step update), against the accuracy right after it
    rows += ["", "| s | FedRepo method | jaxfl run | evaluations after a round with tau_eff / min tau_i >= 10: "
             "FedRepo, jaxfl mean accuracy (count) | the other evaluations: FedRepo, jaxfl | correlation of "
             "tau_eff / min tau_i with accuracy: FedRepo, jaxfl |", "|---|---|---|---|---|---|"]
    for (s, method, folder, lr), pairs in groups.items():
        ext, acc_o, acc_j = [], [], []
        for o, j in pairs:
            for a, b in zip(o, j):
                if "weighted_accuracy" in a:
                    q = np.array(a["train_count"], float) / sum(a["train_count"])
                    steps = np.array(a["train_steps"], float)
                    ext.append((q * steps).sum() / steps.min())
                    acc_o.append(100 * a["weighted_accuracy"])
                    acc_j.append(100 * b["weighted_accuracy"])
        ext, acc_o, acc_j = map(np.array, (ext, acc_o, acc_j))
        big = ext >= 10
        corr = lambda acc: np.corrcoef(ext, acc)[0, 1] if ext.std() > 0 else float("nan")
        rows.append(f"| {s:g} | {method} | {folder} | {acc_o[big].mean() if big.any() else float('nan'):.1f}, "
                    f"{acc_j[big].mean() if big.any() else float('nan'):.1f} ({big.sum()}) | {acc_o[~big].mean():.1f}, "
                    f"{acc_j[~big].mean():.1f} | {corr(acc_o):.2f}, {corr(acc_j):.2f} |")
    table = "\n".join(rows)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")


LIBRARY = Library("FedRepo", REPO, "617ee015046409d95dbd76ba39eebb92d313ab94", "FEDREPO_OFFICIAL",
                  {v: m.official for v, m in METHODS.items()})


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if "--stragglers-grid" in argv or "--stragglers-compare" in argv:
        return stragglers_main(argv)
    LIBRARY.main(argv, __doc__, __file__, run)


if __name__ == "__main__":
    main()
