"""What the adapters that run on ``experiments/pfl_methods.py``'s setting share (``pfllib.py``, ``fedrepo.py``,
``fedproto.py``, ``fedfomo.py``, ``flbench.py``): the setting's model in torch with jaxfl's initial weights, the
check that a jaxfl run is in that setting, finding jaxfl's runs, the per-method comparison table and figure, and
the library adapters' command line (``Library``).

The setting: MNIST, 20 clients, Dirichlet(0.1) labels, ``mlp_2nn`` (784-200-200-10), plain SGD, batch 10, one
local epoch, every client every round, mean test accuracy over clients.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np

from common import agreement_bound, log_exists, official_repo, read_log

SETTING = dict(model="mlp_2nn", batch_size=10, local_epochs=1, momentum=0.0, weight_decay=0.0,
               clients_per_round=None)  # None: every client every round


def check_setting(cfg, run: str, prog: str, momentum: float = 0.0, algorithm: str | None = None) -> None:
    """Exit with one line unless ``cfg`` (the jaxfl run ``run``'s RunConfig) is in the setting above, with client
    SGD momentum ``momentum`` (an official optimizer may fix it) and, if given, algorithm ``algorithm``; the
    line names each field that differs and the value it needs."""
    expected = dict(SETTING, momentum=momentum, **({"algorithm": algorithm} if algorithm else {}))
    wrong = [f"{k} {getattr(cfg, k)!r} (needs {v!r})" for k, v in expected.items() if getattr(cfg, k) != v]
    if wrong:
        sgd = "plain SGD" if momentum == 0 else f"SGD momentum {momentum:g}"
        raise SystemExit(f"{prog}: error: {run} is not {'a ' + algorithm if algorithm else 'an'} mlp_2nn run with "
                         f"batch 10, one local epoch, {sgd}, no weight decay and every client each round: "
                         f"{', '.join(wrong)}")


def two_nn(num_classes: int = 10, with_features: bool = False):
    """jaxfl's ``mlp_2nn`` in torch: flatten - fc1 (200) - ReLU - fc2 (200) - ReLU - fc (classes), the classifier
    named ``fc`` as PFLlib names it. ``with_features``: ``forward`` returns ``(features, logits)``, the features
    being fc2's ReLU output (FedRepo's networks return ``(hs, logits)``)."""
    import torch.nn as nn

    class TwoNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(784, 200)
            self.fc2 = nn.Linear(200, 200)
            self.fc = nn.Linear(200, num_classes)

        def forward(self, x):
            h = nn.functional.relu(self.fc2(nn.functional.relu(self.fc1(x.flatten(1)))))
            logits = self.fc(h)
            return (h, logits) if with_features else logits

    return TwoNN()


TWO_NN_LAYERS = {"fc1": ("encoder", "fc1"), "fc2": ("encoder", "fc2"), "fc": ("head", "fc1")}
LOGREG_LAYERS = {"fc": ("head", "fc1")}


def load_jaxfl_init(model, cfg, layers: dict[str, tuple[str, str]] = TWO_NN_LAYERS) -> None:
    """Copy jaxfl's initial parameters of ``cfg``'s seed into ``model``: torch layer ``name`` of ``layers`` gets
    the flax Dense ``params[part][layer]["linear"]`` (kernels [in, out] -> torch [out, in]); the 2NN by default."""
    import torch
    from jaxfl.run.runner import Experiment
    with tempfile.TemporaryDirectory() as out:  # the run's own folder is not empty; nothing is written here
        server, _ = Experiment(dataclasses.replace(cfg, algorithm="fedavg", options={}, out=out, resume=False)).init()
    pairs = {name: server["params"][part][layer]["linear"] for name, (part, layer) in layers.items()}
    with torch.no_grad():
        for name, layer in pairs.items():
            getattr(model, name).weight.copy_(torch.from_numpy(np.array(layer["kernel"], np.float32).T))
            getattr(model, name).bias.copy_(torch.from_numpy(np.array(layer["bias"], np.float32)))


def finished(out: Path, rounds: int) -> bool:
    """Whether ``out/metrics.jsonl`` holds an evaluation of round ``rounds``."""
    path = out / "metrics.jsonl"
    return path.exists() and any(json.loads(line)["round"] == rounds for line in path.read_text().splitlines())


def jaxfl_runs(root: Path, seed: int) -> dict[str, Path]:
    """{variant: run folder} of ``pfl_methods.py``'s logs for ``seed`` (folders ``<variant>_lr<lr>``)."""
    return {d.name.rsplit("_lr", 1)[0]: d for d in sorted((root / f"seed{seed}").iterdir())
            if log_exists(d / "metrics.jsonl")}


