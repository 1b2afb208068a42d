"""Shared plumbing of the paper-comparison scripts: run (or reuse) one algorithm variant, tables, plots.

A variant is ``name`` or ``name:key=value:key=value`` (the algorithm's options, e.g. ``fedpick:lam_lce=1:lam_dis=1``,
or RunConfig fields; tuples joined by "+", e.g. ``dapperfl:device_ratios=0+0.8``);
its runs live in ``<out>/<variant>/``. A finished run whose config matches is reused, an interrupted one
resumes from its last checkpoint, so rerunning a script only does the missing work.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxfl.algorithms import options_class
from jaxfl.checkpoint import Checkpointer
from jaxfl.config import RunConfig
from jaxfl.options import field_type
from jaxfl.runner import Experiment, RunResult


def _typed(tp, value: str, spec: str):
    if tp is tuple or "tuple" in str(tp):  # e.g. device_ratios=0+0.2 ("," separates variants)
        return tuple(float(x) for x in value.split("+"))
    if tp is bool or "bool" in str(tp):
        return value.lower() in ("1", "true", "yes")
    if tp is int or "int" in str(tp):
        return int(value)
    if tp is float or "float" in str(tp):
        return float(value)
    return value


def parse_variant(spec: str) -> tuple[str, dict, dict]:
    """"fedpick:lam_lce=1:tau=2:lr=0.05" -> ("fedpick", {"lam_lce": 1.0, "tau": 2.0}, {"lr": 0.05}): the
    algorithm, its options (typed by its Options class) and RunConfig fields (typed by RunConfig)."""
    name, *pairs = spec.split(":")
    cls = options_class(name)
    option_types = {f.name: field_type(cls, f) for f in cls.fields()}
    run_types = {f.name: f.type for f in dataclasses.fields(RunConfig) if f.name != "options"}
    opts, run = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key in option_types:
            opts[key] = _typed(option_types[key], value, spec)
        elif key in run_types:
            run[key] = _typed(run_types[key], value, spec)
        else:
            raise SystemExit(f"unknown option {key!r} in {spec!r}; {name} takes {', '.join(sorted(option_types))}"
                             f", or a RunConfig field")
    return name, opts, run


def run_variant(spec: str, base: RunConfig, out_root: str | Path, progress: bool = False,
                keep_state: bool = False) -> tuple[list[dict], Experiment | None, RunResult | None]:
    """(history, experiment, result) of one variant. A finished run with a matching config is reused: then
    experiment and result are None, unless ``keep_state``, which rebuilds the experiment and restores the final
    checkpoint (no retraining) so that the final states can be inspected."""
    name, opts, run = parse_variant(spec)
    out = Path(out_root) / spec.replace(":", "_").replace("=", "")
    table = {**base.options.get(name, {}), **opts}
    cfg = base.replace(algorithm=name, out=str(out), checkpoint_every=1, options={name: table}, **run)
    default = RunConfig().to_dict()
    same = lambda d: {k: d.get(k, default.get(k)) for k in set(d) | set(default) if k != "resume"}
    saved = out / "config.json"
    done = (out / "summary.json").is_file() and same(json.loads(saved.read_text())) == same(cfg.resolved().to_dict())
    if done and not keep_state:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], None, None
    ckpts = out / "checkpoints"  # resume only from a saved round (a run killed before its first has none)
    experiment = Experiment(cfg.replace(resume=ckpts.is_dir() and Checkpointer(ckpts).latest_round() is not None))
    result = experiment.run(progress=progress)
    return result.history, experiment, result


def table(results: dict, names: list[str], paper: dict) -> str:
    """Markdown table in the papers' format: per-client best accuracy over rounds (last round), %, and the
    paper's numbers for the base algorithm name."""
    rows = ["| method | " + " | ".join(names) + " | avg | paper (" + " / ".join(names) + ") |",
            "|---" * (len(names) + 3) + "|"]
    for spec, hist in results.items():
        evals = [h for h in hist if "test_accuracy" in h]
        best = [max(h["test_accuracy"][j] for h in evals) * 100 for j in range(len(names))]
        last = [a * 100 for a in evals[-1]["test_accuracy"]]
        cells = " | ".join(f"{b:.2f} ({l:.2f})" for b, l in zip(best, last))
        ref = paper.get(spec.split(":")[0])
        ref_text = " / ".join(f"{p:.2f}" for p in ref) if ref else "-"
        rows.append(f"| {spec} | {cells} | {sum(best) / len(best):.2f} ({sum(last) / len(last):.2f}) | {ref_text} |")
    return "\n".join(rows)


def plot_mean_accuracy(results: dict, path: Path, title: str, highlight: str = "") -> None:
    """PNG: unweighted mean test accuracy over clients per round, one line per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec, hist in results.items():
        evals = [h for h in hist if "test_accuracy" in h]
        ax.plot([h["round"] for h in evals], [h["mean_accuracy"] for h in evals], marker="o", label=spec,
                lw=2.5 if spec.split(":")[0] == highlight else 1.2)
    ax.set(xlabel="round", ylabel="mean test accuracy over clients", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
