"""RFedDis's *official* code (LooKing9218/RFedDis, e6866b9) on the inputs of jaxfl's RFedDis `digits` runs.

    RFEDDIS_OFFICIAL=/path/to/LooKing9218+RFedDis JAXFL_DATA_DIR=../shared/data \\
        python experiments/official/rfeddis.py --seed 0 --rounds 6 --out ../runs/official/rfeddis/seed0/rfeddis

Run it from any directory but the repository root (there ``import jaxfl`` would pick up the working tree). It
needs PyTorch and jaxfl (for the data); no torchvision: the official modules import it only for their
transforms and datasets, which are replaced, so an empty stand-in is put into ``sys.modules``.
``python experiments/official/rfeddis.py compare`` writes the official-vs-jaxfl table and figure (see
``compare``).

The jaxfl runs matched are ``experiments/rfeddis.py --rounds 6 --datasets digits --seeds 0,1,2`` (logs:
``experiments/logs/rfeddis_seeds/seed{s}/rfeddis``): ``digits`` = MNIST-M, MNIST, USPS (one client each),
743 training images per client (a seeded subset), the full test sets (2000 / 10000 / 2007 images), 28x28x3,
(x/255 - 0.5)/0.5, ``digits_cnn`` with RFedDis's two heads, SGD lr 0.01 without momentum or weight decay,
batch 32, 1 local epoch, every client every round, annealing horizon T = rounds, 6 rounds.

What runs unchanged from the checkout named by ``$RFEDDIS_OFFICIAL`` (imported, never copied), all from
``federated/RFedDis_digits.py`` and ``nets/models.py``:
``DigitModelDis`` (the model: encoder, teacher = global head, student = local head, default init),
``train_UncertaintyDis`` (one local epoch: CE on both heads + evidential loss on global/local/DS-fused
Dirichlets with ``ce_loss``/``KL``/``DS_Combin`` + annealed ``exp(-symmetric KL)`` of ``KL_Loss``),
``communication`` (averages every state-dict entry whose name has 'features' or 'teacher' and no 'bn',
uniform weights, copies it back to every client), ``test`` (eval mode, prediction = argmax of the DS-fused
alpha, exact accuracy correct/total), ``nn.CrossEntropyLoss`` and ``KL_Loss`` as the official losses.

What is not a function in the official code and is mirrored here: the ``__main__`` round loop
(RFedDis_digits.py:314-359): seed numpy and torch, ``server_model = DigitModelDis()``, one deep copy per
client, per round a fresh ``optim.SGD(lr=args.lr)`` per client (:334), ``wk_iters`` calls of
``train_UncertaintyDis(..., global_step=a_iter, args)`` per client in client order (:339-340),
``communication`` (:343), ``test`` of every client on its own train loader (the official report, :346-348)
and on its own test loader (:355-356). The ``__main__`` block cannot be run as it is: it hard-codes five
clients (MNIST, SVHN, USPS, SynthDigits, MNIST-M; ``client_num`` = 5 is read by ``communication`` as a
module global, set here to the number of clients), ``seed = 1`` (:269) and its data paths.

What is replaced, and how it is matched:
- Data (``prepare_data``, :19-85, FedBN's pickled partitions read by ``utils.data_utils.DigitsDataset`` with
  torchvision transforms): replaced by jaxfl's clients (``common.jaxfl_inputs``: the same 743 training images
  per client, the same test sets, the same resize to 28x28 and channel replication) as float NCHW tensors
  normalised (x/255 - 0.5)/0.5 -- the official transforms' ``ToTensor`` + ``Normalize(0.5, 0.5)``, so the
  normalisation is the same; no augmentation on either side (the official digits transforms have none).
  The official resize of USPS (PIL bilinear 16 -> 28) is not applied: both sides read jaxfl's resized
  arrays. Loaders: ``DataLoader(batch_size=32, shuffle=True)`` for training and ``shuffle=False`` for test,
  as the official ones (:71-80; ``drop_last=False``: 743 = 23 x 32 + 7, 24 steps per epoch, as jaxfl).
- Arguments (the official argparse lives in ``__main__``): a namespace with the official defaults except
  ``iters`` = ``--rounds`` (the annealing horizon T of ``min(1, a_iter / iters)``, :107, :175; jaxfl's
  ``annealing_coefficient(round, total_rounds)``), ``lr``, ``batch``, ``wk_iters`` (= local epochs),
  ``num_classes`` = 10.
- Seeding: ``--seed`` replaces the hard-coded ``seed = 1`` (numpy, torch, torch.cuda as at :270-272).
- Model: ``DigitModelDis`` is the architecture jaxfl's ``digits_cnn`` + RFedDis heads builds (conv5x5
  64-64-128 with BN, each head 6272-2048(BN, ReLU)-512(BN, ReLU)-10, disentangling feature = post-ReLU
  2048-d); nothing differs except the flatten order (NCHW here, NHWC in jaxfl: a fixed permutation of fc1's
  inputs, irrelevant from a random init). Init: torch's defaults (jaxfl draws from the same distributions).
- Logging only: a forward hook on the model during the official ``test`` records the head outputs, from
  which the fused alpha (official ``DS_Combin``) gives jaxfl's ``test_loss`` (NLL of alpha_F / S_F) and
  ``test_uncertainty`` (K / S_F); the official test loss (the full training objective) is logged as
  ``official_test_loss``. ``train_loss`` is ``train_UncertaintyDis``'s (mean over batches).

The official code has no local-only or FedAvg baseline (``--mode`` only names the log file), so only RFedDis
is run.

Diagnostics (each switches one element of the protocol to something else; default = the official protocol):
``--init jaxfl`` loads jaxfl's initial parameters of ``--seed`` (both heads, encoder, BN) into the model.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np

from common import (JaxflInputs, MetricsLog, agreement_bound, common_rounds, experiments_common, jaxfl_inputs,
                    official_repo, pooled_std, read_log, stub_unimportable, to_nchw_float)

REPO = "LooKing9218/RFedDis"
HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE.parent


def jaxfl_config(args):
    """The jaxfl RunConfig of the matched run (experiments/rfeddis.py's ``base_config("digits")``, algorithm
    rfeddis with its default options, seed ``args.seed``)."""
    from jaxfl.run.config import RunConfig
    return RunConfig(algorithm="rfeddis", dataset="digits", image_size=28, samples_per_client=743,
                     rounds=args.rounds, lr=args.lr, momentum=0.0, batch_size=args.batch_size,
                     local_epochs=args.epochs, eval_every=1, seed=args.seed)


def load_official(repo: Path) -> types.ModuleType:
    """``federated/RFedDis_digits.py`` as module ``rfeddis_digits_official`` (its ``__main__`` block does not
    run), with the checkout first on sys.path for its imports (``nets.models``, ``utils.data_utils``)."""
    # federated/RFedDis_digits.py and utils/data_utils.py import torchvision.transforms for their data pipeline
    # only (replaced here)
    stub_unimportable("torchvision", ("transforms",))
    sys.path.insert(0, str(repo))
    spec = importlib.util.spec_from_file_location("rfeddis_digits_official", repo / "federated" / "RFedDis_digits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rfeddis_digits_official"] = mod
    spec.loader.exec_module(mod)
    return mod


def official_args(args) -> argparse.Namespace:
    """The official ``__main__`` argparse namespace (RFedDis_digits.py:275-289): its defaults, with the
    matched settings."""
    return argparse.Namespace(log=False, test=False, percent=0.1, lr=args.lr, batch=args.batch_size, gpu=1,
                              num_classes=10, iters=args.rounds, wk_iters=args.epochs, mode="fedbn", mu=1e-2,
                              save_path="../checkpoint", resume=False)


def jaxfl_to_torch(params, stats) -> dict:
    """jaxfl RFedDis variables (``params``, ``batch_stats`` of RFedDisNet on digits_cnn) as a ``DigitModelDis``
    state dict of numpy arrays: encoder -> features, head -> classifier_teacher_*, local_head ->
    classifier_student_*; fc1's input rows permuted from jaxfl's HWC flatten to torch's CHW."""
    def conv(d):
        return {"weight": np.transpose(np.asarray(d["kernel"]), (3, 2, 0, 1)), "bias": np.asarray(d["bias"])}

    def dense(d, chw=None):
        d = d.get("linear", d)
        k = np.asarray(d["kernel"])
        if chw is not None:  # rows in (h, w, c) order -> (c, h, w)
            c, h, w = chw
            k = k.reshape(h, w, c, -1).transpose(2, 0, 1, 3).reshape(c * h * w, -1)
        return {"weight": k.T, "bias": np.asarray(d["bias"])}

    def bn(pp, ss):
        return {"weight": np.asarray(pp["scale"]), "bias": np.asarray(pp["bias"]),
                "running_mean": np.asarray(ss["mean"]), "running_var": np.asarray(ss["var"])}

    sd = {}
    for i in (1, 2, 3):
        sd.update({f"features.conv{i}.{k}": v for k, v in conv(params["encoder"][f"conv{i}"]).items()})
        sd.update({f"features.bn{i}.{k}": v for k, v in bn(params["encoder"][f"bn{i}"],
                                                            stats["encoder"][f"bn{i}"]).items()})
    for jax_head, torch_head in (("head", "teacher"), ("local_head", "student")):
        hp, hs = params[jax_head], stats[jax_head]
        sd.update({f"classifier_{torch_head}_h.fc1.{k}": v for k, v in dense(hp["fc1"], (128, 7, 7)).items()})
        sd.update({f"classifier_{torch_head}_h.bn4.{k}": v for k, v in bn(hp["bn1"], hs["bn1"]).items()})
        sd.update({f"classifier_{torch_head}_out.fc2.{k}": v for k, v in dense(hp["fc2"]).items()})
        sd.update({f"classifier_{torch_head}_out.bn5.{k}": v for k, v in bn(hp["bn2"], hs["bn2"]).items()})
        sd.update({f"classifier_{torch_head}_out.fc3.{k}": v for k, v in dense(hp["fc3"]).items()})
    return sd