def compare_methods(ec, label: str, official: dict[str, bool], official_logs: Path, jaxfl_logs: Path,
                    seeds: list[int]) -> tuple[str, dict]:
    """Per method of ``official`` ({variant: whether ``label``'s code is the method's official code}) that both
    sides logged for every seed (``official_logs/seed<s>/<variant>/``, ``jaxfl_runs(jaxfl_logs, s)``): final and
    last-5 mean accuracy (mean ± std over seeds), the difference of the final means and the agreement criterion
    max(2 pooled seed-stds, 1.5 points). Returns the markdown table and {variant: {label: runs, "jaxfl": runs}}
    for ``plot_panels``."""
    load = lambda path: read_log(path / "metrics.jsonl")
    runs = {s: jaxfl_runs(jaxfl_logs, s) for s in seeds}
    pairs = {}
    for variant in official:
        try:
            jax_h = [load(runs[s][variant]) for s in seeds]
            off_h = [load(official_logs / f"seed{s}" / variant) for s in seeds]
        except (KeyError, OSError):
            continue
        pairs[variant] = {label: off_h, "jaxfl": jax_h}
    rows = [f"| method | {label} is | lr | {label} final | jaxfl final | difference | bound | verdict | "
            f"{label} last-5 | jaxfl last-5 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, res in pairs.items():
        (o_m, o_s), (j_m, j_s) = (ec.seed_stats(h)["final"] for h in res.values())
        (ot_m, ot_s), (jt_m, jt_s) = (ec.seed_stats(h)["tail"] for h in res.values())
        bound = agreement_bound(o_s, j_s)
        lr = json.loads((runs[seeds[0]][variant] / "config.json").read_text())["lr"]
        kind = "official" if official[variant] else "a reference"
        rows.append(f"| {variant} | {kind} | {lr:g} | {o_m:.2f} ± {o_s:.2f} | {j_m:.2f} ± {j_s:.2f} | "
                    f"{j_m - o_m:+.2f} | {bound:.2f} | {'agree' if abs(o_m - j_m) <= bound else 'DIFFER'} | "
                    f"{ot_m:.2f} ± {ot_s:.2f} | {jt_m:.2f} ± {jt_s:.2f} |")
    return "\n".join(rows), pairs


def plot_panels(ec, pairs: dict, path: Path) -> None:
    """One panel per method: both sides' mean accuracy per round, ± one std over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(4, len(pairs))
    rows = -(-len(pairs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.5 * rows), sharex=True, squeeze=False)
    for ax, (variant, res) in zip(axes.flat, pairs.items()):
        for label, hists in res.items():
            curves = [ec.accuracy_curve(h) for h in hists]
            n = min(len(c[0]) for c in curves)
            acc = np.stack([c[1][:n] for c in curves]) * 100
            line, = ax.plot(curves[0][0][:n], acc.mean(0), lw=1.2, label=label)
            ax.fill_between(curves[0][0][:n], acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0),
                            color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(variant, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(pairs):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("round", fontsize=8)
    fig.supylabel("mean test accuracy over clients (%)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PFL_METHODS_LOGS = str(Path(__file__).resolve().parent.parent / "logs" / "pfl_methods")


def add_comparison_arguments(parser, jaxfl_logs: str | None = PFL_METHODS_LOGS) -> None:
    """The options of ``compare_and_write`` (and of a run's ``--all``): ``--compare``, the two log folders,
    ``--seeds``, ``--table``, ``--figure`` and ``--experiments-common``."""
    parser.add_argument("--compare", action="store_true", help="compare finished runs: --official-logs, --jaxfl-logs")
    parser.add_argument("--official-logs", help="the adapter's runs, seed<s>/<variant>/")
    parser.add_argument("--jaxfl-logs", default=jaxfl_logs, help="jaxfl's runs, seed<s>/<variant>_lr<lr>/")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--table", help="compare: also write the markdown table here")
    parser.add_argument("--figure", help="compare: also draw the curves here (PNG)")
    parser.add_argument("--experiments-common", help="compare: path of experiments/common.py")


def compare_and_write(args, label: str, official: dict[str, bool], caption: str) -> None:
    """``compare_methods`` on ``args.official_logs`` and ``args.jaxfl_logs``: print the table, write it under
    ``caption`` to ``--table`` and the curves to ``--figure`` when given."""
    from common import experiments_common
    ec = experiments_common(args.experiments_common)
    table, pairs = compare_methods(ec, label, official, Path(args.official_logs), Path(args.jaxfl_logs),
                                   [int(s) for s in args.seeds.split(",")])
    print(table)
    if args.table:
        Path(args.table).write_text(f"{caption}, seeds {args.seeds}; mean accuracy over clients, %\n\n{table}\n")
        print("wrote", args.table)
    if args.figure and pairs:
        plot_panels(ec, pairs, Path(args.figure))
        print("wrote", args.figure)


def run_each(args, methods, script: str, label: str, extra: tuple[str, ...] = (), quiet: bool = False) -> None:
    """For each of ``--seeds``, every jaxfl run of ``--jaxfl-logs`` whose variant is in ``methods`` (and in
    ``--methods`` if given) and is not finished under ``--out/seed<s>/<variant>/``: ``script --method ...`` in a
    process of its own (the official modules keep state, torch's seeds and imported classes, between runs)."""
    import subprocess
    import sys
    for s in [int(s) for s in args.seeds.split(",")]:
        for variant, folder in jaxfl_runs(Path(args.jaxfl_logs), s).items():
            if variant not in methods or (args.methods and variant not in args.methods.split(",")):
                continue
            out = Path(args.out) / f"seed{s}" / variant
            if finished(out, json.loads((folder / "config.json").read_text())["rounds"]):
                continue
            print(f"{label} {variant}, seed {s} ({folder.name})", flush=True)
            subprocess.run([sys.executable, script, "--method", variant, "--jaxfl-run", str(folder), "--out", str(out),
                            "--commit", args.commit, *extra], check=True,
                           stdout=subprocess.DEVNULL if quiet else None)


def add_run_arguments(parser, methods, label: str, commit: str) -> None:
    """A library adapter's run options: ``--method`` (one of ``methods``), ``--jaxfl-run``, ``--out``,
    ``--commit`` (default ``commit``), ``--progress``, and ``--all`` / ``--methods`` for ``run_each``."""
    parser.add_argument("--method", choices=sorted(methods), help=f"the jaxfl variant whose {label} counterpart runs")
    parser.add_argument("--jaxfl-run", help=f"the jaxfl run (folder with config.json) whose inputs, lr, seed and "
                        f"rounds {label}'s run takes")
    parser.add_argument("--out", help="output folder (of a run; with --all, of all runs)")
    parser.add_argument("--commit", default=commit, help="the checkout's commit")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--all", action="store_true", help="run every method of --jaxfl-logs for --seeds, then compare")
    parser.add_argument("--methods", help="--all: only these variants (comma-separated)")


@dataclasses.dataclass(frozen=True)
class Library:
    """A library adapter's identity: the label of its columns, the repository and commit it was run from, the
    environment variable that names the checkout and the folder of it that its modules import from, and
    {jaxfl variant: whether the library's code is that method's official code}."""

    label: str
    repo: str
    commit: str
    env_var: str
    official: dict
    code_dir: str = ""
    name: str = ""  # how the table's caption names the code (default: the label)

    def compare(self, args) -> None:
        """``compare_and_write`` for this library's methods."""
        compare_and_write(args, self.label, self.official,
                          f"{self.name or self.label} ({self.repo} {args.commit[:7]}) vs jaxfl on jaxfl's inputs "
                          f"(experiments/pfl_methods.py's setting)")

    def main(self, argv, doc: str, script: str, run, add_arguments=None, extra=lambda args: (),
             quiet: bool = False, check=lambda args: None) -> None:
        """The adapter's command line: one run (``run(args)``, with the checkout on ``sys.path``), ``--all``
        (``run_each`` with ``extra(args)`` passed on, then the comparison) or ``--compare``;
        ``add_arguments(parser)`` adds the adapter's own options, ``check(args)`` returns a usage error of one
        run's arguments (or None)."""
        import argparse
        import sys
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_run_arguments(p, self.official, self.label, self.commit)
        if add_arguments:
            add_arguments(p)
        add_comparison_arguments(p)
        args = p.parse_args(argv)
        if args.compare:
            self.compare(args)
        elif args.all:
            if not args.out:
                p.error("--all needs --out")
            run_each(args, self.official, script, self.label, extra=extra(args), quiet=quiet)
            args.official_logs = args.out
            self.compare(args)
        else:
            if not (args.method and args.out and args.jaxfl_run):
                p.error("a run needs --method, --jaxfl-run and --out (or use --all / --compare)")
            if check(args):
                p.error(check(args))
            sys.path.insert(0, str(official_repo(self.env_var, self.repo) / self.code_dir))
            run(args)
