"""DapperFL's *official* training loop (jyzgh/DapperFL, NeurIPS 2024) on the inputs of a jaxfl run.

    DAPPERFL_OFFICIAL=/path/to/jyzgh+DapperFL JAXFL_DATA_DIR=../shared/data \\
      python experiments/official/dapperfl.py --seed 0 --rounds 20 --out ../runs/official/dapperfl/seed0

The official code is imported from ``$DAPPERFL_OFFICIAL`` (never copied here). What runs is the official
``DapperFL`` class (``fedml_api/standalone/domain_generalization/models/dapperfl.py``): ``ini`` (every net and
the global net start from net 0's weights), ``loc_update`` -> ``_train_net`` (SGD, CE + reg_coeff * mean
||z||_2, epoch 0 dense, then its co-pruning block: fusion with the global net, ``_res_pruning`` with torch's
``prune`` calls, epochs 1..E-1 masked), ``FederatedModel.aggregate_nets`` (its "recovery" and
sample-size-weighted average of every state_dict entry), and ``utils/training.py:global_evaluate`` (the global
net in eval mode on each test loader), driven by a copy of the round loop of ``utils/training.py:train``
(lines 116-166: ``ini``, then per round ``epoch_index``, ``loc_update``, ``global_evaluate``). The backbone is
the official ``backbone/ResNet.py:resnet10`` built with ``nf=16``.

What is replaced, and how it maps to jaxfl (``--config``: the jaxfl run's config.json; default: the
released-code preset of ``experiments/logs/dapperfl_seeds/seed<S>``):

- data: the official ``FedLeaDigits.get_data_loaders`` (torchvision MNIST/USPS/SVHN/SYN, 1 % of each domain,
  a random domain per client, one test loader per domain) is replaced by jaxfl's 9 clients
  (``common.jaxfl_inputs``: MNIST-M, MNIST, USPS x 3, 100 training images each, 32x32 RGB, each client's own
  test set), in ``DataLoader(TensorDataset, batch_size=64, sampler=SubsetRandomSampler(arange(n)))``, the
  official ``partition_digits_domain_skew_loaders`` construction (drop_last False; ``aggregate_nets`` reads
  ``sampler.indices.size`` for its weights). Evaluation: ``global_evaluate`` on the 9 per-client test loaders.
- normalisation: jaxfl's ``(x/255 - 0.5) / 0.5`` instead of the official ImageNet per-channel mean/std
  (``--normalize official`` gives the latter).
- augmentation: the official train transform (``datasets/digits.py:133-148``: RandomCrop(32, padding=4) +
  RandomHorizontalFlip) lives in the dataset we replace; jaxfl trains without augmentation, so by default
  none is applied. ``--augment`` re-implements the official two transforms on tensors (no torchvision here).
- clients per round: the official ``loc_update`` draws ``online_clients`` from an *unseeded*
  ``np.random.RandomState()`` (``federated_model.py:30``); here ``model.random_state`` is replaced by an
  object whose ``choice`` returns jaxfl's cohort of the round (all 9 clients every round, as
  ``online_ratio=1`` gives; only the training order is fixed by it).
- device levels: ``args.pr_ratios = ['0', '0.2', '0.4', '0.6', '0.8']`` (``best_args.py``, fl_digits), client i
  pruned at ``pr_ratios[i % 5]`` (``dapperfl.py:109``), as jaxfl's ``device_ratios[i % 5]``.
- model: ``resnet10(10, nf=16)``: widths 16/32/64/128 = jaxfl's ``resnet10_slim`` (the official digits
  backbone is nf=64, 4.9M parameters: ``--nf 64``, jaxfl's ``resnet10``; the checks stay at nf=16). The
  official ResNet also builds an ``encoder`` MLP (128-128-512 at nf=16, 82,560 parameters) that never enters
  ``forward``/``features``; it is in the state_dict, pruned and averaged, but without effect.
  Initialisation: PyTorch's default (the same distributions as jaxfl's, other draws).
- seeding: ``utils/conf.py:set_random_seed(--seed)`` (python, numpy, torch) before the nets are built.
- hard-coded in the official code and kept: SGD(lr=args.local_lr, momentum=0.9, weight_decay=1e-5) rebuilt
  each round (``dapperfl.py:64``; jaxfl's runs use weight decay 0: ``--weight-decay`` patches the module's
  ``optim.SGD`` for a diagnostic), lr 0.01 and batch 64 (``best_args.py``), alpha 0.9 / alpha_min 0.1 /
  epsilon 0.2 / reg_coeff 0.01 (``main.py`` defaults), ``averaing='weight'``.

``--check-weights`` (``check_weights``): both codes from the *same* initial weights (jaxfl's, converted by
``jaxfl_to_torch``) on one batch per client, whole rounds compared entry by entry; ``--jaxfl-ties`` makes the
official BN pruning break exact ties of |gamma| as jaxfl does (``use_jaxfl_tie_rule``; see dapperfl.md).

Variants (``--variants``): ``dapperfl`` (``pr_strategy='AD'``, the released algorithm) and ``fedavg``: the
repository ships no FedAvg model file (``best_args.py`` names one), so FedAvg is the official DapperFL class
with ``pr_strategy='0'`` (no pruning, no recovery) and ``reg_coeff=0`` (no DAR): plain sample-weighted FedAvg
with the official optimizer. Diagnostics (``--weight-decay``, ``--normalize``, ``--augment``) append a suffix
to the variant's directory name.

Output: ``<out>/<variant>/config.json`` and ``metrics.jsonl`` (jaxfl's format, ``common.MetricsLog``;
``test_accuracy`` per client as fractions; the official evaluation rounds each to 0.01 %).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.dont_write_bytecode = True  # importing the official modules must not write __pycache__ into the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MetricsLog, agreement_bound, common_rounds, experiments_common, jaxfl_inputs,  # noqa: E402
                    log_exists, official_repo, read_log, stub_unimportable, to_nchw_float)

os.environ.setdefault("TQDM_DISABLE", "1")  # the official local loop wraps its epochs in tqdm
PKG = "fedml_api.standalone.domain_generalization"
LOGS = Path(__file__).resolve().parents[1] / "logs"
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # datasets/digits.py:138-139


# ----------------------------------------------------------------------------------------------------------
# importing the official modules
# ----------------------------------------------------------------------------------------------------------

def install_stubs() -> None:
    """Modules the official code imports but this run does not use: torchvision (datasets and transforms
    only, both replaced; no CPU build for this torch), thop/torchstat (profiling imports in dapperfl.py:6-7),
    wandb (training.py:13, used only with --wandb)."""
    # transforms.transforms: `from torchvision.transforms import transforms`
    stub_unimportable("torchvision", ("transforms", "transforms.transforms", "datasets"))
    for name in ("thop", "torchstat", "wandb"):
        stub_unimportable(name)


def import_official(root: Path) -> types.SimpleNamespace:
    """The official modules, imported as ``main.py`` does: from the package root on sys.path, with the working
    directory at fedml_experiments/standalone/domain_generalization (``models/__init__.py`` and
    ``datasets/__init__.py`` list their directories by that relative path)."""
    install_stubs()
    sys.path.insert(0, str(root))
    cwd = os.getcwd()
    os.chdir(root / "fedml_experiments" / "standalone" / "domain_generalization")
    try:
        dap = importlib.import_module(f"{PKG}.models.dapperfl")
        ns = types.SimpleNamespace(
            dapperfl=dap,
            DapperFL=dap.DapperFL,
            federated_model=importlib.import_module(f"{PKG}.models.utils.federated_model"),
            resnet=importlib.import_module(f"{PKG}.backbone.ResNet"),
            training=importlib.import_module(f"{PKG}.utils.training"),
            conf=importlib.import_module(f"{PKG}.utils.conf"),
            best_args=importlib.import_module(f"{PKG}.utils.best_args").best_args,
        )
    finally:
        os.chdir(cwd)
    return ns


def official_commit(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ----------------------------------------------------------------------------------------------------------
# jaxfl's inputs as the official loaders
# ----------------------------------------------------------------------------------------------------------

def jaxfl_config(path: Path, seed: int, rounds: int):
    """The jaxfl RunConfig of ``path`` (a run's config.json) with ``seed`` and ``rounds``; no output/resume."""
    from jaxfl.run.config import RunConfig
    d = json.loads(Path(path).read_text())
    d.update(seed=seed, rounds=rounds, out=None, resume=False, checkpoint_every=0, overwrite=False)
    return RunConfig.from_dict(d)


class Augmented:
    """The official train-time augmentation on normalised CHW tensors: RandomCrop(32, padding=4) (zero padding
    of the *unnormalised* image, as torchvision pads the PIL image before ToTensor/Normalize) and
    RandomHorizontalFlip(0.5), with torch's global RNG as torchvision uses it."""

    def __init__(self, x, y, pad_value):
        import torch
        self.torch, self.x, self.y, self.pad = torch, x, y, pad_value  # pad_value [C, 1, 1]: normalised 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        torch = self.torch
        img = self.x[i]
        c, h, w = img.shape
        padded = self.pad.expand(c, h + 8, w + 8).clone()
        padded[:, 4:4 + h, 4:4 + w] = img
        top = int(torch.randint(0, 9, (1,)))
        left = int(torch.randint(0, 9, (1,)))
        img = padded[:, top:top + h, left:left + w]
        if torch.rand(1) < 0.5:
            img = img.flip(-1)
        return img, self.y[i]


def make_loaders(inputs, batch_size: int, normalize: str, augment: bool):
    """Per client: the train loader (the official construction) and the test loader; and the test sizes."""
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

    def tensors(images):
        if normalize == "jaxfl":
            x = to_nchw_float(images, inputs.normalize)
        else:  # ToTensor + Normalize(ImageNet mean/std), per channel
            mean, std = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in IMAGENET)
            x = (images.astype(np.float32).transpose(0, 3, 1, 2) / 255.0 - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x, np.float32))

    if normalize == "jaxfl":
        m, s = (np.broadcast_to(np.asarray(v, np.float32), (3,)) for v in inputs.normalize)
        pad = torch.from_numpy(((0.0 - m) / s).reshape(3, 1, 1).copy())  # a black pixel, scalar or per channel
    else:
        pad = torch.tensor([(0.0 - a) / b for a, b in zip(*IMAGENET)]).reshape(3, 1, 1)
    train, test, sizes = [], [], []
    for (x, y), (xt, yt) in zip(inputs.train, inputs.test):
        xs, ys = tensors(x), torch.from_numpy(np.asarray(y, np.int64))
        ds = Augmented(xs, ys, pad) if augment else TensorDataset(xs, ys)
        # datasets/utils/federated_dataset.py:395-397: a SubsetRandomSampler over the client's indices
        train.append(DataLoader(ds, batch_size=batch_size, sampler=SubsetRandomSampler(np.arange(len(y)))))
        test.append(DataLoader(TensorDataset(tensors(xt), torch.from_numpy(np.asarray(yt, np.int64))),
                               batch_size=batch_size, shuffle=False))
        sizes.append(len(yt))
    return train, test, sizes


