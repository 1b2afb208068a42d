"""Shared plumbing of the paper-comparison scripts: run (or reuse) one algorithm variant, tables, plots.

A variant is ``name`` or ``name:key=value:key=value`` (the algorithm's options, e.g. ``fedpick:lam_lce=1:lam_dis=1``,
or RunConfig fields; tuples joined by "+", e.g. ``dapperfl:device_ratios=0+0.8``);
its runs live in ``<out>/<variant>/`` (with several seeds, ``<out>/seed<s>/<variant>/``). A finished run whose
config matches is reused, an interrupted one resumes from its last checkpoint, so rerunning a script only does
the missing work. Every script takes ``--seeds 0,1,2``: its tables then give mean +- std over the seeds and its
accuracy plot a band of +- one std around the mean.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxfl.algorithms import options_class
from jaxfl.core.options import field_type
from jaxfl.errors import ConfigError
from jaxfl.run import cli
from jaxfl.run.checkpoint import Checkpointer
from jaxfl.run.compile_cache import resolve_compile_cache, use_compile_cache
from jaxfl.run.script import check_at_least, parse_list, run_script  # noqa: F401 (the scripts' shared one-line errors)
from jaxfl.run.config import RunConfig, validate
from jaxfl.run.runner import Experiment, RunResult
# the seed tables and the figure are jaxfl's own (``jaxfl compare`` writes the same from run folders)
from jaxfl.run.compare import accuracy_curve, plot_mean_accuracy, seed_stats, seed_table  # noqa: F401


def _typed(tp, value: str, spec: str):
    """``value`` of variant ``spec`` as type ``tp``; ConfigError naming both if it is not one."""
    try:
        if tp is tuple or "tuple" in str(tp):  # e.g. device_ratios=0+0.2 ("," separates variants)
            return tuple(float(x) for x in value.split("+"))
        if tp is bool or "bool" in str(tp):
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        if tp is int or "int" in str(tp):
            return int(value)
        if tp is float or "float" in str(tp):
            return float(value)
    except ValueError:
        kind = "true/false" if "bool" in str(tp) else "numbers joined by +" if "tuple" in str(tp) else getattr(
            tp, "__name__", str(tp))
        raise ConfigError(f"{value!r} in variant {spec!r} is not a {kind}") from None
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
            takes = f"{', '.join(sorted(option_types))} or" if option_types else "no options of its own, only"
            raise ConfigError(f"unknown option {key!r} in {spec!r}; {name} takes {takes} a RunConfig field "
                              f"(name=value)")
    return name, opts, run


def variant_config(spec: str, base: RunConfig, out: Path) -> RunConfig:
    """The RunConfig of variant ``spec`` over ``base``, written to ``out``."""
    name, opts, run = parse_variant(spec)
    table = {**base.options.get(name, {}), **opts}
    return base.replace(algorithm=name, out=str(out), checkpoint_every=1, options={name: table}, **run)


def check_variants(specs, base: RunConfig) -> None:
    """Every variant's config validated before the first runs (ConfigError naming the bad one): a typo in the
    last variant must not cost the runs of the others."""
    for spec in specs:
        validate(variant_config(spec, base, Path(".")))


def variant_dir(spec: str) -> str:
    """The folder name of variant ``spec`` ("rfeddis:fusion=sum" -> "rfeddis_fusionsum")."""
    return spec.replace(":", "_").replace("=", "")


def run_variant(spec: str, base: RunConfig, out_root: str | Path, progress: bool = False,
                keep_state: bool = False) -> tuple[list[dict], Experiment | None, RunResult | None]:
    """(history, experiment, result) of one variant. A finished run with a matching config is reused: then
    experiment and result are None, unless ``keep_state``, which rebuilds the experiment and restores the final
    checkpoint (no retraining) so that the final states can be inspected."""
    out = Path(out_root) / variant_dir(spec)
    cfg = variant_config(spec, base, out)
    default = RunConfig().to_dict()
    same = lambda d: {k: d.get(k, default.get(k)) for k in set(d) | set(default) if k != "resume"}
    saved = out / "config.json"
    done = (out / "summary.json").is_file() and same(json.loads(saved.read_text())) == same(cfg.resolved().to_dict())
    if done and not keep_state:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], None, None
    # the CLI's compile cache: a script's other seeds and variants of the same shapes read their programs
    use_compile_cache(*resolve_compile_cache(None)[:2])
    ckpts = out / "checkpoints"  # resume only from a saved round (a run killed before its first has none)
    experiment = Experiment(cfg.replace(resume=ckpts.is_dir() and Checkpointer(ckpts).latest_round() is not None))
    result = experiment.run(progress=progress)
    return result.history, experiment, result


def table(results: dict[str, list[list[dict]]], names: list[str], paper: dict) -> str:
    """Markdown table in the papers' format: per client, its best test accuracy over rounds (and in the last
    round), %, averaged over the variant's seeds (``± std`` over seeds when there are several), and the
    paper's numbers for the base algorithm name."""
    rows = ["| method | " + " | ".join(names) + " | avg | paper (" + " / ".join(names) + ") |",
            "|---" * (len(names) + 3) + "|"]
    for spec, hists in results.items():
        best, last = [], []
        for hist in hists:
            evals = [h for h in hist if "test_accuracy" in h]
            best.append([max(h["test_accuracy"][j] for h in evals) * 100 for j in range(len(names))])
            last.append([a * 100 for a in evals[-1]["test_accuracy"]])
        best, last = np.array(best), np.array(last)  # [seeds, clients]
        pm = lambda v: f" ± {v.std():.2f}" if len(hists) > 1 else ""
        cells = " | ".join(f"{best[:, j].mean():.2f}{pm(best[:, j])} ({last[:, j].mean():.2f})"
                           for j in range(len(names)))
        ref = paper.get(spec.split(":")[0])
        ref_text = " / ".join(f"{p:.2f}" for p in ref) if ref else "-"
        rows.append(f"| {spec} | {cells} | {best.mean():.2f}{pm(best.mean(1))} ({last.mean():.2f}) | {ref_text} |")
    return "\n".join(rows)


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2] (distinct seeds >= 0, in order), as ``jaxfl run --seeds`` reads them."""
    return cli.parse_seeds(str(text))  # (a ConfigError: run_script's one line, exit 2)


def seed_root(out_root: str | Path, seed: int, seeds: list[int]) -> Path:
    """Where ``seed``'s runs live: ``out_root`` itself for a single seed, ``out_root/seed<s>`` for several."""
    return Path(out_root) if len(seeds) == 1 else Path(out_root) / f"seed{seed}"


def run_seeds(spec: str, base: RunConfig, out_root: str | Path, seeds: list[int],
              progress: bool = False) -> list[list[dict]]:
    """The history of variant ``spec`` for each seed (``run_variant`` with ``base.seed`` replaced)."""
    return [run_variant(spec, base.replace(seed=s), seed_root(out_root, s, seeds), progress)[0] for s in seeds]


def with_epsilon(label: str, hists: list[list[dict]]) -> str:
    """The label with the ε the runs logged after their last round (equal over seeds: it depends on q, z, T, δ)."""
    eps = {h[-1].get("dp_epsilon") for h in hists}
    return label if eps == {None} else f"{label}, ε = {eps.pop():.3g}"


def write_privacy_results(results: dict[str, list[list[dict]]], out: Path, head: str, title: str, key: str) -> None:
    """The DP scripts' outputs: ``head`` and the seed table (printed and in ``out/table.md``) and the mean
    accuracy per round with the ε each row spent in its legend (``out/accuracy.png``)."""
    text = head + "\n" + seed_table(results, key=key)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    plot_mean_accuracy({with_epsilon(label, hists): hists for label, hists in results.items()}, out / "accuracy.png",
                       title, key=key)
