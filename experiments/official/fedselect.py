"""FedSelect's *official* training loop (lapisrocks/fedselect, HEAD 0949f8a) on jaxfl's exact inputs.

    FEDSELECT_OFFICIAL=/path/to/lapisrocks/fedselect JAXFL_DATA_DIR=../shared/data \\
        python experiments/official/fedselect.py --seed 0 --rounds 15 --out ../runs/official/fedselect/seed0

The inputs are those of the jaxfl run in ``experiments/fedselect.py --model fedavg_cnn --rounds 15
--datasets cifar10`` (RESULTS.md, "FedSelect vs baselines on CIFAR-10 ... FedAvg CNN, 15 rounds, 3 seeds"):
CIFAR-10, 10 clients, 2-class shards, 100 training and 200 test images per client, lr 0.05, no momentum, no
weight decay, batch 32, one LocalAlt alternation per round, K = 3, p = 0.25, alpha = 0.8, every client every
round, evaluation of each client's model right after its local training.

What runs unchanged from the checkout named by ``$FEDSELECT_OFFICIAL`` (imported, never copied):
``fedselect.fedselect_algorithm`` (the whole round loop: per-client ``train_personalized`` with
``MaskLocalAltSGD`` + ``local_alt``, ``delta_update`` mask growth every ``lth_epoch_iters`` rounds,
``add_masks``/``add_server_weights``/``div_server_weights`` aggregation, ``broadcast_server_to_client_
initialization``, ``cross_client_eval``/``evaluate`` before the broadcast, no aggregation in the last
round), ``fedselect.setup_seed``, ``utils.train_utils.prepare_dataloaders`` and ``DatasetSplit``, and the
argument parser ``utils.options.lth_args_parser`` (every setting not named below keeps its official default).

What is replaced, and how it is matched:
- Data. ``get_data`` (torchvision CIFAR10, the official ``noniid`` split with 500 train / 100 test images per
  client at 100 clients) is replaced by jaxfl's clients (``common.jaxfl_inputs``): one torch Dataset holds
  every client's train images (another the test images), and ``dict_users_train[i]`` / ``dict_users_test[i]``
  are client i's index ranges in it, so the official ``prepare_dataloaders`` (DataLoader, batch ``local_bs``,
  shuffle for training) reads them unchanged.
- Normalisation and augmentation. The official train transform is RandomCrop(32, padding 4) +
  RandomHorizontalFlip + ImageNet per-channel mean/std (utils/train_utils.py:29-37); jaxfl has no augmentation
  and normalises with (x - 0.5) / 0.5. The adapter uses jaxfl's normalisation and no augmentation;
  ``--augment official`` applies the official crop + flip (zero padding on the raw pixels, torch's RNG) for a
  diagnostic.
- Model. The official ``load_model`` builds torchvision's ResNet-18; this comparison uses jaxfl's
  ``fedavg_cnn`` (conv5x5(32)-ReLU-pool-conv5x5(64)-ReLU-pool-Dense(512)-ReLU-Dense(10)), which the official
  code does not have, so ``FedAvgCNN`` below builds it in torch with torch's default init (the distribution
  jaxfl's ``torch_kernel_init`` / ``torch_bias_init`` draw from). Its classifier is named ``fc`` because the
  official ``get_mask_from_delta`` prints the sparsity of "fc.weight" (lottery_ticket.py:224). The flatten is
  in NHWC order so that ``--init jaxfl`` (a diagnostic) can load jaxfl's initial parameters of the same seed.
- Clients per round. ``run_base_experiment`` samples ``frac * num_users`` clients once, in a random order;
  here all 10 clients (jaxfl's cohort every round) in id order.
- Hard-coded official settings taken as they are: plain SGD without momentum or weight decay (``MaskLocalAltSGD``,
  pflopt/optimizers.py:326-371), a fresh optimizer per round, test batches of ``local_bs`` and test accuracy
  as the *mean of per-batch accuracies* (fedselect.py:46-48; with 200 test images and batch 32 the last
  batch of 8 counts as much as a full one). The adapter logs that number as ``official_accuracy`` and, as
  ``test_accuracy`` (jaxfl's metric, what the tables read), the exact per-client accuracy of the same models,
  computed after the official evaluation by a separate pass (no RNG used).

Writes ``--out/config.json``, ``--out/metrics.jsonl`` (jaxfl's format, ``common.MetricsLog``; per round the
clients' ``train_loss``, ``train_personal_fraction``, ``test_accuracy``, ``test_loss``, ``official_accuracy``)
and ``--out/cross_client_acc.json`` (the official final cross-client matrix, batch-mean accuracies).

Diagnostics (each switches one element of the protocol; default = the official protocol on jaxfl's inputs):
``--augment official``, ``--init jaxfl`` (jaxfl's initial parameters of ``--seed`` instead of torch's draw),
``--train-mode always`` (the model back in training mode after each evaluation: the paper's method, where the
code trains in eval mode from its second round).

The official configuration: ``--model resnet18 --normalize imagenet --augment official`` runs the code's own
model (torchvision's ResNet-18 architecture and init, built here since torchvision is not imported), ImageNet
normalisation and crop + flip; the matching jaxfl run is ``jaxfl_config``'s (``resnet18_imagenet``,
``--normalize imagenet``, ``--augment crop_flip``, and ``fedselect.frozen_bn_from=1`` for the code's eval-mode
training unless ``--train-mode always``).

Two more modes, no training run:
``--check``: exactness checks of the official mask growth, aggregation + broadcast and one LocalAlt alternation
against jaxfl's on the same tensors (``self_check``);
``--compare --official-logs DIR --jaxfl-logs DIR [--seeds 0,1,2] [--figure PNG]``: the 3-seed table, the
agreement criterion and the plot (``compare``). See experiments/official/fedselect.md.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np

from common import (JaxflInputs, MetricsLog, agreement_bound, experiments_common, jaxfl_inputs, official_repo,
                    pooled_std, read_log, stub_unimportable, to_nchw_float)

REPO = "lapisrocks/fedselect"


def jaxfl_config(args):
    """The jaxfl RunConfig of the run being matched (experiments/fedselect.py's ``base_config("cifar10")``
    with ``--model fedavg_cnn``, algorithm fedselect, seed ``args.seed``)."""
    from jaxfl.run.config import RunConfig
    resnet = getattr(args, "model", "fedavg_cnn") == "resnet18"
    # the official ResNet-18 trains in eval mode from round 2 (the module docstring); the CNN has no BatchNorm
    frozen = {"frozen_bn_from": 1} if resnet and getattr(args, "train_mode", "official") == "official" else {}
    return RunConfig(algorithm="fedselect", dataset="cifar10", num_clients=10, partition="shards",
                     classes_per_client=2, samples_per_client=100, test_per_client=args.test_per_client,
                     rounds=args.rounds, lr=args.lr, momentum=0.0, batch_size=args.batch_size, local_epochs=1,
                     options={"fedselect": {"la_epochs": args.la_epochs, "alpha": args.alpha,
                                            "grow_rate": args.grow_rate, "grow_every": args.grow_every, **frozen}},
                     model="resnet18_imagenet" if resnet else "fedavg_cnn", eval_every=1, eval_point="local",
                     seed=args.seed, normalize=getattr(args, "normalize", "dataset"),
                     augment="crop_flip" if getattr(args, "augment", "none") == "official" else "none")


def load_official(repo: Path) -> types.ModuleType:
    """The official ``fedselect.py`` as module ``fedselect_official`` (this adapter is named fedselect.py too),
    with the checkout first on sys.path for its own imports (utils, pflopt, lottery_ticket, broadcast)."""
    # the official modules import torchvision for CIFAR10, transforms and resnet18 only, all replaced here
    stub_unimportable("torchvision", ("datasets", "transforms", "models"))
    sys.path.insert(0, str(repo))
    spec = importlib.util.spec_from_file_location("fedselect_official", repo / "fedselect.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fedselect_official"] = mod
    spec.loader.exec_module(mod)
    return mod


def official_args(args, num_clients: int):
    """The official ``lth_args_parser`` namespace with the matched settings; everything else its default."""
    from utils.options import lth_args_parser
    argv = ["fedselect.py", "--lr", str(args.lr), "--local_bs", str(args.batch_size),
            "--la_epochs", str(args.la_epochs), "--com_rounds", str(args.rounds),
            "--lth_epoch_iters", str(args.grow_every), "--prune_percent", str(args.grow_rate * 100),
            "--prune_target", str(round(args.alpha * 100)), "--num_users", str(num_clients), "--frac", "1.0",
            "--num_classes", "10", "--seed", str(args.seed)]
    saved, sys.argv = sys.argv, argv
    try:
        return lth_args_parser()
    finally:
        sys.argv = saved


def fedavg_cnn_torch(num_classes: int, in_channels: int = 3, hw: int = 32):
    """jaxfl's ``fedavg_cnn`` in torch (see the module docstring): conv1, conv2 (5x5, pad 2) with ReLU and 2x2
    max-pool, fc1 (512) with ReLU, fc (classes); flatten in NHWC order, as jaxfl's."""
    import torch.nn as nn

    class FedAvgCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
            self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
            self.fc1 = nn.Linear((hw // 4) * (hw // 4) * 64, 512)
            self.fc = nn.Linear(512, num_classes)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x):
            x = self.pool(nn.functional.relu(self.conv1(x)))
            x = self.pool(nn.functional.relu(self.conv2(x)))
            x = x.permute(0, 2, 3, 1).flatten(1)
            return self.fc(nn.functional.relu(self.fc1(x)))

    return FedAvgCNN()


def resnet18_torch(num_classes: int, in_channels: int = 3):
    """torchvision's ``resnet18`` (torchvision is not imported here), as the official ``load_model`` builds it:
    7x7 stride-2 stem, 3x3 stride-2 max-pool, four stages of two BasicBlocks (64, 128, 256, 512 channels, a 1x1
    convolution + BatchNorm shortcut where the shape changes), global average pool, and ``fc`` replaced by a
    fresh ``nn.Linear(512, num_classes)``; torchvision's init: convolutions kaiming-normal (fan_out, relu),
    BatchNorm weight 1 and bias 0, the Linear layer torch's default. The state-dict names are torchvision's."""
    import torch.nn as nn

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                               if stride != 1 or cin != cout else None)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            widths, cin = (64, 128, 256, 512), 64
            for i, w in enumerate(widths):
                stride = 1 if i == 0 else 2
                setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
                cin = w
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)
            self.fc = nn.Linear(512, num_classes)  # load_model's replacement head, created last as there

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18()