class CohortDraw:
    """Replaces ``FederatedModel.random_state`` (an unseeded ``np.random.RandomState()``): ``choice`` returns
    jaxfl's cohort of the current round."""

    def __init__(self, cohorts):
        self.cohorts, self.round = cohorts, 0

    def choice(self, population, size, replace=False):
        cohort = np.asarray(self.cohorts[self.round])
        if len(cohort) != size or replace:
            raise ValueError(f"official loc_update asks for {size} clients, jaxfl's cohort has {len(cohort)}")
        return cohort


# ----------------------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------------------

VARIANTS = {
    "dapperfl": {"pr_strategy": "AD", "reg_coeff": 0.01},
    "fedavg": {"pr_strategy": "0", "reg_coeff": 0.0},  # DapperFL's class with pruning and DAR off
}


def official_args(seed: int, rounds: int, local_epochs: int, num_clients: int, variant: str, best_args):
    """main.py's Namespace: its parser defaults (main.py:36-60), then best_args['fl_digits']['dapperfl']
    (lr 0.01, batch 64, pr_ratios 0..0.8), as main.py:66-69 applies them; then the variant's switches."""
    a = argparse.Namespace(
        prefix="", communication_epoch=rounds, local_epoch=local_epochs, parti_num=num_clients,
        model="dapperfl", dataset="fl_digits", pr_strategy="AD", backbone="resnet10", alpha=0.9, alpha_min=0.1,
        epsilon=0.2, reg_coeff=1e-2, wandb=0, device_id=0, seed=seed, rand_dataset=1, learning_decay=False,
        averaing="weight", online_ratio=1.0, csv_log=False)
    for k, v in best_args["fl_digits"]["dapperfl"].items():
        setattr(a, k, v)
    for k, v in VARIANTS[variant].items():
        setattr(a, k, v)
    return a


