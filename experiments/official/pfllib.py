"""PFLlib's training loops (TsingZ0/PFLlib, HEAD d832e76) for the methods of ``experiments/pfl_methods.py``,
on jaxfl's exact inputs: a result-level check of the twelve PFLlib / FL-bench methods against a reference
implementation.

    PFLLIB_OFFICIAL=/path/to/PFLlib JAXFL_DATA_DIR=../shared/data python experiments/official/pfllib.py \\
        --method fedala --jaxfl-run experiments/logs/pfl_methods/seed0/fedala_lr0.05 \\
        --out ../runs/official/pfllib/seed0/fedala
    # every method PFLlib has, at the learning rate jaxfl's grid chose, 3 seeds, then the comparison:
    PFLLIB_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/pfllib.py --all \\
        --jaxfl-logs experiments/logs/pfl_methods --seeds 0,1,2 --out ../runs/official/pfllib \\
        --figure experiments/figures/pfllib_vs_jaxfl.png

For FedALA, FedCP, GPFL and FedDBE, PFLlib *is* the official code (same first author; the notes in
``docs/reference_notes/`` found the algorithm files identical up to names). For the other methods PFLlib is one
of the references jaxfl was read against, and some of jaxfl's choices differ from it by design (listed per method
in ``METHODS`` and in ``experiments/official/pfllib.md``); there the comparison measures what those choices cost
or gain, and agreement is not expected.

What runs unchanged from the checkout named by ``$PFLLIB_OFFICIAL`` (imported from its ``system/`` folder, never
copied): each method's server class (``flcore/servers/server*.py``: its ``train()`` loop, client selection, model
sending, aggregation and evaluation) with its client class, ``utils/data_utils.read_client_data`` and the base
classes (``serverbase.Server``, ``clientbase.Client``: plain SGD, cross-entropy, DataLoaders with shuffled,
drop-last training batches).

What is replaced, and how it is matched:
- Data. PFLlib's generated ``dataset/MNIST`` folders are replaced by the clients of the jaxfl run named by
  ``--jaxfl-run`` (``common.jaxfl_inputs`` of its ``config.json``; in ``pfl_methods.py``'s setting: MNIST, one
  channel, 20 clients, Dirichlet(0.1) labels, at most 500 training images, a test set following each client's
  label mix), written in PFLlib's
  format (``train/<i>.npz`` and ``test/<i>.npz`` holding ``{"x": float NCHW, "y": int64}``), normalised as jaxfl
  does, under ``--data-root``. PFLlib reads them through ``--dataset`` given as that absolute path.
- Model. PFLlib's MNIST models are the 4-layer CNN and a 1-hidden-layer DNN; ``pfl_setting.two_nn`` is jaxfl's
  ``mlp_2nn`` (784-200-200-10, ReLU) in torch, its classifier named ``fc`` as PFLlib's models name it, so that
  PFLlib's ``BaseHeadSplit`` (base = the two hidden layers, head = ``fc``) and FedALA's ``layer_idx`` = 2 (the
  last two parameter tensors) take the same parts as jaxfl's encoder / head and ``layers="head_last"``. Its
  initial weights are those of jaxfl's run of the same seed (``Experiment.init`` of fedavg; every algorithm draws
  the base model alike), PFLlib's extra modules (FedCP's CPN, GPFL's GCE and CoV, ...) keep PFLlib's init.
- Seeds. PFLlib seeds torch with 0 at import and in every client's constructor (so its runs differ by nothing);
  the adapter seeds torch, numpy and python's ``random`` with ``--seed`` after the server is built (data order,
  client order, Gumbel noise, FedFomo's/FedAMP's draws).
- Hyperparameters. Every method runs with jaxfl's defaults mapped onto PFLlib's arguments (``METHODS``: e.g.
  FedCP ``lamda`` 5, GPFL ``lamda`` 0.01 and ``mu`` 0.1, FedDBE ``momentum`` 1 and ``kl_weight`` 50, FedAMP
  ``sigma`` 1e4), the jaxfl run's client learning rate (the one jaxfl's grid chose for the method), batch 10, one
  local epoch, every client every round; every other argument keeps PFLlib ``main.py``'s default
  (``PFLLIB_DEFAULTS``).
- Rounds. PFLlib evaluates at the start of round i (before training, after sending the models: the state after
  i rounds), FedPHP after local training (after i + 1 rounds); the adapter logs each evaluation under the number
  of rounds trained and stops the loop once round ``--rounds`` is logged (PFLlib would train one round more).
- Diagnostic (``--fedlc-counts client``): FedLC's offsets from each client's own label counts (absent classes
  counted as 1e-8), jaxfl's rule, set on PFLlib's clients after the server is built; everything else PFLlib's.
- Metric. Each client's accuracy (correct / test samples) from PFLlib's ``test_metrics``; ``mean_accuracy`` (the
  mean over clients, what jaxfl's tables compare) and ``weighted_accuracy`` (PFLlib's own number) follow.

Writes ``--out/config.json`` and ``--out/metrics.jsonl`` (jaxfl's format, ``common.MetricsLog``). ``--all``
writes ``--out/seed<s>/<variant>/`` per method and seed (a finished run is kept), then runs ``--compare``.
``--compare --official-logs DIR --jaxfl-logs DIR``: per method, final and last-5 mean accuracy of both sides
(mean ± std over seeds), the difference and the criterion max(2 pooled seed-stds, 1.5 points); a figure with
one panel per method (``--figure``). See experiments/official/pfllib.md.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import types
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common import MetricsLog, jaxfl_inputs, to_nchw_float
from pfl_setting import Library, check_setting, load_jaxfl_init, two_nn

REPO = "TsingZ0/PFLlib"

# PFLlib main.py's defaults (system/main.py L391-499) of every argument the servers and clients below read;
# the run's settings and each method's mapping replace some of them.
PFLLIB_DEFAULTS = dict(
    goal="test", device="cpu", device_id="0", num_classes=10, batch_size=10, local_learning_rate=0.005,
    learning_rate_decay=False, learning_rate_decay_gamma=0.99, global_rounds=2000, top_cnt=100, local_epochs=1,
    join_ratio=1.0, random_join_ratio=False, num_clients=20, prev=0, times=1, eval_gap=1,
    save_folder_name="items", auto_break=False, dlg_eval=False, dlg_gap=100, batch_num_per_client=2,
    num_new_clients=0, fine_tuning_epoch_new=0, feature_dim=512, vocab_size=80, max_len=200, few_shot=0,
    client_drop_rate=0.0, train_slow_rate=0.0, send_slow_rate=0.0, time_select=False, time_threthold=10000,
    beta=0.0, lamda=1.0, mu=0.0, K=5, p_learning_rate=0.01, M=5, itk=4000, alphaK=1.0, sigma=1.0, alpha=1.0,
    plocal_epochs=1, tau=1.0, fine_tuning_epochs=10, dr_learning_rate=0.0, L=1.0, noise_dim=512,
    generator_learning_rate=0.005, hidden_dim=512, server_epochs=1000, localize_feature_extractor=False,
    server_learning_rate=1.0, eta=1.0, rand_percent=80, layer_idx=2, mentee_learning_rate=0.005, T_start=0.95,
    T_end=0.98, momentum=0.1, kl_weight=0.0, first_stage_bound=0, fedcross_alpha=0.99,
    collaberative_model_select_strategy=1)

class PfllibMethod(NamedTuple):
    """How one jaxfl variant runs in PFLlib."""

    algorithm: str     # PFLlib's ``--algorithm``
    module: str        # its server module under flcore/servers/
    cls: str           # its server class
    split: bool        # whether main.py splits the model into base + head for it
    overrides: dict    # PFLlib arguments that carry jaxfl's defaults
    official: bool     # PFLlib's code *is* the method's official code (same authors)
    note: str = ""     # where jaxfl differs from PFLlib by design


METHODS = {
    "fedavg": PfllibMethod("FedAvg", "serveravg", "FedAvg", True, {}, False),
    "local": PfllibMethod("Local", "serverlocal", "Local", False, {}, False),
    "fedala": PfllibMethod("FedALA", "serverala", "FedALA", False, dict(eta=1.0, rand_percent=80, layer_idx=2), True,
                           "PFLlib's ALA.py is the authors'"),
    "fedcp": PfllibMethod("FedCP", "servercp", "FedCP", True, dict(lamda=5.0), True, "lamda 5 (its run_me.sh)"),
    "gpfl": PfllibMethod("GPFL", "servergpfl", "GPFL", True, dict(lamda=0.01, mu=0.1), True,
                         "lamda 0.01, mu 0.1 (its run_me.sh for MLPs/CNNs)"),
    "feddbe": PfllibMethod("FedDBE", "serverdbe", "FedDBE", True, dict(momentum=1.0, kl_weight=50.0), True,
                           "momentum 1, kl_weight 50 (its run_me.sh)"),
    "fedproto": PfllibMethod("FedProto", "serverproto", "FedProto", True, dict(lamda=1.0), False,
                             "local prototypes: jaxfl after training in eval mode, PFLlib averaged over the "
                             "training batches"),
    "fedamp": PfllibMethod("FedAMP", "serveramp", "FedAMP", False, dict(alphaK=1.0, lamda=1.0, sigma=1e4), False,
                           "proximal term: jaxfl squared (the paper), PFLlib not squared; attention over all "
                           "clients' last uploads vs last round's uploaders (the same under full participation)"),
    "apfl": PfllibMethod("APFL", "serverapfl", "APFL", False, dict(alpha=0.5), False,
                         "jaxfl trains the personal model through the mixture and differentiates alpha exactly "
                         "(the paper); PFLlib trains the personal model on its own loss, alpha by a surrogate with "
                         "+0.02 alpha"),
    "perfedavg": PfllibMethod("PerAvg", "serverperavg", "PerAvg", False, {}, False,
                              "PFLlib calls the client's meta-training twice per round: 2 passes of n / 2B "
                              "batch-pair steps, jaxfl 1 (FL-bench's count); beta = lr in both"),
    "fedfomo": PfllibMethod("FedFomo", "serverfomo", "FedFomo", False, dict(M=4), False,
                            "jaxfl follows the official code (self + 4 models chosen epsilon-greedily, L1 "
                            "distance, held-out 20% validation per client); PFLlib takes the top-M by affinity, "
                            "L2 distance, the last 20%"),
    "fedphp": PfllibMethod("FedPHP", "serverphp", "FedPHP", True, dict(lamda=0.1, mu=0.9), False,
                           "jaxfl follows the authors' FedRepo (KD from the HPM, mu from the participation count, "
                           "predicts with the HPM); PFLlib distils by MMD, mu = 0.9 R / T, and predicts with the "
                           "trained local model"),
    "fedlc": PfllibMethod("FedLC", "serverlc", "FedLC", True, dict(tau=1.0), False,
                          "calibration counts: jaxfl per client (paper, FL-bench), PFLlib summed over all clients"),
}
# jaxfl methods of pfl_methods.py that PFLlib does not ship: fednova, perfedavg:variant=hf.


def write_pfllib_dataset(inputs, root: Path) -> Path:
    """jaxfl's clients in PFLlib's layout: ``root/{train,test}/<i>.npz`` with ``data = {"x": float32 [n, 1, 28,
    28] normalised as jaxfl does, "y": int64 [n]}``. Rewritten every time (cheap, and each file replaced
    atomically), so a stale folder never feeds a run."""
    for split, parts in (("train", inputs.train), ("test", inputs.test)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i, (x, y) in enumerate(parts):
            tmp = root / split / f".{i}.npz.{os.getpid()}"
            with open(tmp, "wb") as f:
                np.savez(f, data={"x": to_nchw_float(x, inputs.normalize), "y": np.asarray(y, np.int64)})
            os.replace(tmp, root / split / f"{i}.npz")  # atomic: a run reading this seed's files never sees half of one
    return root


def run_config(args, cfg, algorithm: str, arguments: dict) -> dict:
    """config.json of a PFLlib run: what it computed, with the per-seed paths under ``data_dir`` and ``out``
    (fields ``jaxfl compare`` ignores when it groups runs by seed) and the jaxfl run named by its folder."""
    where = {"data_dir", "dataset", "save_folder_name", "model"}
    return {"official": REPO, "commit": args.commit, "algorithm": algorithm, "jaxfl_variant": args.method,
            "jaxfl_run": Path(args.jaxfl_run).name, "fedlc_counts": args.fedlc_counts, "seed": cfg.seed,
            "lr": cfg.lr, "rounds": cfg.rounds, "arguments": {k: v for k, v in arguments.items() if k not in where},
            "data_dir": arguments["dataset"], "out": str(args.out)}


class _Done(Exception):
    """Raised from the logging hook once the last round is logged: ends PFLlib's loop."""