def torch_model(name: str, num_classes: int, in_channels: int, hw: int):
    """The adapter's torch model for ``--model``: ``fedavg_cnn`` (jaxfl's CNN) or ``resnet18`` (the official)."""
    if name == "resnet18":
        return resnet18_torch(num_classes, in_channels)
    return fedavg_cnn_torch(num_classes, in_channels, hw)


def jaxfl_to_torch(params) -> dict:
    """jaxfl ``fedavg_cnn`` parameters (or a pytree of that structure, e.g. a mask) as torch state-dict arrays."""
    enc, head = params["encoder"], params["head"]
    return {"conv1.weight": np.transpose(enc["conv1"]["kernel"], (3, 2, 0, 1)), "conv1.bias": enc["conv1"]["bias"],
            "conv2.weight": np.transpose(enc["conv2"]["kernel"], (3, 2, 0, 1)), "conv2.bias": enc["conv2"]["bias"],
            "fc1.weight": np.asarray(enc["fc"]["linear"]["kernel"]).T, "fc1.bias": enc["fc"]["linear"]["bias"],
            "fc.weight": np.asarray(head["fc1"]["linear"]["kernel"]).T, "fc.bias": head["fc1"]["linear"]["bias"]}


def resnet_jaxfl_to_torch(variables) -> dict:
    """jaxfl ``resnet18_imagenet`` variables ({"params", "batch_stats"}, or a pytree of that structure) as
    torchvision ResNet-18 state-dict arrays: kernels HWIO -> OIHW, Dense (in, out) -> (out, in), BatchNorm
    scale/bias/mean/var -> weight/bias/running_mean/running_var, a block's shortcut -> ``downsample.0/1``."""
    import jax
    from jaxfl.core.trees import leaf_paths
    out = {}
    bn_names = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}
    for kind in ("params", "batch_stats"):
        tree = variables.get(kind, {})
        for path, v in zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree)):
            if path[0] == "head":
                out[f"fc.{'weight' if path[-1] == 'kernel' else 'bias'}"] = (np.asarray(v).T if path[-1] == "kernel"
                                                                             else np.asarray(v))
                continue
            module, leaf = path[-2], path[-1]
            block = path[1] if len(path) == 4 else None  # encoder/layerS_B/module/leaf
            prefix = "" if block is None else "layer{}.{}.".format(*block[len("layer"):].split("_"))
            name = {"conv_stem": "conv1", "bn_stem": "bn1", "conv_shortcut": "downsample.0",
                    "bn_shortcut": "downsample.1"}.get(module, module)
            out[prefix + name + "." + (bn_names[leaf] if leaf in bn_names else "weight")] = (
                np.transpose(np.asarray(v), (3, 2, 0, 1)) if leaf == "kernel" else np.asarray(v))
    return out


