"""FedTP's official code (zhyczy/FedTP) on the inputs of a jaxfl FedTP run: same clients, cohorts, ViT widths.

    FEDTP_OFFICIAL=/path/to/zhyczy+FedTP JAXFL_DATA_DIR=../shared/data \\
        python experiments/official/fedtp.py --variant hypernet --seed 0 --rounds 60 --out DIR

Run it from any directory but the repository root (there ``import jaxfl`` would pick up the working tree; the
script's own directory comes first on ``sys.path`` anyway). It needs PyTorch, einops and scikit-learn (the
official modules import them) and jaxfl (for the data); no torchvision, tensorboard or faiss: the official
modules import those only for data sets, logging and kNN, and get empty stand-ins here.

How it runs the official code. The official training loop is not a function: it is the ``__main__`` block of
``main.py`` (FedTP main.py:487-607, Personalized-T main.py:1354-1458, FedAvg main.py:402-471). This adapter
executes that file unchanged (``runpy.run_path(..., run_name="__main__")``) with the official arguments
(``--alg FedTP | Personalized-T | fedavg``, ``--rho 0.9`` as in ``scripts/cifar10_run.sh``, ``--reg 1e-5``,
``--lr 0.01``, ``--batch-size 64``, ``--epochs``, ``--n_parties``, ``--sample``, ``--comm_round``,
``--eval_step``/``--test_round``, ``--depth``, ``--init_seed``) after replacing, in the official modules, only
what reads data or fixes sizes the command line cannot set:

- ``utils.partition_data`` (utils.py:95) returns jaxfl's clients: every client's train and test arrays from
  ``common.jaxfl_inputs`` (jaxfl's loading, partition, test cap), as float NCHW normalised the way jaxfl does
  (``(x/255 - 0.5)/0.5``; the official loader uses per-channel CIFAR statistics, utils.py:1292-1298, which
  ``--config official`` uses on both sides), each client's index map into the concatenated arrays. No
  augmentation on either side (the official CIFAR-10 loader has none).
- ``utils.get_divided_dataloader`` (utils.py:1276) / ``get_dataloader`` (utils.py:1244) build the official
  ``DataLoader``s (train ``shuffle=True, drop_last=False``, test batch 32 unshuffled) over those tensors
  instead of reading ``CIFAR10_truncated`` from disk. The official local training (``local_train_net_per`` ->
  ``train_net``, methods/method.py:464, :54) and evaluation (``compute_accuracy_per_client`` utils.py:851,
  ``compute_accuracy_personally`` :982, ``compute_accuracy_per_client_simple`` :778) run unchanged on them.
- ``models.vit.ViT`` and ``models.Hypernetworks.ViTHyper``: ``init_nets``/``init_hyper`` hard-code dim 128,
  8 heads x 64, MLP 256 (main.py:116, :169); the constructors are called with jaxfl ``vit_tiny``'s widths
  instead (read from ``jaxfl.models.vit_tiny``: patch 4, dim 64, depth 4, 4 heads x 32, MLP 128, dropout 0.1
  and embedding dropout 0.1). The official ViT takes every one of these, so the architecture is the same
  (pre-norm blocks, bias-free fused W_qkv, CLS pooling, LayerNorm+Linear head; 206,794 parameters).
  ``--config official`` keeps the official widths instead (jaxfl ``vit_small``: dim 128, 8 heads x 64, MLP
  256) at the paper's depth 8, which the code takes as its own ``--depth``.
  The hypernetwork keeps the official defaults (embedding 128, trunk 150 x 4 linear layers), as jaxfl's.
- ``numpy.random.shuffle``: the official cohort is ``arr = arange(N); shuffle(arr); arr[:int(N*sample)]``
  (main.py:418-420, :524-526, :1379-1381). A call on ``arange(N)`` puts jaxfl's cohort of that round
  (``engine.sample_cohort``, sorted ids) first; any other call goes to numpy. ``--sample`` is set so that
  ``int(N*sample)`` is jaxfl's cohort size.
- Logging only: the three evaluation functions and ``train_net`` are wrapped to record, per round, every
  client's test accuracy, test-set size and loss (their return value) and the trained clients' mean training
  loss (by counting the losses of the ``nn.CrossEntropyLoss`` that ``train_net`` builds); written to
  ``--out/metrics.jsonl`` in jaxfl's format (``common.MetricsLog``). ``weighted_accuracy`` is the official
  ``test_acc`` (total correct / total test samples over all clients), the paper's metric.

Seeding is the official one: main.py:357-361 seeds numpy, torch and random from ``--init_seed`` = ``--seed``;
model/hypernetwork initialisation, dropout and the DataLoader shuffles draw from torch's generator.

What cannot be matched bit for bit (different RNGs): the initial weights, dropout masks and batch order are
torch's, not jaxfl's; the statistics are the same except where the initialisers differ (see fedtp.md: jaxfl
initialises a ViT's own W_qkv Xavier-uniform, torch's Linear U(+-1/sqrt(fan_in)); the hypernet variant
generates W_qkv, so there it does not matter). ``--eval-every 1`` is impossible (the official code refuses
``test_round <= 1``); round 1 is then not evaluated.

Variants: ``hypernet`` (--alg FedTP), ``vanilla`` (--alg Personalized-T: each client keeps the Q/K/V it
trained), ``fedavg`` (--alg fedavg: FedAvg-T, the global model evaluated on every client).

Outputs under ``--out``: config.json, metrics.jsonl (jaxfl's format), official/ (the official code's cwd:
its results_table/ json and argument dump).

``--check-weights`` (``check_weights``), instead of a run: whole rounds of the hypernetwork variant in both
codes from the *same* initial weights (jaxfl's, converted into the official ``ViT`` and ``ViTHyper``), one batch
a client and dropout off, printing per round the two codes' test accuracy and the largest differences of their
updates (JSON; ``--check-depth`` blocks at ``--config``'s widths).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from common import (MetricsLog, agreement_bound, jaxfl_inputs, log_exists, official_repo, read_log,  # noqa: E402
                    stub_unimportable, to_nchw_float)

ALGS = {"hypernet": "FedTP", "vanilla": "Personalized-T", "fedavg": "fedavg"}
# module names of the official checkout that would shadow (or be shadowed by) others of the same name
OFFICIAL_MODULES = ("utils", "config", "datasets", "constants", "models", "methods", "optimizer", "datastore")


# --config: the model and input scaling of both sides. reduced: jaxfl's CPU-sized ViT and its own scaling (the
# official widths are overridden); official: the official ViT widths (dim 128, 8 heads x 64, MLP 256, as
# init_nets/init_hyper hard-code them, main.py:116, :169) at the paper's depth 8 (the code's --depth, default 6;
# the spec follows the paper), and the official per-channel CIFAR-10 scaling (utils.py:1292-1298)
CONFIGS = {"reduced": {"model": "vit_tiny", "normalize": "dataset"},
           "official": {"model": "vit_small", "normalize": "cifar10"}}


def jaxfl_config(args):
    """The RunConfig of the jaxfl runs compared against (experiments/fedtp.py's pathological settings)."""
    from jaxfl.run.config import RunConfig
    chosen = CONFIGS[args.config]
    return RunConfig(algorithm="fedtp", dataset="cifar10", model=chosen["model"], normalize=chosen["normalize"],
                     num_clients=args.num_clients,
                     clients_per_round=args.clients_per_round, partition="shards", classes_per_client=2,
                     test_per_client=args.test_per_client, rounds=args.rounds, local_epochs=args.local_epochs,
                     batch_size=64, lr=0.01, momentum=0.9, weight_decay=1e-5, eval_every=args.eval_every,
                     seed=args.seed, checkpoint_every=0, resume=False)


def vit_widths(model: str):
    """The encoder settings of jaxfl's ``model`` (vit_tiny or vit_small), as the official ViT constructor's
    keywords."""
    from jaxfl.models import build_model
    e = build_model(model, 10).encoder
    return dict(patch_size=e.patch, dim=e.dim, depth=e.depth, heads=e.heads, dim_head=e.dim_head,
                mlp_dim=e.mlp_dim, dropout=e.dropout, emb_dropout=e.dropout)


def install_stubs() -> list[str]:
    """Stand-ins for the official code's imports that only serve data sets, logging and kNN, where they do not
    import: the names stubbed."""
    groups = {"torchvision": ("transforms", "utils", "datasets", "datasets.vision", "datasets.utils", "models"),
              "torch.utils.tensorboard": (), "faiss": ()}
    return [name for name, subs in groups.items() if stub_unimportable(name, subs)]


def official_tensors(inputs):
    """jaxfl's clients as the official loaders' tensors: x_tr, y_tr, x_te, y_te (float NCHW scaled as jaxfl
    scales them; int64 labels), each concatenated over the clients, and map_tr, map_te: {client: index array}."""
    import types

    import torch

    def stack(parts):
        x = np.concatenate([to_nchw_float(xi, inputs.normalize) for xi, _ in parts])
        y = np.concatenate([np.asarray(yi, np.int64) for _, yi in parts])
        offs = np.concatenate([[0], np.cumsum([len(yi) for _, yi in parts])])
        idx = {i: np.arange(offs[i], offs[i + 1]) for i in range(len(parts))}
        return torch.from_numpy(x), torch.from_numpy(y), idx

    x_tr, y_tr, map_tr = stack(inputs.train)
    x_te, y_te, map_te = stack(inputs.test)
    return types.SimpleNamespace(x_tr=x_tr, y_tr=y_tr, map_tr=map_tr, x_te=x_te, y_te=y_te, map_te=map_te)


def import_official(repo: Path, t, widths: dict):
    """Import the official ViT, hypernetwork and utils from ``repo`` with their data loaders reading ``t``
    (``official_tensors``) and the ViT and hypernetwork constructors taking ``widths`` (``vit_widths``) whatever
    the caller passes. Returns (stubbed imports, models.Hypernetworks, models.vit, utils)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    stubbed = install_stubs()
    sys.path.insert(0, str(repo))
    import models.Hypernetworks as off_hyper
    import models.vit as off_vit
    import utils as off_utils

    subsets = {}

    def subset(x, y, ix):
        key = (id(x), int(ix[0]) if len(ix) else -1, len(ix))
        if key not in subsets:
            idx = torch.as_tensor(np.asarray(ix), dtype=torch.long)
            subsets[key] = TensorDataset(x[idx], y[idx])
        return subsets[key]

    def get_divided_dataloader(dataset, datadir, train_bs, test_bs, dataidxs_train, dataidxs_test, noise_level=0,
                               net_id=None, total=0, drop_last=False, apply_noise=False):
        assert not apply_noise and not noise_level, "noise is not part of this comparison"
        train_ds, test_ds = subset(t.x_tr, t.y_tr, dataidxs_train), subset(t.x_te, t.y_te, dataidxs_test)
        return (DataLoader(dataset=train_ds, batch_size=train_bs, shuffle=True, drop_last=drop_last),
                DataLoader(dataset=test_ds, batch_size=test_bs, shuffle=False, drop_last=False), train_ds, test_ds)

    def get_dataloader(dataset, datadir, train_bs, test_bs, dataidxs=None, *a, **kw):
        train_ds, test_ds = TensorDataset(t.x_tr, t.y_tr), TensorDataset(t.x_te, t.y_te)
        return (DataLoader(dataset=train_ds, batch_size=train_bs, shuffle=True, drop_last=False),
                DataLoader(dataset=test_ds, batch_size=test_bs, shuffle=False, drop_last=False), train_ds, test_ds)

    off_utils.get_divided_dataloader = get_divided_dataloader
    off_utils.get_dataloader = get_dataloader

    # init_nets / init_hyper pass the official widths explicitly: override them in the constructors' arguments
    # (the classes themselves stay, since ViTHyper.__init__ calls super(ViTHyper, self))
    def with_widths(cls, names):
        init, sig = cls.__init__, inspect.signature(cls.__init__)

        def __init__(self, *a, **kw):
            bound = sig.bind(self, *a, **kw)
            bound.arguments.update({k: v for k, v in widths.items() if k in names})
            init(*bound.args, **bound.kwargs)
        cls.__init__ = __init__

    with_widths(off_vit.ViT, widths)                                # every width; image size, classes as given
    with_widths(off_hyper.ViTHyper, ("dim", "heads", "dim_head"))   # embedding, trunk, depth from the args
    return stubbed, off_hyper, off_vit, off_utils


def vit_to_torch(params, depth: int) -> dict:
    """jaxfl ViT parameters without W_qkv (FedTP's xi: {"encoder", "head"}) -> the official ``ViT``'s state-dict
    entries (numpy; Linear kernels transposed to torch's [out, in])."""
    e, sd = params["encoder"], {}

    def linear(name, t):
        sd[name + ".weight"] = np.asarray(t["linear"]["kernel"]).T
        sd[name + ".bias"] = np.asarray(t["linear"]["bias"])

    def norm(name, t):
        sd[name + ".weight"], sd[name + ".bias"] = np.asarray(t["scale"]), np.asarray(t["bias"])

    linear("to_patch_embedding.1", e["patch_embed"])
    sd["pos_embedding"], sd["cls_token"] = np.asarray(e["pos"]), np.asarray(e["cls"])
    for l in range(depth):
        norm(f"transformer.layers.{l}.0.norm", e[f"ln_attn{l}"])
        linear(f"transformer.layers.{l}.0.fn.to_out.0", e[f"attn{l}"]["out"])
        norm(f"transformer.layers.{l}.1.norm", e[f"ln_ff{l}"])
        linear(f"transformer.layers.{l}.1.fn.net.0", e[f"ff{l}_1"])
        linear(f"transformer.layers.{l}.1.fn.net.3", e[f"ff{l}_2"])
    norm("mlp_head.0", e["ln_out"])
    linear("mlp_head.1", params["head"]["fc1"])
    return sd


def hypernet_to_torch(hnet, embeddings, dim: int, inner3: int) -> dict:
    """jaxfl's hypernetwork ({"trunk": [...], "heads": {"qkv<l>": ...}}) and embedding table -> the official
    ``ViTHyper``'s state-dict entries. A head's output is W_qkv: jaxfl reshapes it to [D, 3I] (x @ W), the
    official code to [3I, D] (x @ W^T), so official output r * D + c is jaxfl's output c * 3I + r."""
    sd = {"embeddings.weight": np.asarray(embeddings)}
    for i, layer in enumerate(hnet["trunk"]):
        sd[f"mlp.{2 * i}.weight"] = np.asarray(layer["kernel"]).T
        sd[f"mlp.{2 * i}.bias"] = np.asarray(layer["bias"])
    for l in range(len(hnet["heads"])):
        head = hnet["heads"][f"qkv{l}"]
        kernel = np.asarray(head["kernel"])  # [H, D * 3I]
        sd[f"to_qkv_value_list.{l}.weight"] = (kernel.reshape(-1, dim, inner3).transpose(0, 2, 1)
                                               .reshape(kernel.shape[0], -1).T)
        sd[f"to_qkv_value_list.{l}.bias"] = np.asarray(head["bias"]).reshape(dim, inner3).T.reshape(-1)
    return sd


def check_weights(args) -> dict:
    """Weight-level differential check of whole rounds of the hypernetwork variant (``--check-weights``): the
    official FedTP round (main.py:521-568, mirrored: it is not a function; ``local_train_net_per``, ``train_net``,
    ``ViT``, ``ViTHyper`` and ``compute_accuracy_per_client`` run unchanged) and jaxfl's from the *same* initial
    weights (jaxfl's ViT, hypernetwork and embedding table copied into the official modules), on the same
    clients and cohorts, each client cut to one batch (64 samples: both codes see the same batch in every epoch
    whatever their shuffles), dropout off on both sides (the only randomness left), at ``--config``'s widths with
    ``--check-depth`` blocks. Per round, over the tensors of the shared ViT (xi) and of the hypernetwork with its
    embedding table, the worst of: the largest difference between the two codes' updates of a tensor relative to
    the largest entry of jaxfl's update of it (with that tensor's float32 spacing at its largest entry relative
    to the same: the rounding of the parameter itself), and ||official update - jaxfl update|| / ||jaxfl
    update||; and both codes' test accuracy over all clients (the official evaluation function's). Before the
    copy, the two codes' own initial draws are compared by law: per tensor of >= 10,000 entries, std(jaxfl's) /
    std(official's)."""
    import importlib
    import logging
    import types

    import torch

    from jaxfl.models import build_model
    from jaxfl.run.runner import Experiment

    jaxfl_runner = importlib.import_module("jaxfl.run.runner")  # (the attribute jaxfl.run is the function run)

    repo = official_repo("FEDTP_OFFICIAL", "zhyczy/FedTP")
    cfg = dataclasses.replace(jaxfl_config(args), samples_per_client=64, eval_every=1)
    depth = args.check_depth or vit_widths(cfg.model)["depth"]
    widths = dict(vit_widths(cfg.model), depth=depth, dropout=0.0, emb_dropout=0.0)

    def no_dropout_model(name, num_classes):
        m = build_model(name, num_classes)
        return m.clone(encoder=m.encoder.clone(dropout=0.0, depth=depth))

    jaxfl_runner.build_model = no_dropout_model
    inputs = jaxfl_inputs(cfg)
    n, k = inputs.num_clients, len(inputs.cohorts[0])
    exp = Experiment(cfg)
    server, store = exp.init()

    t = official_tensors(inputs)
    _, off_hyper, off_vit, off_utils = import_official(repo, t, widths)
    import methods.method as off_method
    torch.manual_seed(cfg.seed)
    oargs = types.SimpleNamespace(
        model="vit", dataset="cifar10", alg="FedTP", lr=cfg.lr, rho=cfg.momentum, reg=cfg.weight_decay,
        optimizer="sgd", batch_size=cfg.batch_size, epochs=cfg.local_epochs, n_parties=n, noise=0,
        noise_type="None", datadir=".", train_acc_pre=False, balanced_soft_max=False, k_neighbor=False, mu=0.0,
        device="cpu")
    inner3 = 3 * widths["heads"] * widths["dim_head"]
    dim = widths["dim"]
    vit = lambda: off_vit.ViT(image_size=32, patch_size=widths["patch_size"], num_classes=inputs.num_classes,
                              dim=dim, depth=depth, heads=widths["heads"], mlp_dim=widths["mlp_dim"])
    global_model, nets = vit(), {i: vit() for i in range(n)}
    opts = exp.options
    hnet = off_hyper.ViTHyper(n, opts.embed_dim, hidden_dim=opts.hyper_hidden, dim=dim, heads=widths["heads"],
                              dim_head=widths["dim_head"], n_hidden=opts.hyper_layers, depth=depth, client_sample=k)

    def load(module, sd, strict=True):
        missing, unexpected = module.load_state_dict({a: torch.from_numpy(np.array(b, np.float32))
                                                      for a, b in sd.items()}, strict=False)
        assert not unexpected and (not strict or not missing), (missing, unexpected)
        assert all(m.endswith("to_qkv.weight") for m in missing), missing

    def ours(s):
        return {"xi": vit_to_torch(s["params"], depth), "hypernet": hypernet_to_torch(s["hnet"], s["embeddings"],
                                                                                     dim, inner3)}

    def theirs():
        return {"xi": {a: b.detach().numpy().copy() for a, b in global_model.state_dict().items()
                       if not a.endswith("to_qkv.weight")},
                "hypernet": {a: b.detach().numpy().copy() for a, b in hnet.state_dict().items()}}

    official_init = theirs()  # the official code's own draws, compared by law below, before jaxfl's replace them
    load(global_model, vit_to_torch(server["params"], depth), strict=False)
    load(hnet, hypernet_to_torch(server["hnet"], server["embeddings"], dim, inner3))
    optimizer = torch.optim.SGD(hnet.parameters(), lr=opts.hyper_lr, momentum=opts.hyper_momentum,
                                weight_decay=opts.hyper_decay)
    logger = logging.getLogger("fedtp-check")
    logger.setLevel(logging.WARNING)

    before_ours, before_theirs = ours(server), theirs()
    init_law = {}
    for part in ("xi", "hypernet"):  # tensors of >= 10,000 entries: their std is estimated to < 2%
        ratios = {name: float(np.std(v) / np.std(official_init[part][name]))
                  for name, v in before_ours[part].items() if v.size >= 10_000}
        worst = max(ratios, key=lambda name: abs(ratios[name] - 1.0))
        init_law[part] = {"tensors": len(ratios), "worst_std_ratio_jaxfl_over_official": [ratios[worst], worst]}
    print(json.dumps({"init_law": init_law}), flush=True)
    report = []
    for r in range(cfg.rounds):
        # ---- the official round (main.py:521-568)
        hnet.train()
        selected = np.asarray(inputs.cohorts[r])
        weights = hnet(torch.tensor(np.array([selected]), dtype=torch.long), False)
        global_para = global_model.state_dict()
        for ix, idx in enumerate(selected):
            nets[idx].load_state_dict(global_para)
            nets[idx].load_state_dict(weights[ix], strict=False)
        off_method.local_train_net_per(nets, selected, oargs, t.map_tr, t.map_te, logger, device="cpu")
        total = sum(len(t.map_tr[i]) for i in selected)
        freqs = [len(t.map_tr[i]) / total for i in selected]
        grads_update = None
        for ix, idx in enumerate(selected):
            final_state = nets[idx].state_dict()
            node_weights = weights[ix]
            delta = [node_weights[key].data - final_state[key] for key in node_weights]
            hnet_grads = torch.autograd.grad(list(node_weights.values()), hnet.parameters(), grad_outputs=delta,
                                             retain_graph=True)
            if ix == 0:
                for key in final_state:
                    global_para[key] = final_state[key] * freqs[ix]
                grads_update = [freqs[ix] * g for g in hnet_grads]
            else:
                for key in final_state:
                    global_para[key] += final_state[key] * freqs[ix]
                for g in range(len(hnet_grads)):
                    grads_update[g] += freqs[ix] * hnet_grads[g]
        global_model.load_state_dict(global_para)
        optimizer.zero_grad()
        for p_, g in zip(hnet.parameters(), grads_update):
            p_.grad = g
        optimizer.step()
        off_eval = off_utils.compute_accuracy_per_client(hnet, nets, global_model, oargs, t.map_tr, t.map_te,
                                                          inputs.num_classes)
        # ---- jaxfl's round
        server, _ = exp.run_rounds(server, store, r, 1)
        ev = exp.evaluate(server, store)
        after_ours, after_theirs = ours(server), theirs()
        rec = {"round": r + 1, "official_weighted_accuracy": float(off_eval[6]),
               "jaxfl_weighted_accuracy": float(ev["weighted_accuracy"])}
        for part in ("xi", "hypernet"):
            worst, worst_l2 = (0.0, "", 0.0), (0.0, "")
            for name, new in after_ours[part].items():
                step_ours = new - before_ours[part][name]
                step_theirs = after_theirs[part][name] - before_theirs[part][name]
                gap = step_theirs - step_ours
                scale = max(float(np.abs(step_ours).max()), 1e-30)
                # the yardstick: one float32 spacing at the tensor's largest entry, relative to the update
                ulp = float(np.spacing(np.float32(np.abs(new).max()))) / scale
                worst = max(worst, (float(np.abs(gap).max()) / scale, name, ulp))
                worst_l2 = max(worst_l2, (float(np.linalg.norm(gap) / max(np.linalg.norm(step_ours), 1e-30)), name))
            rec[f"{part}_update_max_relative_difference"] = worst
            rec[f"{part}_update_relative_l2_difference"] = worst_l2
        report.append(rec)
        print(json.dumps(rec), flush=True)
        before_ours, before_theirs = after_ours, after_theirs
    return {"config": args.config, "model": cfg.model, "depth": depth, "widths": widths, "clients": n,
            "cohort": k, "samples_per_client": 64, "local_epochs": cfg.local_epochs, "seed": cfg.seed,
            "init_law": init_law, "rounds": report}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=list(ALGS), default="hypernet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--num-clients", type=int, default=10)
    p.add_argument("--clients-per-round", type=int, default=5)
    p.add_argument("--test-per-client", type=int, default=500)
    p.add_argument("--config", choices=list(CONFIGS), default="reduced",
                   help="reduced: jaxfl's vit_tiny widths and (x/255 - 0.5)/0.5 on both sides; official: the "
                        "official widths at depth 8 (jaxfl vit_small) and CIFAR-10 per-channel scaling")
    p.add_argument("--out", help="the run's folder (required unless --check-weights)")
    p.add_argument("--check-weights", action="store_true",
                   help="instead of a run: whole rounds of both codes from the same initial weights, printed as "
                        "JSON (check_weights; hypernet variant, one batch per client, no dropout)")
    p.add_argument("--check-depth", type=int, default=0, help="--check-weights: ViT blocks (0: the model's)")
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True): subnormal floats as zero, as XLA:CPU computes (torch's "
                        "default keeps them, and a matmul with many of them runs tens of times slower)")
    args = p.parse_args(argv)
    if args.check_weights and args.variant != "hypernet":
        p.error("--check-weights checks the hypernet variant")
    if not (args.check_weights or args.out):
        p.error("--out is required")
    clash = [m for m in OFFICIAL_MODULES if m in sys.modules]
    if clash:
        raise SystemExit(f"official: error: modules {clash} already imported; they would shadow the official ones")
    if args.check_weights:
        print(json.dumps(check_weights(args)))
        return

    repo = official_repo("FEDTP_OFFICIAL", "zhyczy/FedTP")

    # ---- jaxfl's inputs (before the official checkout goes on sys.path)
    inputs = jaxfl_inputs(jaxfl_config(args))
    cfg, n = inputs.cfg, inputs.num_clients
    k = len(inputs.cohorts[0])
    widths = vit_widths(cfg.model)
    if cfg.eval_every < 2:
        print("official: note: the official code cannot evaluate round 1 (test_round > 1); evaluating from round 2",
              file=sys.stderr)

    t = official_tensors(inputs)
    x_tr, y_tr, map_tr, x_te, y_te, map_te = t.x_tr, t.y_tr, t.map_tr, t.x_te, t.y_te, t.map_te

    def cls_counts(y, idx):
        return {i: dict(zip(*[a.tolist() for a in np.unique(y.numpy()[ix], return_counts=True)]))
                for i, ix in idx.items()}

    # ---- the official modules, with the stand-ins above
    stubbed, _, _, off_utils = import_official(repo, t, widths)

    def partition_data(dataset, datadir, partition, n_parties, beta=0.4, logdir=None):
        assert n_parties == n, (n_parties, n)
        return (x_tr, y_tr.numpy(), x_te, y_te.numpy(), map_tr, map_te,
                cls_counts(y_tr, map_tr), cls_counts(y_te, map_te))

    off_utils.partition_data = partition_data

    # ---- per-round bookkeeping: cohort injection, train losses, evaluations -> metrics.jsonl
    run = {"round": 0, "train_loss": {}, "eval": None}
    config = {"official_repo": str(repo), "official_commit": _git_head(repo), "variant": args.variant,
              "official_alg": ALGS[args.variant], "config": args.config, "vit": widths, "stubbed_imports": stubbed,
              "jaxfl_config": dataclasses.asdict(cfg), "normalize": list(inputs.normalize),
              "flush_denormal": args.flush_denormal}
    log = MetricsLog(args.out, inputs.client_names, config)

    def flush_round():
        r = run["round"]
        if r == 0:
            return
        cohort = inputs.cohorts[r - 1]
        loss = [run["train_loss"].get(int(i), float("nan")) for i in cohort]
        ev = run["eval"]
        if ev is None:
            rec = log.round(r, cohort, train_loss=loss)
        else:
            rec = log.round(r, cohort, train_loss=loss, test_accuracy=ev[0], test_count=ev[1], test_loss=ev[2])
            print(f"round {r}: weighted_accuracy {rec['weighted_accuracy']:.4f}  ({rec['time_s']:.1f}s)", flush=True)
        run["train_loss"], run["eval"] = {}, None

    numpy_shuffle = np.random.shuffle

    def shuffle(x, *a, **kw):
        if isinstance(x, np.ndarray) and x.shape == (n,) and np.array_equal(x, np.arange(n)):
            flush_round()
            r = run["round"]
            cohort = inputs.cohorts[r]
            rest = np.setdiff1d(np.arange(n), cohort)
            x[:] = np.concatenate([cohort, rest])
            run["round"] = r + 1
            return None
        return numpy_shuffle(x, *a, **kw)

    np.random.shuffle = shuffle

    def recording_eval(fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            res = out[4]  # test_results: {client: {"correct", "total", "loss"}}
            run["eval"] = ([res[i]["correct"] / res[i]["total"] for i in range(n)],
                           [res[i]["total"] for i in range(n)], [res[i]["loss"] for i in range(n)])
            return out
        return wrapped

    for name in ("compute_accuracy_per_client", "compute_accuracy_personally", "compute_accuracy_per_client_simple"):
        setattr(off_utils, name, recording_eval(getattr(off_utils, name)))

    import torch

    if args.flush_denormal:
        torch.set_flush_denormal(True)
    import methods.method as off_method  # after the patches: it star-imports utils
    official_train_net = off_method.train_net
    OfficialCE = torch.nn.CrossEntropyLoss

    def train_net(net_id, *a, **kw):
        seen = []

        class RecordingCE(OfficialCE):
            def forward(self, input, target):
                loss = super().forward(input, target)
                seen.append((float(loss.detach()), int(target.shape[0])))
                return loss

        torch.nn.CrossEntropyLoss = RecordingCE
        try:
            return official_train_net(net_id, *a, **kw)
        finally:
            torch.nn.CrossEntropyLoss = OfficialCE
            tot = sum(b for _, b in seen)
            run["train_loss"][int(net_id)] = sum(v * b for v, b in seen) / max(tot, 1)

    off_method.train_net = train_net

    # ---- the official main.py, unchanged
    work = Path(args.out).resolve() / "official"
    work.mkdir(parents=True, exist_ok=True)
    sample = k / n
    assert int(n * sample) == k, (n, k)
    argv_off = ["main.py", "--model=vit", "--dataset=cifar10", f"--alg={ALGS[args.variant]}", "--lr=0.01",
                "--batch-size=64", f"--epochs={cfg.local_epochs}", f"--n_parties={n}", "--rho=0.9", "--reg=1e-5",
                f"--comm_round={cfg.rounds}", "--partition=jaxfl", f"--sample={sample}",
                f"--eval_step={cfg.eval_every}", f"--test_round={max(cfg.eval_every, 2)}",
                f"--depth={widths['depth']}", f"--init_seed={cfg.seed}", "--device=cpu",
                f"--datadir={work}", f"--logdir={work}/logs", f"--modeldir={work}/models",
                "--log_file_name=official"]
    config["official_argv"] = argv_off
    (log.out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = argv_off
    os.chdir(work)
    try:
        runpy.run_path(str(repo / "main.py"), run_name="__main__")
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
        np.random.shuffle = numpy_shuffle
    flush_round()
    if run["round"] != cfg.rounds:
        raise SystemExit(f"official: error: the official loop ran {run['round']} rounds, expected {cfg.rounds}")


# ---------------------------------------------------------------- comparison with the jaxfl runs
JAXFL_NAMES = {"hypernet": "fedtp", "vanilla": "fedtp_variantvanilla", "fedavg": "fedavg"}
OFFICIAL_NAMES = {"hypernet": "fedtp", "vanilla": "vanilla", "fedavg": "fedavg"}


def _curve(path: Path, key: str = "weighted_accuracy"):
    ev = [r for r in read_log(path) if key in r]
    return np.array([r["round"] for r in ev]), np.array([r[key] for r in ev], float) * 100


def compare(argv=None) -> None:
    """``compare --official DIR --jaxfl DIR [--figure PNG]``: per variant, final and last-``--tail`` weighted
    accuracy, mean +- std over seeds (population std, as experiments/common.py's seed_stats), the difference of
    the final means and the criterion |diff| <= max(2 * pooled std, 1.5); a markdown table on stdout and a
    figure of the mean +- std curves. DIR/seed<s>/<name>/metrics.jsonl on both sides."""
    p = argparse.ArgumentParser(prog="fedtp.py compare")
    p.add_argument("--official", required=True)
    p.add_argument("--jaxfl", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="hypernet,vanilla,fedavg")
    p.add_argument("--tail", type=int, default=5)
    p.add_argument("--figure")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = ["| variant | side | seeds | final (round R) %% | mean of the last %d evaluations %% | "
            "rounds 10/20/30/40/50/60 (mean) | final diff (official - jaxfl) | criterion max(2 pooled std, 1.5) "
            "| verdict |" % args.tail,
            "|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for v in args.variants.split(","):
        stats = {}
        for side, root, name in (("official", args.official, OFFICIAL_NAMES[v]), ("jaxfl", args.jaxfl, JAXFL_NAMES[v])):
            paths = [Path(root) / f"seed{s}" / name / "metrics.jsonl" for s in seeds]
            paths = [q for q in paths if log_exists(q)]
            if not paths:
                continue
            cs = [_curve(q) for q in paths]
            n = min(len(c[0]) for c in cs)
            rounds, acc = cs[0][0][:n], np.stack([c[1][:n] for c in cs])
            finals, tails = acc[:, -1], acc[:, -args.tail:].mean(1)
            stats[side] = (len(paths), int(rounds[-1]), finals.mean(), finals.std(), tails.mean(), tails.std())
            curves[(v, side)] = (rounds, acc)
            marks = "/".join(f"{acc.mean(0)[list(rounds).index(r)]:.1f}" if r in rounds else "-"
                             for r in (10, 20, 30, 40, 50, 60))
            stats[side] += (marks,)
        for side in ("official", "jaxfl"):
            if side not in stats:
                continue
            k, r, fm, fs, tm, ts, marks = stats[side]
            extra = "| | |"
            if side == "official" and "jaxfl" in stats:
                d = fm - stats["jaxfl"][2]
                crit = agreement_bound(fs, stats["jaxfl"][3])
                extra = f"| {d:+.2f} | {crit:.2f} | {'agree' if abs(d) <= crit else 'DIFFER'} |"
            rows.append(f"| {v} | {side} | {k} | {fm:.2f} ± {fs:.2f} (R={r}) | {tm:.2f} ± {ts:.2f} | {marks} {extra}")
    print("\n".join(rows))
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        vs = args.variants.split(",")
        fig, axes = plt.subplots(1, len(vs), figsize=(4.2 * len(vs), 3.6), sharey=True)
        for ax, v in zip(np.atleast_1d(axes), vs):
            for side, color in (("official", "C3"), ("jaxfl", "C0")):
                if (v, side) not in curves:
                    continue
                rounds, acc = curves[(v, side)]
                m, sd = acc.mean(0), acc.std(0)
                ax.plot(rounds, m, color=color, marker="o", ms=2.5, label=f"{side} ({len(acc)} seeds)")
                ax.fill_between(rounds, m - sd, m + sd, color=color, alpha=0.2, lw=0)
            ax.set(title=f"FedTP {v}", xlabel="round")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        np.atleast_1d(axes)[0].set_ylabel("accuracy over all clients' test samples (%)")
        fig.suptitle("official zhyczy/FedTP vs jaxfl, CIFAR-10 pathological, vit_tiny, mean ± std over seeds",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        plt.close(fig)


def _git_head(repo: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        compare(sys.argv[2:])
    else:
        main()