def jaxfl_initial_state(cfg):
    """(experiment, server variables) of the jaxfl run of ``cfg`` at initialisation (``Experiment.init``)."""
    from jaxfl.run.runner import Experiment
    exp = Experiment(cfg)
    server, _ = exp.init()
    return exp, server


def load_state(models, sd: dict) -> None:
    """Copy a numpy state dict (``jaxfl_to_torch``) into every model."""
    import torch
    with torch.no_grad():
        for model in models:
            own = model.state_dict()
            missing = [k for k in own if k not in sd and not k.endswith("num_batches_tracked")]
            if missing:
                raise SystemExit(f"no jaxfl value for {missing}")
            for k, v in sd.items():
                own[k].copy_(torch.from_numpy(np.array(v, np.float32)).reshape(own[k].shape))


def load_jaxfl_init(models, cfg) -> None:
    """Diagnostic ``--init jaxfl``: jaxfl's initial parameters and BN statistics of ``cfg`` in every model."""
    _, server = jaxfl_initial_state(cfg)
    load_state(models, jaxfl_to_torch(server["params"], server["batch_stats"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=6, help="communication rounds = the annealing horizon T")
    p.add_argument("--out", required=True)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round (official --wk_iters)")
    p.add_argument("--init", choices=("torch", "jaxfl"), default="torch",
                   help="torch: DigitModelDis drawn after seeding (default); jaxfl: jaxfl's initial parameters")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = p.parse_args(argv)

    repo = official_repo("RFEDDIS_OFFICIAL", REPO)
    cfg = jaxfl_config(args)
    inp: JaxflInputs = jaxfl_inputs(cfg)
    n = inp.num_clients
    if any(len(c) != n for c in inp.cohorts):
        raise SystemExit("official: error: the official loop trains every client every round")

    import torch
    from torch import nn, optim
    torch.set_num_threads(args.threads)
    off = load_official(repo)
    from nets.models import DigitModelDis
    oargs = official_args(args)
    device = torch.device("cpu")

    # RFedDis_digits.py:269-272, with --seed for the hard-coded seed 1
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)

    server_model = DigitModelDis().to(device)                      # :314
    loss_fun = nn.CrossEntropyLoss()                               # :315
    loss_kl = off.KL_Loss().to(device)                             # :316

    def tensors(x, y):
        return (torch.from_numpy(to_nchw_float(x, inp.normalize)), torch.as_tensor(np.asarray(y), dtype=torch.long))

    train_sets = [torch.utils.data.TensorDataset(*tensors(x, y)) for x, y in inp.train]
    test_sets = [torch.utils.data.TensorDataset(*tensors(x, y)) for x, y in inp.test]
    train_loaders = [torch.utils.data.DataLoader(d, batch_size=oargs.batch, shuffle=True) for d in train_sets]
    test_loaders = [torch.utils.data.DataLoader(d, batch_size=oargs.batch, shuffle=False) for d in test_sets]
    test_labels = [np.asarray(y) for _, y in inp.test]
    counts = [len(y) for y in test_labels]

    off.client_num = n                                             # :325, read by communication()
    client_weights = [1 / n for _ in range(n)]                     # :326
    models = [copy.deepcopy(server_model).to(device) for _ in range(n)]  # :327
    if args.init == "jaxfl":
        load_jaxfl_init([server_model] + models, inp.cfg)

    config = {"adapter": "experiments/official/rfeddis.py", "official_repo": REPO, "official_path": str(repo),
              "official_script": "federated/RFedDis_digits.py", "adapter_args": vars(args),
              "official_args": vars(oargs), "jaxfl_config": inp.cfg.resolved().to_dict(),
              "clients": inp.client_names, "train_sizes": [len(y) for _, y in inp.train], "test_sizes": counts,
              "model": "nets.models.DigitModelDis (official)", "normalize": list(inp.normalize),
              "torch": torch.__version__, "threads": args.threads}
    log = MetricsLog(args.out, inp.client_names, config)

    captured = []
    hook = lambda module, inputs, output: captured.append((output[0].detach(), output[1].detach()))

    for a_iter in range(oargs.iters):                              # :333
        optimizers = [optim.SGD(params=models[idx].parameters(), lr=oargs.lr) for idx in range(n)]  # :334
        train_loss, train_acc = [0.0] * n, [0.0] * n
        for wi in range(oargs.wk_iters):                           # :335
            for c in range(n):                                     # :339-340
                train_loss[c], train_acc[c] = off.train_UncertaintyDis(
                    models[c], train_loaders[c], optimizers[c], loss_fun, loss_kl, device, a_iter, oargs)
        server_model, models = off.communication(oargs, server_model, models, client_weights)  # :343
        post = [off.test(models[c], server_model, train_loaders[c], loss_fun, loss_kl, device, a_iter, oargs)
                for c in range(n)]                                 # :346-348
        acc, off_loss, nll, unc = [], [], [], []
        for c in range(n):                                         # :355-356
            captured.clear()
            handle = models[c].register_forward_hook(hook)
            try:
                loss_c, acc_c = off.test(models[c], server_model, test_loaders[c], loss_fun, loss_kl, device,
                                         a_iter, oargs)
            finally:
                handle.remove()
            with torch.no_grad():
                z_t = torch.cat([t for t, _ in captured])
                z_s = torch.cat([s for _, s in captured])
                alpha = off.DS_Combin({0: nn.functional.softplus(z_t) + 1, 1: nn.functional.softplus(z_s) + 1},
                                      oargs.num_classes)
                s_f = alpha.sum(1)
                y = torch.from_numpy(test_labels[c]).long()
                nll.append(float(-(alpha.gather(1, y[:, None])[:, 0] / s_f).log().mean()))
                unc.append(float((oargs.num_classes / s_f).mean()))
                check = float((alpha.argmax(1) == y).float().mean())
            if abs(check - acc_c) > 1e-6:
                raise SystemExit(f"hooked accuracy {check} != official test accuracy {acc_c}")
            acc.append(acc_c)
            off_loss.append(loss_c)
        rec = log.round(a_iter + 1, list(range(n)), train_loss=train_loss, test_accuracy=acc, test_count=counts,
                        test_loss=nll, train_accuracy=train_acc, official_test_loss=off_loss,
                        test_uncertainty=unc, post_aggregation_train_loss=[v[0] for v in post],
                        post_aggregation_train_accuracy=[v[1] for v in post],
                        annealing=min(1.0, a_iter / oargs.iters))
        print(f"round {rec['round']}: test accuracy {[round(a, 4) for a in acc]} mean {rec['mean_accuracy']:.4f}, "
              f"train loss {[round(v, 3) for v in train_loss]}, {rec['time_s']:.1f} s", flush=True)


# ---------------------------------------------------------------------------------------------- one-step check

def check(argv=None) -> None:
    """One-step equivalence check at jaxfl's initial parameters of ``--seed``: the official
    ``train_UncertaintyDis`` on one batch (SGD with lr 1, so the parameter change is minus the gradient) against
    the gradient of jaxfl's RFedDis loss (``jaxfl.algorithms.rfeddis``'s ``loss``, taken from the algorithm's
    closure) on the same batch, at round ``--round`` of T = ``--rounds`` (the annealed terms are active from
    round 1); full batches of 32 (``--batches``: rows 32 i .. 32 i + 31 of client ``--client``'s training set)
    and a partial batch of 7 (jaxfl: padded to 32 with weight 0). The reference is the official step in float64:
    both the official float32 step and jaxfl's gradient are compared with it (a pre-ReLU value within rounding
    of 0 takes the other side of the kink in one float32 code and not in the other, which moves the gradients
    of the layers below it by more than rounding). Also: the BN running statistics after the step, the
    eval-mode fused prediction on test images, and the shared (averaged) entries of both codes."""
    import inspect

    import jax
    import jax.numpy as jnp
    import torch
    from torch import nn, optim
    p = argparse.ArgumentParser(description=check.__doc__)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--round", type=int, default=3, help="0-based round whose annealing weight the step uses")
    p.add_argument("--client", type=int, default=0, help="the client whose training images form the batches")
    p.add_argument("--batches", type=int, default=1, help="full batches checked (rows 32 i .. 32 i + 31)")
    args = p.parse_args(argv)
    args.lr, args.batch_size, args.epochs = 0.01, 32, 1
    repo = official_repo("RFEDDIS_OFFICIAL", REPO)
    cfg = jaxfl_config(args)
    exp, server = jaxfl_initial_state(cfg)
    off = load_official(repo)
    from nets.models import DigitModelDis
    from jaxfl.core.types import RoundInfo
    oargs = official_args(args)
    params, stats = server["params"], server["batch_stats"]
    sd0 = jaxfl_to_torch(params, stats)
    closure = inspect.getclosurevars(exp.algorithm.local_update).nonlocals
    loss_fn, masks = closure["loss_fn"], closure["masks"]
    info = RoundInfo(jnp.asarray(args.round, jnp.int32), jnp.asarray(0, jnp.int32), args.rounds)
    xs, ys = exp.dataset.train[args.client]
    if not 1 <= args.batches <= len(ys) // 32:
        raise SystemExit(f"official: error: --batches {args.batches}: client {args.client} has {len(ys) // 32} "
                         f"full batches")
    worst, bias_max = {}, {}  # (label, kind, side) -> (largest relative difference, entry); (label) -> max |g|s

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))

    def official_step(x_nhwc, y, dtype):
        """The official step in ``dtype``: (loss, {entry: minus the change (the gradient) or, for a BN
        statistic, its value after the step}) as float64 numpy arrays."""
        model = DigitModelDis()
        load_state([model], sd0)
        model = model.to(dtype)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = optim.SGD(params=model.parameters(), lr=1.0)
        xt = torch.from_numpy(np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))).to(dtype)
        loss_t, _ = off.train_UncertaintyDis(model, [(xt, torch.from_numpy(y).long())], opt,
                                             nn.CrossEntropyLoss(), off.KL_Loss(), torch.device("cpu"),
                                             args.round, oargs)
        after = model.state_dict()
        return loss_t, {k: (after[k] if "running" in k else before[k] - after[k]).double().numpy()
                        for k in after if not k.endswith("num_batches_tracked")}

    batches = [(f"full batch {i} of 32", np.arange(32 * i, 32 * i + 32)) for i in range(args.batches)]
    for label, rows in batches + [("partial batch of 7", np.arange(32, 39))]:
        x_nhwc = np.asarray(exp.trainer.preprocess(jnp.asarray(xs[rows])))
        y = np.asarray(ys[rows])
        pad = 32 - len(rows)
        xj = jnp.asarray(np.concatenate([x_nhwc, np.zeros((pad,) + x_nhwc.shape[1:], np.float32)]))
        yj = jnp.asarray(np.concatenate([y, np.zeros(pad, y.dtype)]).astype(np.int32))
        wj = jnp.asarray((np.arange(32) < len(rows)).astype(np.float32))
        (loss_j, (new_stats, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, xj, yj, wj, None, None, info=info)
        g_sd = jaxfl_to_torch(grads, new_stats)  # gradients in torch layout; BN entries: the new running stats
        loss_t, g32 = official_step(x_nhwc, y, torch.float32)
        loss_64, g64 = official_step(x_nhwc, y, torch.float64)
        print(f"{label}: loss official {loss_t:.6f} (float64 {loss_64:.6f}) jaxfl {float(loss_j):.6f}")
        for k in g32:
            if k.endswith("bias") and ("conv" in k or "fc1" in k or "fc2" in k):
                # a bias right before a BatchNorm in train mode: its gradient is 0 up to rounding
                prev = bias_max.get(label, (0.0, 0.0))
                bias_max[label] = (max(prev[0], float(np.abs(g32[k]).max())),
                                   max(prev[1], float(np.abs(g_sd[k]).max())))
                continue
            kind = "BN statistic after the step" if "running" in k else "gradient"
            for side, value in (("official float32", g32[k]), ("jaxfl", g_sd[k])):
                r = rel(value, g64[k])
                if r >= worst.get((label, kind, side), (-1.0, ""))[0]:
                    worst[(label, kind, side)] = (r, k)
    for label, (g_off, g_jax) in bias_max.items():
        print(f"{label}: gradient of a pre-BN bias (0 in exact arithmetic), max |g| official / jaxfl: "
              f"{g_off:.1e} / {g_jax:.1e}")
    for (label, kind, side), (r, k) in worst.items():
        print(f"{label}: max relative difference of a {kind} from the official float64 one, {side}: {r:.2e} ({k})")

    # eval-mode prediction (fused alpha) at the initial parameters on 256 test images of client 0
    tx = exp.dataset.test[0][0][:256]
    xj = exp.trainer.preprocess(jnp.asarray(tx))
    logp_j, extra = exp.algorithm.predict_trained(None, server, xj)
    model = DigitModelDis()
    load_state([model], sd0)
    model.eval()
    with torch.no_grad():
        zt, zs, _, _ = model(torch.from_numpy(np.ascontiguousarray(np.asarray(xj).transpose(0, 3, 1, 2))))
        alpha = off.DS_Combin({0: nn.functional.softplus(zt) + 1, 1: nn.functional.softplus(zs) + 1}, 10)
    p_t = (alpha / alpha.sum(1, keepdim=True)).numpy()
    print(f"eval: max relative difference of the fused expected probability {rel(p_t, np.exp(logp_j)):.2e}, "
          f"argmax agreement {float((p_t.argmax(1) == np.asarray(logp_j).argmax(1)).mean()):.4f}")

    # shared entries
    m = masks(server, info)
    flat = jax.tree_util.tree_flatten_with_path(m["params"])[0]
    jax_shared = sorted("/".join(str(getattr(q, "key", q)) for q in path) for path, v in flat if v)
    jax_stats = [path for path, v in jax.tree_util.tree_flatten_with_path(m["batch_stats"])[0] if v]
    off_shared = sorted(k for k in DigitModelDis().state_dict()
                        if "bn" not in k and ("teacher" in k or "features" in k))
    print(f"shared: official {len(off_shared)} entries {off_shared}")
    print(f"shared: jaxfl {len(jax_shared)} leaves {jax_shared}; shared BN statistics: {len(jax_stats)}")


# ---------------------------------------------------------------------------------------------- comparison

def load_runs(root: Path, variant: str, seeds) -> list[list[dict]]:
    """The histories of ``root/seed<s>/variant`` (a single seed may also be ``root/variant``: the experiment
    scripts' single-seed layout)."""
    def folder(s):
        d = root / f"seed{s}" / variant
        return d if d.is_dir() or len(seeds) > 1 else root / variant
    return [read_log(folder(s) / "metrics.jsonl") for s in seeds]


def compare(argv=None) -> None:
    """Official vs jaxfl: final and last-5 mean accuracy (mean over clients), mean +- std over seeds, the
    criterion |difference of final means| <= max(2 pooled seed-stds, 1.5 points), per-client finals, and the
    figure. Uses experiments/common.py's ``seed_table`` / ``plot_mean_accuracy`` (needs this repository's jaxfl
    importable, which experiments/common.py imports)."""
    p = argparse.ArgumentParser(description=compare.__doc__)
    p.add_argument("--official", default=str(EXPERIMENTS / "logs" / "official" / "rfeddis"))
    p.add_argument("--jaxfl", default=str(EXPERIMENTS / "logs" / "rfeddis_seeds"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="rfeddis", help="official variants (dirs under seed<s>/), comma-separated")
    p.add_argument("--figure", default=str(EXPERIMENTS / "figures" / "official_rfeddis.png"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(EXPERIMENTS.parent))  # experiments/common.py imports jaxfl from the repository
    ec = experiments_common(EXPERIMENTS / "common.py")
    plot_mean_accuracy, seed_stats, seed_table = ec.plot_mean_accuracy, ec.seed_stats, ec.seed_table
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {"jaxfl rfeddis": load_runs(Path(args.jaxfl), "rfeddis", seeds)}
    for v in args.variants.split(","):
        results[f"official {v}"] = load_runs(Path(args.official), v, seeds)
    curves, results = results, common_rounds(results)
    if results != curves:
        rounds = sorted({r["round"] for h in next(iter(results.values())) for r in h if "mean_accuracy" in r})
        print(f"(the runs evaluate different rounds: the table uses the {len(rounds)} rounds all evaluated, "
              f"{rounds[0]}-{rounds[-1]}; the figure draws every evaluation)\n")
    print(seed_table(results))
    ref = seed_stats(results["jaxfl rfeddis"])
    for label, hists in results.items():
        if label == "jaxfl rfeddis":
            continue
        st = seed_stats(hists)
        pooled, bound = pooled_std(st["final"][1], ref["final"][1]), agreement_bound(st["final"][1], ref["final"][1])
        diff = st["final"][0] - ref["final"][0]
        tdiff = st["tail"][0] - ref["tail"][0]
        print(f"\n{label} - jaxfl: final {diff:+.2f} points (bound max(2 x pooled std {pooled:.2f}, 1.5) = "
              f"{bound:.2f}: {'PASS' if abs(diff) <= bound else 'FAIL'}); last-5 mean {tdiff:+.2f}")
    print("\nper-client final accuracy %, mean ± std over seeds:")
    for label, hists in results.items():
        fin = np.array([h[-1]["test_accuracy"] for h in hists]) * 100
        cells = " | ".join(f"{m:.2f} ± {s:.2f}" for m, s in zip(fin.mean(0), fin.std(0)))
        unc = np.array([h[-1].get("test_uncertainty", [np.nan] * fin.shape[1]) for h in hists])
        print(f"| {label} | {cells} | u_F {np.nanmean(unc):.3f} |")
    print("\nper round mean accuracy % (mean over seeds):")
    for label, hists in results.items():
        acc = np.array([[r["mean_accuracy"] for r in h if "mean_accuracy" in r] for h in hists]) * 100
        print(f"| {label} | " + " / ".join(f"{v:.1f}" for v in acc.mean(0)) + " |")
    Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
    plot_mean_accuracy(curves, Path(args.figure), "RFedDis on digits: official code vs jaxfl", highlight="")
    print("figure:", args.figure)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        compare(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "check":
        check(sys.argv[2:])
    else:
        main()