def local_alt_orders(key, n: int):
    """A torch Sampler that yields jaxfl's minibatch orders of one LocalAlt alternation of a client with n
    samples and round key ``key``, one per pass: the personal pass's (``fold_in(key, 1)``), then the global
    pass's (``key``); LocalTrainer's epoch 0 draws from ``fold_in(fold_in(k, 0), 0)``."""
    import jax
    import torch
    from jaxfl.core.trainer import epoch_permutation
    order = lambda k: np.asarray(epoch_permutation(jax.random.fold_in(jax.random.fold_in(k, 0), 0), n, n)).tolist()
    orders = [order(jax.random.fold_in(key, 1)), order(key)]

    class Orders(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(orders.pop(0))

        def __len__(self):
            return n
    return Orders()


def resnet_local_alt_check(local_alt, MaskLocalAltSGD, n: int = 100, modes=("train", "eval")) -> None:
    """4-5. One LocalAlt alternation of the official ResNet-18 (torchvision's architecture, ImageNet stem) in
    training mode and in eval mode (the code's rounds from its second on; jaxfl ``frozen_bn_from``), official
    ``MaskLocalAltSGD`` + ``local_alt`` vs jaxfl's ``local_alt`` from the same parameters, BatchNorm statistics
    and mask, the DataLoader fed jaxfl's minibatch orders: parameters and running statistics after it. Both
    sides compute in float64: in float32 a ReLU input within rounding of 0 takes the other side in one code
    and not the other (at ResNet-18's 1x1 layer-4 maps one such sample moves a BatchNorm bias gradient by ~10%
    of its largest entry), which hides the comparison of the rules behind the luck of the rounding."""
    from jax import enable_x64

    with enable_x64():
        _resnet_local_alt_check(local_alt, MaskLocalAltSGD, n, modes)


def _resnet_local_alt_check(local_alt, MaskLocalAltSGD, n, modes) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from jaxfl.algorithms._common import ce_loss
    from jaxfl.algorithms.fedselect import local_alt as jaxfl_local_alt
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.data.clients import ClientData
    from jaxfl.models import resnet18_imagenet

    rng = np.random.default_rng(1)
    bs, lr = 32, 0.05
    x, y = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n)
    jmodel = resnet18_imagenet(10)
    v = jmodel.init(jax.random.key(1), jnp.zeros((1, 32, 32, 3)), train=False)
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), v)
    # running statistics away from their initial values, as after a first round
    stats = jax.tree_util.tree_map(lambda s: s + jnp.asarray(rng.uniform(0.1, 0.5, s.shape), s.dtype),
                                   v["batch_stats"])
    mask = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.random(p.shape) < (0.4 if p.ndim > 1 else 0.0)),
                                  v["params"])
    key = jax.random.key(7)
    norm = (0.5, 0.5)
    trainer = LocalTrainer(optax.sgd(lr), bs, 1, lambda x: (x.astype(jnp.float64) / 255.0 - norm[0]) / norm[1])
    for mode in modes:
        loss_fn = ce_loss(jmodel, train=mode == "train")
        params, new_stats, metrics = jaxfl_local_alt(trainer, loss_fn, v["params"], stats, mask,
                                                     ClientData(jnp.asarray(x), jnp.asarray(y), jnp.int32(n)), key, 1)
        sampler = local_alt_orders(key, n)
        tmodel = resnet18_torch(10).double()
        start = {k: torch.from_numpy(np.array(a, np.float64))
                 for k, a in resnet_jaxfl_to_torch({"params": v["params"], "batch_stats": stats}).items()}
        tmodel.load_state_dict(start, strict=False)  # (num_batches_tracked stays torch's)
        tmodel.train() if mode == "train" else tmodel.eval()
        tmask = {k: torch.from_numpy(np.array(a, np.float32))
                 for k, a in resnet_jaxfl_to_torch({"params": mask}).items()}
        tmask = {k: tmask[k] for k, _ in tmodel.named_parameters()}
        inputs = (x.astype(np.float64) / 255.0 - norm[0]) / norm[1]
        ldr = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.from_numpy(inputs.transpose(0, 3, 1, 2).copy()), torch.from_numpy(y)),
            batch_size=bs, sampler=sampler)
        loss = local_alt(tmodel, torch.nn.CrossEntropyLoss(), MaskLocalAltSGD(tmodel.parameters(), tmask, lr=lr), ldr,
                         torch.device("cpu"))
        ref = resnet_jaxfl_to_torch({"params": params, "batch_stats": new_stats})
        got = tmodel.state_dict()
        moved = max(float(np.abs(ref[k] - start[k].numpy()).max()) for k in ref)
        rel = max(float(np.abs(got[k].numpy() - ref[k]).max() / max(np.abs(ref[k]).max(), 1e-12)) for k in ref)
        worst = max(ref, key=lambda k: float(np.abs(got[k].numpy() - ref[k]).max()))
        print(f"{4 if mode == 'train' else 5}. one LocalAlt alternation of ResNet-18 in {mode} mode: parameters and "
              f"statistics move by up to {moved:.2e}; max |official - jaxfl| relative to the tensor's largest entry "
              f"{rel:.2e} (largest absolute at {worst}); train loss official {loss:.6f} (mean of batch losses), "
              f"jaxfl {float(metrics['loss']):.6f}")


