"""Shared plumbing of the paper-comparison scripts: run (or reuse) one algorithm variant, tables, plots.

A variant is ``name`` or ``name:key=value:key=value`` (RunConfig fields, e.g. ``fedpick:lam_lce=1:lam_dis=1``;
tuples joined by "+", e.g. ``dapperfl:device_ratios=0+0.8``);
its runs live in ``<out>/<variant>/``. A finished run whose config matches is reused, an interrupted one
resumes from its last checkpoint, so rerunning a script only does the missing work.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxfl.checkpoint import Checkpointer
from jaxfl.config import RunConfig
from jaxfl.runner import Experiment, RunResult


def parse_variant(spec: str) -> tuple[str, dict]:
    """"fedpick:lam_lce=1:tau=2" -> ("fedpick", {"lam_lce": 1.0, "tau": 2.0}), typed by RunConfig's fields."""
    name, *pairs = spec.split(":")
    types = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    opts = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in types:
            raise SystemExit(f"unknown option {key!r} in {spec!r}; valid: {', '.join(sorted(types))}")
        t = types[key]
        if "tuple" in t:  # e.g. device_ratios=0+0.2 ("," separates variants)
            opts[key] = tuple(float(x) for x in value.split("+"))
        elif "bool" in t:
            opts[key] = value.lower() in ("1", "true", "yes")
        elif "int" in t:
            opts[key] = int(value)
        elif "float" in t:
            opts[key] = float(value)
        else:
            opts[key] = value
    return name, opts


def run_variant(spec: str, base: RunConfig, out_root: str | Path, progress: bool = False,
                keep_state: bool = False) -> tuple[list[dict], Experiment | None, RunResult | None]:
    """(history, experiment, result) of one variant. A finished run with a matching config is reused: then
    experiment and result are None, unless ``keep_state``, which rebuilds the experiment and restores the final
    checkpoint (no retraining) so that the final states can be inspected."""
    name, opts = parse_variant(spec)
    out = Path(out_root) / spec.replace(":", "_").replace("=", "")
    cfg = base.replace(algorithm=name, out=str(out), checkpoint_every=1, **opts)
    default = RunConfig().to_dict()
    same = lambda d: {k: d.get(k, v) for k, v in default.items() if k != "resume"}  # later fields: defaults
    done = (out / "summary.json").is_file() and same(json.loads((out / "config.json").read_text())) == same(cfg.to_dict())
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