def patch_weight_decay(off, weight_decay: float) -> None:
    """Diagnostic: the official ``_train_net`` builds ``optim.SGD(..., weight_decay=1e-5)`` (dapperfl.py:64);
    point that module's ``optim`` at a copy whose SGD uses ``weight_decay`` instead (in memory only)."""
    import torch.optim as optim

    class SGD(optim.SGD):
        def __init__(self, params, **kw):
            kw["weight_decay"] = weight_decay
            super().__init__(params, **kw)
    off.dapperfl.optim = types.SimpleNamespace(SGD=SGD)


def run(off, inputs, variant: str, seed: int, rounds: int, out: Path, normalize: str, augment: bool,
        weight_decay: float | None, official_root: Path, jaxfl_config_path: Path, quiet: bool = True,
        nf: int = 16) -> list:
    import torch

    cfg = inputs.cfg
    n = inputs.num_clients
    args = official_args(seed, rounds, cfg.local_epochs, n, variant, off.best_args)
    assert args.local_lr == cfg.lr and args.local_batch_size == cfg.batch_size, (args, cfg)
    if variant == "dapperfl":
        jx = cfg.options.get("dapperfl", {})
        ratios = [float(r) for r in args.pr_ratios]
        assert ratios == [float(r) for r in jx.get("device_ratios", ratios)], (ratios, jx)
    if weight_decay is not None:
        patch_weight_decay(off, weight_decay)

    off.conf.set_random_seed(seed)  # utils/conf.py: random, numpy, torch
    train, test, test_sizes = make_loaders(inputs, args.local_batch_size, normalize, augment)
    nets = [off.resnet.resnet10(inputs.num_classes, nf=nf) for _ in range(n)]  # datasets/digits.py:224-236
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # FederatedModel.__init__ creates ./checkpoint/<dataset>/ in the working directory
    try:
        model = off.DapperFL(nets, args, None)
    finally:
        os.chdir(cwd)
    for d in (out / "checkpoint" / args.dataset, out / "checkpoint"):
        with contextlib.suppress(OSError):
            d.rmdir()  # the official code leaves it empty
    draw = CohortDraw(inputs.cohorts)
    model.random_state = draw
    model.trainloaders = train

    config = {
        "adapter": "experiments/official/dapperfl.py", "official": "jyzgh/DapperFL",
        "official_commit": official_commit(official_root), "variant": variant, "seed": seed, "rounds": rounds,
        "backbone": f"resnet10(nf={nf})", "normalize": normalize, "augment": augment,
        "sgd": {"lr": args.local_lr, "momentum": 0.9,
                "weight_decay": 1e-5 if weight_decay is None else weight_decay},
        "official_args": vars(args), "jaxfl_config": str(jaxfl_config_path), "clients": inputs.client_names,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "bn_pruning_ties": "jaxfl's rule" if getattr(off.dapperfl.torch_prune, "_jaxfl_ties", False) else "official",
    }
    log = MetricsLog(out, inputs.client_names, config)

    model.ini()  # training.py:118-119
    hist = []
    for r in range(rounds):  # training.py:127-137
        draw.round = r
        model.epoch_index = r
        sink = io.StringIO() if quiet else sys.stdout
        with contextlib.redirect_stdout(sink):  # its per-client "Prune local model ..." lines
            model.loc_update(train)
        accs = off.training.global_evaluate(model, test, "domain_skew", "fl_digits")  # % rounded to 0.01
        acc = np.round(np.asarray(accs) / 100.0, 6)
        rec = log.round(r + 1, model.online_clients, test_accuracy=acc, test_count=test_sizes)
        hist.append(rec)
        print(f"{variant} seed {seed} round {r + 1}: mean {rec['mean_accuracy'] * 100:.2f} "
              f"({rec['time_s']:.1f} s)", flush=True)
    return hist