def load_jaxfl_init(model, cfg) -> None:
    """Copy the initial parameters of the jaxfl run of ``cfg`` (``Experiment.init``) into the torch model: the
    CNN's parameters, or every parameter and BatchNorm statistic of the ResNet-18 (``resnet_jaxfl_to_torch``)."""
    import torch
    from jaxfl.run.runner import Experiment
    server, _ = Experiment(cfg).init()
    if "conv_stem" in server["params"].get("encoder", {}):  # (resnet18_imagenet)
        pairs = resnet_jaxfl_to_torch({"params": server["params"], "batch_stats": server.get("batch_stats", {})})
    else:
        pairs = jaxfl_to_torch(server["params"])
    state = model.state_dict()  # (its tensors share the model's storage)
    missing = [k for k, t in state.items() if k not in pairs and t.dtype.is_floating_point
               and not (k.endswith("running_mean") or k.endswith("running_var"))]
    if missing:
        raise SystemExit(f"official: error: jaxfl's init has no {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, t in state.items():
            if name in pairs:
                t.copy_(torch.from_numpy(np.array(pairs[name], np.float32)))


class ArrayDataset:
    """All clients' images (uint8 NHWC, concatenated) as a torch Dataset: item -> (float CHW tensor, label),
    normalised as jaxfl does; ``augment``: the official RandomCrop(32, padding=4) + RandomHorizontalFlip on the
    raw pixels first (torch's global RNG, as torchvision's transforms draw)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, normalize, augment: bool = False):
        import torch
        self.torch = torch
        self.raw = images
        self.x = torch.from_numpy(to_nchw_float(images, normalize))
        self.y = [int(v) for v in labels]
        self.normalize = normalize
        self.augment = augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if not self.augment:
            return self.x[i], self.y[i]
        torch = self.torch
        img = np.pad(self.raw[i], ((4, 4), (4, 4), (0, 0)))
        h, w = self.raw.shape[1:3]
        top = int(torch.randint(0, img.shape[0] - h + 1, size=(1,)).item())
        left = int(torch.randint(0, img.shape[1] - w + 1, size=(1,)).item())
        img = img[top:top + h, left:left + w]
        if torch.rand(1) < 0.5:
            img = img[:, ::-1]
        return torch.from_numpy(to_nchw_float(img[None], self.normalize)[0]), self.y[i]


def concat_clients(parts: list[tuple[np.ndarray, np.ndarray]]):
    """(images, labels, {client: index array}) of the clients' arrays concatenated in client order."""
    xs, ys, idx, start = [], [], {}, 0
    for i, (x, y) in enumerate(parts):
        xs.append(x)
        ys.append(np.asarray(y))
        idx[i] = np.arange(start, start + len(y))
        start += len(y)
    return np.concatenate(xs), np.concatenate(ys), idx


def exact_eval(model, state_dict, x, y) -> tuple[float, float]:
    """(accuracy, mean CE) of ``state_dict`` on one client's whole test set: jaxfl's per-client metric."""
    import torch
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    return acc, loss


def self_check(repo: Path) -> None:
    """Exactness checks of the official rules against jaxfl's on the same tensors (no training run):
    1. mask growth: official ``lottery_ticket.delta_update`` vs ``jaxfl.ops.masks.grow_mask`` (alpha 0.8, p 0.25) on
       10 clients' random masks (personal fractions 0 to 0.85 per tensor) and random updates;
    2. aggregation + broadcast: official ``add_masks``/``add_server_weights``/``div_server_weights``/
       ``broadcast_server_to_client_initialization`` vs jaxfl's ``masked_mean`` + where (fedselect.aggregate);
    3. one LocalAlt alternation: official ``MaskLocalAltSGD`` + ``local_alt`` vs ``jaxfl.algorithms.fedselect.
       local_alt`` from the same initial CNN and mask, the torch DataLoader fed jaxfl's minibatch orders."""
    import io

    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from jaxfl.core.aggregation import masked_mean
    from jaxfl.algorithms._common import ce_loss
    from jaxfl.algorithms.fedselect import local_alt as jaxfl_local_alt
    from jaxfl.core.trainer import LocalTrainer, normalizer
    from jaxfl.data.clients import ClientData
    from jaxfl.ops.masks import grow_mask
    from jaxfl.models import fedavg_cnn

    load_official(repo)
    import broadcast as bc
    import lottery_ticket as lt
    from pflopt.optimizers import MaskLocalAltSGD, local_alt

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model, C = fedavg_cnn_torch(10), 10
    names = [k for k, _ in model.named_parameters()]
    jitter = lambda: {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    states, prevs, masks = [jitter() for _ in range(C)], [jitter() for _ in range(C)], []
    for _ in range(C):
        m = lt.init_mask_zeros(model)
        for k in m:
            if "weight" in k:
                frac = rng.choice([0.0, 0.25, 0.4375, 0.684, 0.85])
                m[k] = torch.from_numpy((rng.random(tuple(m[k].shape)) < frac).astype(np.float32))
        masks.append(m)
    differ = 0
    for c in range(C):
        with contextlib.redirect_stdout(io.StringIO()):
            grown = lt.delta_update(0.25, states[c], prevs[c], masks[c], bound=0.8, invert=True)
        for k in names:
            old = jnp.asarray(masks[c][k].numpy() > 0)
            ours = (grow_mask(old, jnp.asarray((states[c][k] - prevs[c][k]).numpy()), 0.25, 0.8) if "weight" in k
                    else old)
            differ += int((np.asarray(ours) != (grown[k].cpu().numpy() > 0)).sum())
    print(f"1. mask growth: {differ} mask entries differ (10 clients, {sum(t.numel() for t in model.parameters()):,} "
          f"entries each)")
    acc_m, acc_w = {}, {}
    for c in range(C):
        acc_m, acc_w = bc.add_masks(acc_m, masks[c]), bc.add_server_weights(acc_w, states[c], masks[c])
    acc_w = bc.div_server_weights(acc_w, acc_m)
    outs = [bc.broadcast_server_to_client_initialization(acc_w, masks[c], {k: v.clone() for k, v in states[c].items()})
            for c in range(C)]
    worst = 0.0
    for k in names:
        x = jnp.stack([jnp.asarray(st[k].numpy()) for st in states])
        m = jnp.stack([jnp.asarray(mm[k].numpy() > 0) for mm in masks])
        ours = jnp.where(m, x, masked_mean(x, jnp.ones(C), ~m, jnp.zeros(x.shape[1:]))[None])
        worst = max(worst, float(np.abs(np.stack([o[k].numpy() for o in outs]) - np.asarray(ours)).max()))
    print(f"2. aggregation + broadcast: max |official - jaxfl| = {worst:.2e}")

    n, bs, lr = 100, 32, 0.05
    x, y = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n)
    jmodel = fedavg_cnn(10)
    params = jmodel.init(jax.random.key(1), jnp.asarray(x[:1], jnp.float32), train=False)["params"]
    mask = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.random(p.shape) < (0.4 if p.ndim > 1 else 0.0)), params)
    key = jax.random.key(7)
    trainer = LocalTrainer(optax.sgd(lr), bs, 1, normalizer(0.5, 0.5))
    trained, _, metrics = jaxfl_local_alt(trainer, ce_loss(jmodel), params, {}, mask,
                                          ClientData(jnp.asarray(x), jnp.asarray(y), jnp.int32(n)), key, 1)
    tmodel = fedavg_cnn_torch(10)
    to_torch = lambda tree: {k: torch.from_numpy(np.array(v, np.float32)) for k, v in jaxfl_to_torch(tree).items()}
    tmodel.load_state_dict(to_torch(params))
    tmask = to_torch(mask)
    ldr = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(to_nchw_float(x, (0.5, 0.5))),
                                                                     torch.from_numpy(y)), batch_size=bs,
                                      sampler=local_alt_orders(key, n))
    loss = local_alt(tmodel, torch.nn.CrossEntropyLoss(), MaskLocalAltSGD(tmodel.parameters(), tmask, lr=lr), ldr,
                     torch.device("cpu"))
    ref, start = to_torch(trained), to_torch(params)
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    diff = max(float((tmodel.state_dict()[k] - ref[k]).abs().max()) for k in ref)
    print(f"3. one LocalAlt alternation (40% personal weights): parameters move by up to {moved:.2e}; max |official - "
          f"jaxfl| = {diff:.2e}; train loss official {loss:.6f} (mean of batch losses), jaxfl "
          f"{float(metrics['loss']):.6f} (mean over samples)")
    resnet_local_alt_check(local_alt, MaskLocalAltSGD)