def run(args) -> None:
    """One PFLlib run of ``args.method`` on the inputs, learning rate, seed and rounds of the jaxfl run in
    ``args.jaxfl_run`` (an ``mlp_2nn`` run with batch 10, one local epoch, plain SGD, every client every round),
    into ``args.out``."""
    import copy

    import torch
    import torch.nn as nn
    from jaxfl.run.config import RunConfig

    warnings.simplefilter("ignore")  # as PFLlib's main.py does (its evaluation warns every batch)
    algorithm, module, cls, split, overrides, *_ = METHODS[args.method]
    cfg = RunConfig.from_dict(json.loads((Path(args.jaxfl_run) / "config.json").read_text()))
    check_setting(cfg, args.jaxfl_run, "pfllib")
    inputs = jaxfl_inputs(cfg)
    data = write_pfllib_dataset(inputs, Path(args.data_root).resolve() / f"seed{cfg.seed}")

    torch.set_num_threads(1)
    model = two_nn(inputs.num_classes)
    load_jaxfl_init(model, cfg)
    ns = dict(PFLLIB_DEFAULTS, dataset=str(data), num_clients=inputs.num_clients, num_classes=inputs.num_classes,
              batch_size=10, local_epochs=1, local_learning_rate=cfg.lr, global_rounds=cfg.rounds,
              join_ratio=1.0, algorithm=algorithm, model=model, save_folder_name=str(Path(args.out) / "items"))
    ns.update(overrides)
    pargs = types.SimpleNamespace(**ns)
    if split:  # main.py's BaseHeadSplit for this algorithm
        from flcore.trainmodel.models import BaseHeadSplit
        pargs.head = copy.deepcopy(model.fc)
        model.fc = nn.Identity()
        pargs.model = BaseHeadSplit(model, pargs.head)

    server_cls = getattr(importlib.import_module(f"flcore.servers.{module}"), cls)
    server = server_cls(pargs, 0)
    if args.fedlc_counts == "client":  # diagnostic: jaxfl's (the paper's) per-client counts, absent -> 1e-8
        for client in server.clients:
            offsets = pargs.tau * client.sample_per_class.clamp(min=1e-8) ** (-1 / 4)
            client.calibration = torch.tile(offsets, (pargs.batch_size, 1))
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)

    log = MetricsLog(args.out, inputs.client_names, run_config(args, cfg, algorithm, ns))
    after_training = algorithm == "FedPHP"  # its train() evaluates after local training
    evaluated = [0]
    test_metrics = server.test_metrics

    def logged_test_metrics():
        ids, counts, correct, auc = test_metrics()
        rounds_done = evaluated[0] + after_training
        evaluated[0] += 1
        if rounds_done >= 1:
            order = np.argsort(ids)
            acc = np.asarray(correct, float)[order] / np.asarray(counts, float)[order]
            # every client trains every round (join ratio 1)
            rec = log.round(rounds_done, sorted(c.id for c in server.selected_clients), test_accuracy=acc,
                            test_count=np.asarray(counts)[order])
            if args.progress:
                print(f"round {rounds_done}: mean accuracy {rec['mean_accuracy']:.4f}", flush=True)
        if rounds_done >= cfg.rounds:
            raise _Done
        return ids, counts, correct, auc

    server.test_metrics = logged_test_metrics
    try:
        server.train()
    except _Done:
        pass
    if evaluated[0] + after_training - 1 < cfg.rounds:
        raise SystemExit(f"pfllib: error: the run stopped after {evaluated[0]} evaluations, before round "
                         f"{cfg.rounds}")


LIBRARY = Library("PFLlib", REPO, "d832e76f6a23b833038949ec1e4fdefe63a4d350", "PFLLIB_OFFICIAL",
                  {v: m.official for v, m in METHODS.items()}, code_dir="system")


def add_arguments(p) -> None:
    p.add_argument("--data-root", default="../runs/official/pfllib_data",
                   help="where jaxfl's clients are written in PFLlib's format (one folder per seed)")
    p.add_argument("--fedlc-counts", choices=("global", "client"), default="global",
                   help="diagnostic: FedLC's calibration from the counts summed over all clients (PFLlib) or from "
                        "each client's own (jaxfl, the paper, FL-bench)")


def main(argv=None) -> None:
    LIBRARY.main(argv, __doc__, __file__, run, add_arguments, extra=lambda args: ("--data-root", args.data_root),
                 quiet=True, check=lambda args: "--fedlc-counts client applies to --method fedlc only"
                 if args.fedlc_counts == "client" and args.method != "fedlc" else None)


if __name__ == "__main__":
    main()