def scratch_model(off, nets, args, cohorts, train):
    """(the official ``DapperFL`` over ``nets``, its ``CohortDraw``) for a check: built in a temporary working
    directory (its constructor creates ./checkpoint/), drawing jaxfl's ``cohorts``, training on ``train``."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            model = off.DapperFL(nets, args, None)
        finally:
            os.chdir(cwd)
    draw = CohortDraw(cohorts)
    model.random_state, model.trainloaders = draw, train
    return model, draw


def check_semantics(off, inputs, clients: int = 5, samples: int = 64, rounds: int = 2, epochs: int = 2) -> dict:
    """Instrumented short run of the official DapperFL (``--check``) on the first ``clients`` clients (device
    levels 0..0.8), ``samples`` images each: in every round it records (a) whether any module of the client's
    net is pruned when its co-pruning block runs (the fusion at dapperfl.py:97-100 only touches pruned
    modules) and (b) how the aggregated global state_dict compares with sum_i p_i (w_orig_i * mask_i) (pruned
    entries averaged as zeros), with the paper's recovery W + sum_i p_i M_i (w_i - W), and, for BN running
    statistics, with their plain p-weighted mean."""
    import torch
    import torch.nn.utils.prune as torch_prune

    sub = type(inputs)(inputs.cfg, inputs.client_names[:clients],
                       [(x[:samples], y[:samples]) for x, y in inputs.train[:clients]],
                       [(x[:samples], y[:samples]) for x, y in inputs.test[:clients]], inputs.num_classes,
                       inputs.normalize, [np.arange(clients)] * rounds)
    args = official_args(0, rounds, epochs, clients, "dapperfl", off.best_args)
    off.conf.set_random_seed(0)
    train, test, _ = make_loaders(sub, args.local_batch_size, "jaxfl", False)
    nets = [off.resnet.resnet10(sub.num_classes, nf=16) for _ in range(clients)]
    model, draw = scratch_model(off, nets, args, sub.cohorts, train)
    report = {"pruned_modules_at_fusion": [], "aggregation": []}
    res_pruning, aggregate = model._res_pruning, model.aggregate_nets

    def res_pruning_probe(index, net, mod_struc=False):
        n = sum(torch_prune.is_pruned(m) for m in net.modules()
                if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear)))
        report["pruned_modules_at_fusion"].append((model.epoch_index, index, int(n)))
        return res_pruning(index, net, mod_struc)

    def aggregate_probe(freq=None):
        prev = {k: v.clone() for k, v in model.global_net.state_dict().items()}
        p = np.array([train[i].sampler.indices.size for i in model.online_clients], float)
        p /= p.sum()
        zero, recovered = {}, {}
        for w, i in zip(p, model.online_clients):
            sd = model.nets_list[i].state_dict()
            for k, v in sd.items():
                if k.endswith("_mask"):
                    continue
                if k.endswith("_orig"):
                    base = k[:-5]
                    m = sd[base + "_mask"]
                    val, rec = v * m, prev[base] + m * (v - prev[base])
                    k = base
                else:
                    val = rec = v
                if not torch.is_floating_point(val):
                    continue
                zero[k] = zero.get(k, 0) + w * val
                recovered[k] = recovered.get(k, 0) + w * rec
        aggregate(freq)
        new = model.global_net.state_dict()
        stats = [k for k in zero if k.endswith(("running_mean", "running_var"))]
        weights = [k for k in zero if k not in stats]
        report["aggregation"].append({
            "round": model.epoch_index,
            "max_abs_diff_to_zero_fill_weights": max(float((new[k] - zero[k]).abs().max()) for k in weights),
            "max_abs_diff_to_paper_recovery_weights": max(float((new[k] - recovered[k]).abs().max())
                                                          for k in weights),
            "max_abs_diff_to_plain_mean_bn_stats": max(float((new[k] - zero[k]).abs().max()) for k in stats),
        })

    model._res_pruning, model.aggregate_nets = res_pruning_probe, aggregate_probe
    model.ini()
    for r in range(rounds):
        draw.round = r
        model.epoch_index = r
        with contextlib.redirect_stdout(io.StringIO()):
            model.loc_update(train)
    return report


def jaxfl_to_torch(params, stats) -> dict:
    """jaxfl ``resnet10_slim`` / ``resnet10`` variables as the official ``resnet10(nf=16 / 64)`` state dict
    (numpy): conv kernels HWIO -> OIHW, BatchNorm scale/bias/statistics -> weight/bias/running_*, the head's
    Dense kernel transposed. Names: encoder/conv_stem -> conv1, bn_stem -> bn1, layerK_0/{conv,bn}{1,2} ->
    layerK.0.{conv,bn}{1,2}, conv_shortcut / bn_shortcut -> layerK.0.shortcut.{0,1}, head/fc1 -> linear."""
    enc, st = params["encoder"], stats["encoder"]
    sd = {}

    def conv(name, k):
        sd[name + ".weight"] = np.transpose(np.asarray(k["kernel"]), (3, 2, 0, 1))

    def bn(name, p_, s_):
        sd.update({name + ".weight": np.asarray(p_["scale"]), name + ".bias": np.asarray(p_["bias"]),
                   name + ".running_mean": np.asarray(s_["mean"]), name + ".running_var": np.asarray(s_["var"])})

    conv("conv1", enc["conv_stem"])
    bn("bn1", enc["bn_stem"], st["bn_stem"])
    for k in (1, 2, 3, 4):
        blk, bst, t = enc[f"layer{k}_0"], st[f"layer{k}_0"], f"layer{k}.0"
        for i in (1, 2):
            conv(f"{t}.conv{i}", blk[f"conv{i}"])
            bn(f"{t}.bn{i}", blk[f"bn{i}"], bst[f"bn{i}"])
        if "conv_shortcut" in blk:
            conv(f"{t}.shortcut.0", blk["conv_shortcut"])
            bn(f"{t}.shortcut.1", blk["bn_shortcut"], bst["bn_shortcut"])
    head = params["head"]["fc1"]["linear"]
    sd["linear.weight"], sd["linear.bias"] = np.asarray(head["kernel"]).T, np.asarray(head["bias"])
    return sd


# the official ResNet registers its stem and head twice (``_features`` = Sequential(conv1, bn1, ReLU, layer1..4),
# ``cls`` = linear): its state dict lists them under both names
ALIASES = (("_features.0.", "conv1."), ("_features.1.", "bn1."), ("_features.3.", "layer1."),
           ("_features.4.", "layer2."), ("_features.5.", "layer3."), ("_features.6.", "layer4."), ("cls.", "linear."))


def canonical(key: str) -> str:
    for alias, name in ALIASES:
        if key.startswith(alias):
            return name + key[len(alias):]
    return key


def use_jaxfl_tie_rule(off) -> None:
    """Diagnostic: the official BN pruning (``torch_prune.l1_unstructured``, dapperfl.py:161) with jaxfl's
    tie rule. torch's ``topk`` returns tied entries in an implementation-defined order, and BN scales after a
    few SGD steps from 1.0 tie exactly (float32 spacing at 1.0 is 6e-8): this prunes the round(amount n)
    smallest |gamma|, ties broken as ``jaxfl.ops.masks.magnitude_mask`` breaks them (lower index kept)."""
    import torch
    prune = off.dapperfl.torch_prune
    if getattr(prune, "_jaxfl_ties", False):
        return

    def l1_unstructured(module, name, amount):
        w = getattr(module, name).detach().abs().flatten()
        k = round(amount * w.numel())
        order = sorted(range(w.numel()), key=lambda i: (float(w[i]), -i))  # ascending |w|, higher index first
        mask = torch.ones_like(w)
        mask[order[:k]] = 0
        return prune.custom_from_mask(module, name, mask.reshape(getattr(module, name).shape))
    prune.l1_unstructured, prune._jaxfl_ties = l1_unstructured, True


NF = {"resnet10_slim": 16, "resnet10": 64}  # jaxfl's model -> the official resnet10's base width


def check_weights(off, inputs, rounds: int = 2, epochs: int = 3, samples: int = 64,
                  jaxfl_ties: bool = False) -> dict:
    """Weight-level differential check of whole rounds (``--check-weights``): the official DapperFL loop and
    jaxfl's released-code preset from the *same* initial weights (jaxfl's init copied into every official net)
    on the same clients, each client cut to ``samples`` = one batch of 64 (so both codes see the same batch in
    every epoch whatever their shuffles), without augmentation, the official ResNet-10's width from the config's
    model (``NF``), ``epochs`` local epochs (1 dense, the rest masked: momentum across the
    pruning, the masked steps), weight decay 1e-5 on both sides (the official value), every client every round.
    Returns per round the largest difference of the global model's entries (relative to the entry's largest
    magnitude), split into parameters and BN running statistics, and the global models' test accuracy."""
    import dataclasses

    import torch

    from jaxfl.run.runner import Experiment

    nf = NF[inputs.cfg.model]
    cfg = dataclasses.replace(inputs.cfg, samples_per_client=samples, local_epochs=epochs, rounds=rounds,
                              weight_decay=1e-5, eval_every=1, out=None, resume=False, checkpoint_every=0,
                              augment="none")
    assert cfg.batch_size == samples, "one batch per client and epoch"
    sub = jaxfl_inputs(cfg)
    exp = Experiment(cfg)
    server, store = exp.init()
    args = official_args(0, rounds, epochs, sub.num_clients, "dapperfl", off.best_args)
    off.conf.set_random_seed(0)
    train, test, _ = make_loaders(sub, args.local_batch_size, "jaxfl", False)
    nets = [off.resnet.resnet10(sub.num_classes, nf=nf) for _ in range(sub.num_clients)]
    sd0 = jaxfl_to_torch(server["params"], server["batch_stats"])
    with torch.no_grad():
        own = nets[0].state_dict()
        for k, v in own.items():
            name = canonical(k)
            if name in sd0:
                v.copy_(torch.from_numpy(np.array(sd0[name], np.float32)).reshape(v.shape))
            elif not (k.startswith("encoder.") or k.endswith("num_batches_tracked")):
                raise SystemExit(f"no jaxfl value for {k}")
    model, draw = scratch_model(off, nets, args, sub.cohorts, train)
    if jaxfl_ties:
        use_jaxfl_tie_rule(off)
    model.ini()  # every net and the global net start from net 0 = jaxfl's init
    report = []
    for r in range(rounds):
        draw.round = r
        model.epoch_index = r
        with contextlib.redirect_stdout(io.StringIO()):
            model.loc_update(train)
        server, _ = exp.run_rounds(server, store, r, 1)
        ours = jaxfl_to_torch(server["params"], server["batch_stats"])
        theirs = {canonical(k): v.detach().numpy() for k, v in model.global_net.state_dict().items()}
        worst = {"params": (0.0, ""), "bn_statistics": (0.0, "")}
        for k, v in ours.items():
            kind = "bn_statistics" if "running" in k else "params"
            d = float(np.abs(theirs[k] - v).max() / max(np.abs(v).max(), 1e-12))
            if d >= worst[kind][0]:
                worst[kind] = (d, k)
        with contextlib.redirect_stdout(io.StringIO()):
            accs = off.training.global_evaluate(model, test, "domain_skew", "fl_digits")
        ev = exp.evaluate(server, store)
        report.append({"round": r + 1, "max_relative_difference": worst,
                       "official_mean_accuracy": float(np.mean(accs)) / 100.0,
                       "jaxfl_mean_accuracy": ev["mean_accuracy"]})
    return {"model": cfg.model, "nf": nf, "clients": sub.num_clients, "samples_per_client": samples,
            "epochs": epochs, "rounds": report}


