"""FL-bench's Per-FedAvg client (KarhouTam/FL-bench, HEAD 06e658b) on the inputs of ``experiments/pfl_methods.py``'s
runs: the result-level check of jaxfl's ``perfedavg`` against the only library that ships its hessian-free variant.

    FLBENCH_OFFICIAL=/path/to/FL-bench JAXFL_DATA_DIR=../shared/data python experiments/official/flbench.py \\
        --method perfedavg_varianthf --jaxfl-run experiments/logs/pfl_methods/seed0/perfedavg_varianthf_lr0.02 \\
        --out ../runs/official/flbench/seed0/perfedavg_varianthf
    # both variants, 3 seeds, then the comparison
    FLBENCH_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/flbench.py --all \\
        --seeds 0,1,2 --out ../runs/official/flbench --figure flbench.png

Per-FedAvg's authors released no code; FL-bench's ``src/client/perfedavg.py`` is the implementation jaxfl's
``perfedavg`` was read against for its hessian-free variant and its meta-step count (PFLlib ships the first-order
one only; ``docs/reference_notes/perfedavg.md``). FL-bench's runner needs ray, hydra and its own dataset files; its
client class does not, and it holds the whole method: what runs unchanged from the checkout named by
``$FLBENCH_OFFICIAL`` (imported, never copied) is ``PerFedAvgClient`` with its base ``FedAvgClient``:
``set_parameters`` (the global model, the optimizer reset every round), ``fit`` (per epoch ceil(n/B) // k
meta-steps on consecutive batches of one shuffled loader, k = 2 (FO) or 3 (HF): the inner SGD step of lr alpha,
the meta-gradient, HF's finite-difference Hessian-vector product with delta, the meta SGD step of lr beta) and
``package`` (weight 1). The server's part is re-written here, as FL-bench's ``FedAvgServer`` does it: every
client trains from the global model (``package``: the public parameters, no personal ones) and the global model
becomes the weighted mean of the uploads (``aggregate_client_updates``: weights / sum of weights, here all 1).

What is replaced, and how it is matched:
- Data. The clients of the jaxfl run named by ``--jaxfl-run`` (``common.jaxfl_inputs``: MNIST, one channel, 20
  clients, Dirichlet(0.1) labels, at most 500 training images, a test set following each client's label mix),
  normalised as jaxfl does, in one dataset with FL-bench's ``data_indices`` ({"train", "val", "test"} per client,
  no validation split).
- Model. ``pfl_setting.two_nn``: jaxfl's ``mlp_2nn`` with jaxfl's initial weights of the run's seed.
- Stubs. ``torchvision`` (imported by FL-bench's dataset and model modules, used only for its own datasets and
  torchvision models) is a stub module.
- Hyperparameters. jaxfl's run: alpha = beta = its lr (jaxfl's defaults; FL-bench's beta default 1e-3 barely moves
  the meta-model in one epoch, ``experiments/RESULTS.md``), delta 1e-3, batch 10, one local epoch, plain SGD,
  every client every round.
- Seeds. torch, numpy and python's ``random`` seeded with the run's seed (FL-bench's ``fix_random_seed``) before
  the client is built: the loader's shuffles.
- Metric. jaxfl's protocol (and PFLlib's, and the paper's): after each round, each client adapts the global model
  by one SGD step of lr alpha on one random batch of B of its training samples, then is tested (eval mode;
  correct / test samples). FL-bench's own test fine-tunes a full epoch instead (``test`` with
  ``finetune_epoch`` >= 1); its number is logged beside as ``flbench_accuracy``.

Differences by design: FL-bench weighs the uploads uniformly (weight 1), jaxfl's runs by training samples (18 of the
20 clients hold 500 images).

``--compare``: per variant, final and last-5 mean accuracy of both sides, the difference and the agreement criterion
(``pfl_setting.compare_methods``). See experiments/official/flbench.md.
"""
from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import numpy as np

from common import MetricsLog, jaxfl_inputs, stub_unimportable, to_nchw_float
from pfl_setting import Library, check_setting, load_jaxfl_init, two_nn

REPO = "KarhouTam/FL-bench"
METHODS = {"perfedavg": "fo", "perfedavg_varianthf": "hf"}  # jaxfl variant: FL-bench's --version


def flbench_args(cfg, version: str, alpha: float, beta: float, delta: float):
    """The DictConfig fields FL-bench's clients read, for jaxfl's run ``cfg``."""
    from omegaconf import OmegaConf
    return OmegaConf.create({
        "common": {"use_cuda": False, "buffers": "global", "batch_size": cfg.batch_size,
                   "local_epoch": cfg.local_epochs, "reset_optimizer_on_global_epoch": True,
                   "client_side_evaluation": False,
                   "test": {"client": {"train": False, "val": False, "test": True, "finetune_epoch": 1}}},
        "optimizer": {"name": "sgd", "lr": alpha, "momentum": 0.0, "weight_decay": 0.0},
        "perfedavg": {"version": version, "beta": beta, "delta": delta}})


def one_step_accuracy(global_state, model, x, y, tx, ty, lr: float, batch: int, rng) -> float:
    """jaxfl's Per-FedAvg prediction: one SGD step of ``lr`` from ``global_state`` on ``batch`` random training samples
    (x, y), then the accuracy on (tx, ty) in eval mode."""
    import torch
    model.load_state_dict(global_state)
    model.train()
    pick = rng.choice(len(y), size=min(batch, len(y)), replace=False)
    loss = torch.nn.functional.cross_entropy(model(x[pick]), y[pick])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= lr * g
        model.eval()
        return float((model(tx).argmax(1) == ty).float().mean())