def load_histories(root: Path, seeds: list[int], variant: str = "fedselect") -> list[list[dict]]:
    """metrics.jsonl of ``root/seed<s>/<variant>/`` for each seed (the logs/ layout of both sides)."""
    return [read_log(root / f"seed{s}" / variant / "metrics.jsonl")
            for s in seeds]


def compare(args) -> None:
    """Official vs jaxfl: ``seed_table`` (final and last-5 mean accuracy, mean ± std over seeds), the criterion
    |final mean difference| <= max(2 pooled seed-stds, 1.5 points), the per-seed finals, and the plot
    (``plot_mean_accuracy``, mean ± std bands). ``seed_table`` / ``plot_mean_accuracy`` come from the
    experiments' ``common.py`` given by ``--experiments-common`` (default: ../common.py beside this folder)."""
    ec = experiments_common(args.experiments_common)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {"official (lapisrocks/fedselect)": load_histories(Path(args.official_logs), seeds),
               "jaxfl": load_histories(Path(args.jaxfl_logs), seeds)}
    for item in args.extra or []:  # diagnostic variants: label=root
        label, root = item.split("=", 1)
        results[label] = load_histories(Path(root), seeds)
    print(ec.seed_table(results))
    (o_mean, o_std), (j_mean, j_std) = (ec.seed_stats(h)["final"] for h in list(results.values())[:2])
    pooled, bound = pooled_std(o_std, j_std), agreement_bound(o_std, j_std)
    print(f"\nfinal: official {o_mean:.2f} ± {o_std:.2f}, jaxfl {j_mean:.2f} ± {j_std:.2f}; difference "
          f"{o_mean - j_mean:+.2f}, bound max(2 x pooled std {pooled:.2f}, 1.5) = {bound:.2f}: "
          f"{'AGREE' if abs(o_mean - j_mean) <= bound else 'DIFFER'}")
    for label, hists in results.items():
        finals = [ec.accuracy_curve(h)[1][-1] * 100 for h in hists]
        tails = [ec.accuracy_curve(h)[1][-5:].mean() * 100 for h in hists]
        print(f"{label}: per seed final {[round(v, 2) for v in finals]}, last-5 mean {[round(v, 2) for v in tails]}")
    off = results["official (lapisrocks/fedselect)"]
    if all("official_mean_accuracy" in r for h in off for r in h):
        st = ec.seed_stats(off, key="official_mean_accuracy")
        print(f"official, its own batch-mean metric: final {st['final'][0]:.2f} ± {st['final'][1]:.2f}, "
              f"last-5 {st['tail'][0]:.2f} ± {st['tail'][1]:.2f}")
    if args.figure:
        ec.plot_mean_accuracy(results, Path(args.figure), "FedSelect on CIFAR-10 (FedAvg CNN): official vs jaxfl",
                              highlight="jaxfl")
        print("wrote", args.figure)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", help="output folder of a run")
    p.add_argument("--compare", action="store_true", help="compare finished runs instead of running one: "
                   "--official-logs, --jaxfl-logs (each with seed<s>/fedselect/metrics.jsonl), --seeds, --figure")
    p.add_argument("--official-logs")
    p.add_argument("--jaxfl-logs")
    p.add_argument("--extra", action="append", help="compare: a diagnostic variant, LABEL=ROOT (repeatable)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--figure")
    p.add_argument("--experiments-common", help="compare: path of experiments/common.py (seed_table, plots)")
    p.add_argument("--check", action="store_true", help="exactness checks of the official growth, aggregation and "
                   "LocalAlt against jaxfl's on the same tensors (no run)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--la-epochs", type=int, default=1, help="LocalAlt alternations per round (official default 15)")
    p.add_argument("--alpha", type=float, default=0.8, help="personalization limit (official --prune_target / 100)")
    p.add_argument("--grow-rate", type=float, default=0.25, help="p (official --prune_percent / 100)")
    p.add_argument("--grow-every", type=int, default=3, help="K (official --lth_epoch_iters)")
    p.add_argument("--test-per-client", type=int, default=200)
    p.add_argument("--model", choices=("fedavg_cnn", "resnet18"), default="fedavg_cnn",
                   help="fedavg_cnn: jaxfl's CNN in torch; resnet18: the official model (torchvision's ResNet-18; "
                        "jaxfl's side resnet18_imagenet with fedselect.frozen_bn_from=1, the official eval-mode "
                        "training from round 2)")
    p.add_argument("--train-mode", choices=("official", "always"), default="official",
                   help="official: the code's own (eval mode from round 2 on: BatchNorm frozen at round 1's "
                        "statistics); always: the model is put back in training mode after each evaluation (the "
                        "paper's method; jaxfl's side without frozen_bn_from) -- a diagnostic")
    p.add_argument("--normalize", choices=("dataset", "imagenet"), default="dataset",
                   help="dataset: jaxfl's (x/255 - 0.5)/0.5; imagenet: the official per-channel mean and std")
    p.add_argument("--augment", choices=("none", "official"), default="none",
                   help="none: jaxfl's pipeline (default); official: RandomCrop(32, 4) + horizontal flip")
    p.add_argument("--init", choices=("torch", "jaxfl"), default="torch",
                   help="torch: the model drawn after the official setup_seed (default); jaxfl: jaxfl's init")
    p.add_argument("--verbose", action="store_true", help="keep the official tqdm bars and prints")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args)
    if args.check:
        return self_check(official_repo("FEDSELECT_OFFICIAL", REPO))
    if not args.out:
        p.error("--out is required for a run")
    if not args.verbose:
        os.environ.setdefault("TQDM_DISABLE", "1")

    repo = official_repo("FEDSELECT_OFFICIAL", REPO)
    cfg = jaxfl_config(args)
    inp: JaxflInputs = jaxfl_inputs(cfg)
    n = inp.num_clients
    if any(len(c) != n for c in inp.cohorts):
        raise SystemExit("official: error: the official loop trains every client every round")

    import torch
    off = load_official(repo)
    oargs = official_args(args, n)
    off.setup_seed(oargs.seed)  # torch, numpy and random seeds, as the official __main__
    shape = (inp.num_classes, inp.train[0][0].shape[-1], inp.train[0][0].shape[1])
    model = torch_model(args.model, *shape)
    if args.init == "jaxfl":
        load_jaxfl_init(model, inp.cfg)
    oargs.device = torch.device("cpu")

    xtr, ytr, dict_train = concat_clients(inp.train)
    xte, yte, dict_test = concat_clients(inp.test)
    ds_train = ArrayDataset(xtr, ytr, inp.normalize, augment=args.augment == "official")
    ds_test = ArrayDataset(xte, yte, inp.normalize)
    test_tensors = [(torch.from_numpy(to_nchw_float(x, inp.normalize)),
                     torch.as_tensor(np.asarray(y), dtype=torch.long))
                    for x, y in inp.test]
    counts = [len(y) for _, y in inp.test]
    eval_model = torch_model(args.model, *shape)

    config = {"adapter": "experiments/official/fedselect.py", "official_repo": REPO, "official_path": str(repo),
              "adapter_args": vars(args), "official_args": {k: str(v) for k, v in vars(oargs).items()},
              "jaxfl_config": inp.cfg.resolved().to_dict(), "clients": inp.client_names,
              "train_sizes": [len(y) for _, y in inp.train], "test_sizes": counts,
              "model": f"{args.model} (torch, this adapter)", "normalize": [list(np.atleast_1d(v).tolist())
                                                                          for v in inp.normalize]}
    log = MetricsLog(args.out, inp.client_names, config)

    # hooks around the official functions (called by name from fedselect_algorithm's globals): record the
    # train loss of each client, its mask after growth, and log each round at the official evaluation
    state = {"round": 0, "client": 0, "losses": {}, "masks": {}}
    total = sum(t.numel() for t in model.parameters())
    density = lambda mask: float(sum(float(v.sum()) for v in mask.values()) / total)
    orig_train, orig_delta, orig_eval = off.train_personalized, off.delta_update, off.cross_client_eval

    def train_personalized(model_, ldr_train, mask, a, *rest, **kw):
        i = len(state["losses"])
        state["client"] = i
        state["masks"][i] = mask  # the mask it trains with; replaced by the grown one if it grows
        model_, loss = orig_train(model_, ldr_train, mask, a, *rest, **kw)
        state["losses"][i] = float(loss)
        return model_, loss

    devnull = open(os.devnull, "w")

    def delta_update(*a, **kw):  # its per-growth sparsity prints go to /dev/null unless --verbose
        with contextlib.redirect_stdout(sys.stdout if args.verbose else devnull):
            mask = orig_delta(*a, **kw)
        state["masks"][state["client"]] = mask
        return mask

    def cross_client_eval(model_, client_state_dicts, *a, no_cross=True, **kw):
        acc = orig_eval(model_, client_state_dicts, *a, no_cross=no_cross, **kw)
        if not no_cross:  # the final cross-client matrix (after the last round)
            (Path(args.out) / "cross_client_acc.json").write_text(json.dumps(acc.tolist()))
            return acc
        keys = list(client_state_dicts)
        exact = [exact_eval(eval_model, client_state_dicts[k], *test_tensors[j]) for j, k in enumerate(keys)]
        state["round"] += 1
        rec = log.round(state["round"], keys, train_loss=[state["losses"][j] for j in range(len(keys))],
                        test_accuracy=[e[0] for e in exact], test_count=counts, test_loss=[e[1] for e in exact],
                        official_accuracy=torch.diag(acc).tolist(),
                        official_mean_accuracy=float(torch.diag(acc).mean()),
                        train_personal_fraction=[density(state["masks"][j]) for j in range(len(keys))])
        print(f"round {rec['round']}: mean accuracy {rec['mean_accuracy']:.4f} (official batch-mean "
              f"{rec['official_mean_accuracy']:.4f}), train loss {np.mean(rec['train_loss']):.4f}, personal "
              f"fraction {np.mean(rec['train_personal_fraction']):.3f}, {rec['time_s']:.1f} s", flush=True)
        state["losses"] = {}
        return acc

    if args.train_mode == "always":  # a diagnostic: the model back in training mode after each evaluation
        orig_evaluate = off.evaluate

        def evaluate(model_, *a, **kw):
            try:
                return orig_evaluate(model_, *a, **kw)
            finally:
                model_.train()
        off.evaluate = evaluate
    off.train_personalized, off.delta_update, off.cross_client_eval = (train_personalized, delta_update,
                                                                       cross_client_eval)
    off.fedselect_algorithm(model, oargs, ds_train, ds_test, dict_train, dict_test, np.array([]), list(range(n)))


if __name__ == "__main__":
    main()
