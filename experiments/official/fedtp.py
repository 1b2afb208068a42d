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
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
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
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    repo = official_repo("FEDTP_OFFICIAL", "zhyczy/FedTP")
    clash = [m for m in OFFICIAL_MODULES if m in sys.modules]
    if clash:
        raise SystemExit(f"official: error: modules {clash} already imported; they would shadow the official ones")

    # ---- jaxfl's inputs (before the official checkout goes on sys.path)
    inputs = jaxfl_inputs(jaxfl_config(args))
    cfg, n = inputs.cfg, inputs.num_clients
    k = len(inputs.cohorts[0])
    widths = vit_widths(cfg.model)
    if cfg.eval_every < 2:
        print("official: note: the official code cannot evaluate round 1 (test_round > 1); evaluating from round 2",
              file=sys.stderr)

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def stack(parts):
        x = np.concatenate([to_nchw_float(xi, inputs.normalize) for xi, _ in parts])
        y = np.concatenate([np.asarray(yi, np.int64) for _, yi in parts])
        sizes = [len(yi) for _, yi in parts]
        offs = np.concatenate([[0], np.cumsum(sizes)])
        idx = {i: np.arange(offs[i], offs[i + 1]) for i in range(len(parts))}
        return torch.from_numpy(x), torch.from_numpy(y), idx

    x_tr, y_tr, map_tr = stack(inputs.train)
    x_te, y_te, map_te = stack(inputs.test)

    def cls_counts(y, idx):
        return {i: dict(zip(*[a.tolist() for a in np.unique(y.numpy()[ix], return_counts=True)]))
                for i, ix in idx.items()}

    # ---- the official modules, with the stand-ins above
    stubbed = install_stubs()
    sys.path.insert(0, str(repo))
    import models.Hypernetworks as off_hyper
    import models.vit as off_vit
    import utils as off_utils

    def partition_data(dataset, datadir, partition, n_parties, beta=0.4, logdir=None):
        assert n_parties == n, (n_parties, n)
        return (x_tr, y_tr.numpy(), x_te, y_te.numpy(), map_tr, map_te,
                cls_counts(y_tr, map_tr), cls_counts(y_te, map_te))

    subsets = {}

    def subset(x, y, ix):
        key = (id(x), int(ix[0]) if len(ix) else -1, len(ix))
        if key not in subsets:
            t = torch.as_tensor(np.asarray(ix), dtype=torch.long)
            subsets[key] = TensorDataset(x[t], y[t])
        return subsets[key]

    def get_divided_dataloader(dataset, datadir, train_bs, test_bs, dataidxs_train, dataidxs_test, noise_level=0,
                               net_id=None, total=0, drop_last=False, apply_noise=False):
        assert not apply_noise and not noise_level, "noise is not part of this comparison"
        train_ds, test_ds = subset(x_tr, y_tr, dataidxs_train), subset(x_te, y_te, dataidxs_test)
        return (DataLoader(dataset=train_ds, batch_size=train_bs, shuffle=True, drop_last=drop_last),
                DataLoader(dataset=test_ds, batch_size=test_bs, shuffle=False, drop_last=False), train_ds, test_ds)

    def get_dataloader(dataset, datadir, train_bs, test_bs, dataidxs=None, *a, **kw):
        train_ds, test_ds = TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te)
        return (DataLoader(dataset=train_ds, batch_size=train_bs, shuffle=True, drop_last=False),
                DataLoader(dataset=test_ds, batch_size=test_bs, shuffle=False, drop_last=False), train_ds, test_ds)

    off_utils.partition_data = partition_data
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

    # ---- per-round bookkeeping: cohort injection, train losses, evaluations -> metrics.jsonl
    run = {"round": 0, "train_loss": {}, "eval": None}
    config = {"official_repo": str(repo), "official_commit": _git_head(repo), "variant": args.variant,
              "official_alg": ALGS[args.variant], "config": args.config, "vit": widths, "stubbed_imports": stubbed,
              "jaxfl_config": dataclasses.asdict(cfg), "normalize": list(inputs.normalize)}
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
    (log.out / "config.json").write_text(__import__("json").dumps(config, indent=2, default=str))
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