def run(args) -> None:
    """One run of FL-bench's Per-FedAvg client on the inputs, lr, seed and rounds of the jaxfl run
    ``args.jaxfl_run``."""
    import warnings

    import torch
    from torch.utils.data import TensorDataset
    from jaxfl.run.config import RunConfig

    warnings.simplefilter("ignore")
    cfg = RunConfig.from_dict(json.loads((Path(args.jaxfl_run) / "config.json").read_text()))
    check_setting(cfg, args.jaxfl_run, "flbench", algorithm="perfedavg")
    opts = cfg.algorithm_options()
    if opts.variant != METHODS[args.method]:
        raise SystemExit(f"flbench: error: {args.jaxfl_run} is Per-FedAvg {opts.variant}, --method {args.method} "
                         f"is {METHODS[args.method]}")
    alpha = opts.alpha if opts.alpha is not None else cfg.lr
    beta = opts.beta if opts.beta is not None else cfg.lr
    inputs = jaxfl_inputs(cfg)
    torch.set_num_threads(1)
    stub_unimportable("torchvision", ("transforms", "io", "io.image", "models", "datasets"))
    from src.client.perfedavg import PerFedAvgClient

    class ClientsDataset(TensorDataset):
        """All clients' samples in one dataset, as FL-bench's ``BaseDataset`` holds them (train/eval: no transforms)."""

        def train(self):
            pass

        def eval(self):
            pass

    xs, ys, indices, start = [], [], [], 0
    for (x, y), (tx, ty) in zip(inputs.train, inputs.test):
        xs += [to_nchw_float(x, inputs.normalize), to_nchw_float(tx, inputs.normalize)]
        ys += [np.asarray(y, np.int64), np.asarray(ty, np.int64)]
        indices.append({"train": list(range(start, start + len(y))), "val": [],
                        "test": list(range(start + len(y), start + len(y) + len(ty)))})
        start += len(y) + len(ty)
    dataset = ClientsDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)))

    model = two_nn(inputs.num_classes)
    load_jaxfl_init(model, cfg)
    model.device = torch.device("cpu")  # FL-bench's DecoupledModel attribute, read by its evaluate_model
    global_state = copy.deepcopy(model.state_dict())
    fl_args = flbench_args(cfg, METHODS[args.method], alpha, beta, opts.delta)
    random.seed(cfg.seed)  # FL-bench's fix_random_seed
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    worker = PerFedAvgClient(model=copy.deepcopy(model), optimizer_cls=functools.partial(
        torch.optim.SGD, lr=alpha, momentum=0.0, weight_decay=0.0), lr_scheduler_cls=None, args=fl_args,
        dataset=dataset, data_indices=indices, device=torch.device("cpu"), return_diff=False)
    worker.model.device = torch.device("cpu")
    eval_rng = np.random.default_rng(cfg.seed)
    probe = copy.deepcopy(model)
    x_all, y_all = dataset.tensors
    splits = [(x_all[d["train"]], y_all[d["train"]], x_all[d["test"]], y_all[d["test"]]) for d in indices]

    config = {"official": REPO, "commit": args.commit, "algorithm": "perfedavg", "version": METHODS[args.method],
              "jaxfl_variant": args.method, "jaxfl_run": Path(args.jaxfl_run).name, "seed": cfg.seed, "lr": cfg.lr,
              "rounds": cfg.rounds, "alpha": alpha, "beta": beta, "delta": opts.delta, "out": str(args.out)}
    log = MetricsLog(args.out, inputs.client_names, config)
    ids = list(range(inputs.num_clients))

    def package(i):  # FedAvgServer.package / get_client_model_params
        return dict(client_id=i, local_epoch=cfg.local_epochs, regular_model_params=copy.deepcopy(global_state),
                    personal_model_params={}, optimizer_state={}, lr_scheduler_state={}, return_diff=False)

    for r in range(cfg.rounds):
        uploads = {i: worker.train(package(i)) for i in random.sample(ids, len(ids))}  # FL-bench's client order
        weights = torch.tensor([p["weight"] for p in uploads.values()], dtype=torch.float32)
        weights = weights / weights.sum()
        for name in global_state:  # FedAvgServer.aggregate_client_updates (return_diff False)
            stacked = torch.stack([p["regular_model_params"][name] for p in uploads.values()], dim=-1)
            global_state[name] = torch.sum(stacked * weights, dim=-1)
        acc, flbench = [], []
        for i in ids:
            acc.append(one_step_accuracy(global_state, probe, *splits[i], alpha, cfg.batch_size, eval_rng))
            flbench.append(worker.test(package(i))["after"]["test"].accuracy / 100)
        rec = log.round(r + 1, sorted(uploads), test_accuracy=acc, test_count=[len(t[1]) for t in inputs.test],
                        flbench_accuracy=float(np.mean(flbench)))
        if args.progress:
            print(f"round {r + 1}: mean accuracy {rec['mean_accuracy']:.4f} (FL-bench's fine-tuned epoch: "
                  f"{rec['flbench_accuracy']:.4f})", flush=True)


LIBRARY = Library("FL-bench", REPO, "06e658bca5af6ce732e25bb7c0f8be321e14a85e", "FLBENCH_OFFICIAL",
                  {v: False for v in METHODS}, name="FL-bench's Per-FedAvg")


def main(argv=None) -> None:
    LIBRARY.main(argv, __doc__, __file__, run)


if __name__ == "__main__":
    main()