JAXFL_RUNS = {"dapperfl": "jaxfl dapperfl (spec preset)",
              "dapperfl_use_fusionfalse_recover_modezero_bn_statsunmasked": "jaxfl released-code preset",
              "fedavg": "jaxfl fedavg"}


def read_history(path: Path) -> list[dict]:
    return read_log(path)


def compare(official_root: Path, jaxfl_root: Path, seeds: list[int], official_variants: list[str],
            figure: Path | None) -> str:
    """Markdown: seed_table of the official runs and jaxfl's, and per (official, jaxfl) pair the criterion
    |final mean difference| <= max(2 pooled seed-stds, 1.5 points), pooled std = sqrt((s1^2 + s2^2) / 2) of
    the population stds seed_table reports; the same for the mean of the last 5 rounds."""
    ec = experiments_common()
    results = {}
    for v in official_variants:
        results[f"official {v}"] = [read_history(official_root / f"seed{s}" / v / "metrics.jsonl") for s in seeds]
    for v, name in JAXFL_RUNS.items():
        # the experiment scripts' layout: jaxfl_root/seed<s>/ for several seeds, jaxfl_root itself for one
        paths = [ec.seed_root(jaxfl_root, s, seeds) / v / "metrics.jsonl" for s in seeds]
        if all(log_exists(p) for p in paths):  # a variant not run for every seed is left out
            results[name] = [read_history(p) for p in paths]
    curves, results = results, common_rounds(results)  # "final" and "last 5" at rounds both sides evaluated
    text = ec.seed_table(results) + "\n\n"
    rows = ["| official | jaxfl | final: difference (points) | allowed | verdict | last 5: difference | allowed "
            "| verdict |", "|---|---|---|---|---|---|---|---|"]
    pairs = [(o, j) for o in results if o.startswith("official dapperfl")
             for j in ("jaxfl released-code preset", "jaxfl dapperfl (spec preset)") if j in results]
    pairs += [(o, "jaxfl fedavg") for o in results if o.startswith("official fedavg") and "jaxfl fedavg" in results]
    for o, j in pairs:
        so, sj = ec.seed_stats(results[o]), ec.seed_stats(results[j])
        cells = []
        for key in ("final", "tail"):
            diff = so[key][0] - sj[key][0]
            allowed = agreement_bound(so[key][1], sj[key][1])
            cells += [f"{diff:+.2f}", f"{allowed:.2f}", "match" if abs(diff) <= allowed else "DIFFER"]
        rows.append(f"| {o} | {j} | " + " | ".join(cells) + " |")
    text += "\n".join(rows) + "\n"
    if figure is not None:
        figure.parent.mkdir(parents=True, exist_ok=True)
        seeds_text = f"{len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
        ec.plot_mean_accuracy(curves, figure, f"DapperFL on digits: official code vs jaxfl ({seeds_text})",
                              highlight="official dapperfl")
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default=None, help="runs go to OUT/<variant>[suffix]/ (required unless --check)")
    p.add_argument("--variants", default="dapperfl,fedavg", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--config", default=None, help="the jaxfl run's config.json whose inputs to use (default: "
                   "logs/dapperfl_seeds/seed<S>/dapperfl_use_fusionfalse_recover_modezero_bn_statsunmasked)")
    p.add_argument("--normalize", choices=("jaxfl", "official"), default="jaxfl")
    p.add_argument("--augment", action="store_true", help="the official RandomCrop(32, 4) + HorizontalFlip")
    p.add_argument("--nf", type=int, choices=(16, 64), default=16, help="the ResNet-10's base width: 16 (jaxfl's "
                   "resnet10_slim) or 64 (the official digits backbone, jaxfl's resnet10)")
    p.add_argument("--weight-decay", type=float, default=None, help="override the official 1e-5 (diagnostic)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--verbose", action="store_true", help="show the official code's prints")
    p.add_argument("--check", action="store_true", help="only the instrumented 2-round semantics check "
                   "(fusion gate, recovery, BN statistics), printed as JSON")
    p.add_argument("--check-weights", action="store_true", help="only the weight-level check of --rounds "
                   "whole rounds from the same initial weights (check_weights), printed as JSON")
    p.add_argument("--check-epochs", type=int, default=3, help="with --check-weights: local epochs (1: dense only)")
    p.add_argument("--jaxfl-ties", action="store_true", help="the official BN pruning breaks exact ties as jaxfl "
                   "does (use_jaxfl_tie_rule; a diagnostic): in --check-weights and in whole runs, whose folders "
                   "get the suffix _jaxflties")
    p.add_argument("--compare", default=None, metavar="OFFICIAL_ROOT", help="only compare: OFFICIAL_ROOT/"
                   "seed<s>/<variant>/metrics.jsonl against --jaxfl-logs for --seeds; prints markdown")
    p.add_argument("--seeds", default="0,1,2", help="with --compare")
    p.add_argument("--jaxfl-logs", default=str(LOGS / "dapperfl_seeds"), help="with --compare: the jaxfl runs "
                   "(JAXFL_LOGS/seed<s>/<variant>/, or JAXFL_LOGS/<variant>/ for one seed)")
    p.add_argument("--figure", default=None, help="with --compare: the plot's path")
    a = p.parse_args(argv)
    if a.compare:
        print(compare(Path(a.compare), Path(a.jaxfl_logs), [int(t) for t in a.seeds.split(",")],
                      [v for v in a.variants.split(",") if v], Path(a.figure) if a.figure else None))
        return
    root = official_repo("DAPPERFL_OFFICIAL", "jyzgh/DapperFL")
    if not (a.check or a.check_weights) and not a.out:
        p.error("--out is required")
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    suffix = ("" if a.weight_decay is None else f"_wd{a.weight_decay:g}") + \
             ("" if a.normalize == "jaxfl" else "_imagenetnorm") + ("_aug" if a.augment else "") + \
             ("" if a.nf == 16 else f"_nf{a.nf}") + ("_jaxflties" if a.jaxfl_ties else "")
    cfg_path = Path(a.config) if a.config else (LOGS / "dapperfl_seeds" / f"seed{a.seed}" /
                                               "dapperfl_use_fusionfalse_recover_modezero_bn_statsunmasked" /
                                               "config.json")
    off = import_official(root)
    inputs = jaxfl_inputs(jaxfl_config(cfg_path, a.seed, a.rounds))
    if a.check:
        print(json.dumps(check_semantics(off, inputs), indent=1))
        return
    if a.check_weights:
        print(json.dumps(check_weights(off, inputs, rounds=a.rounds, epochs=a.check_epochs,
                                       jaxfl_ties=a.jaxfl_ties), indent=1))
        return
    if a.jaxfl_ties:
        use_jaxfl_tie_rule(off)
    for v in variants:
        t0 = time.perf_counter()
        hist = run(off, inputs, v, a.seed, a.rounds, Path(a.out) / (v + suffix), a.normalize, a.augment,
                   a.weight_decay, root, cfg_path, quiet=not a.verbose, nf=a.nf)
        print(f"{v}{suffix} seed {a.seed}: final {hist[-1]['mean_accuracy'] * 100:.2f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
