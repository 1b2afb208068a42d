"""Runs side by side: ``jaxfl compare RUN_DIR...`` and the tables and figure the experiment scripts write.

A run is a folder with ``metrics.jsonl`` (and ``config.json``). Runs whose configs differ only in the seed (and
in how they were executed: output folder, strategy, backend, devices, ...) form one group; a group is reported
as mean ± std over its runs (population std: 0 for one run) of

- **final**: the accuracy after the last evaluated round;
- **best-mean**: the highest accuracy over the evaluated rounds (of the per-round mean over clients);
- **last-k**: the mean of the last k evaluations;
- per client (``per_client``): each client's final accuracy.

``results`` below is ``{label: [history, ...]}``, one history (the records of a metrics.jsonl) per seed.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from ..errors import ConfigError

# config fields that say how or where a run was executed, not what it computed
EXECUTION_FIELDS = {"seed", "out", "resume", "overwrite", "data_dir", "strategy", "backend", "chunk_size", "devices",
                    "client_store", "eval_batch_size", "rounds_per_call", "checkpoint_every"}
KEYS = ("mean_accuracy", "weighted_accuracy")


def find_runs(paths) -> list[Path]:
    """Run folders under ``paths``: a folder with metrics.jsonl is a run, any other folder is searched
    recursively. ConfigError (one line) for a path that does not exist or holds no run."""
    runs = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ConfigError(f"{str(p)!r} is not a folder; give jaxfl run folders (holding metrics.jsonl)")
        found = [p] if (p / "metrics.jsonl").is_file() else sorted(m.parent for m in p.rglob("metrics.jsonl"))
        if not found:
            raise ConfigError(f"{str(p)!r} holds no run (no metrics.jsonl in it or below it)")
        runs += [r for r in found if r not in runs]
    return runs


def load_run(folder: Path) -> tuple[dict, list[dict]]:
    """(config, history) of a run folder; a torn last line of metrics.jsonl is dropped."""
    from .checkpoint import read_metrics
    cfg_path = Path(folder) / "config.json"
    try:
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{str(cfg_path)!r} is not valid JSON ({e})") from None
    return config, read_metrics(Path(folder) / "metrics.jsonl")


def group_by_seed(runs: list[tuple[Path, dict, list[dict]]]) -> dict[str, list[list[dict]]]:
    """{label: [history per seed]}: runs whose configs agree outside ``EXECUTION_FIELDS`` share a group; the
    label is the algorithm and the fields in which the groups differ (``fedtp variant=vanilla``), or the folder
    name when configs are missing."""
    def identity(cfg):
        return json.dumps({k: v for k, v in cfg.items() if k not in EXECUTION_FIELDS}, sort_keys=True)
    groups: dict[str, list] = {}
    for folder, cfg, hist in runs:
        groups.setdefault(identity(cfg) if cfg else str(folder), []).append((folder, cfg, hist))
    configs = [members[0][1] for members in groups.values()]
    labels = _labels(groups, _differing(configs))
    if len(set(labels)) < len(labels):  # then a field only some configs have is what tells groups apart
        labels = _labels(groups, _differing(configs, count_missing=True))
    out = {}
    for label, members in zip(labels, groups.values()):
        while label in out:  # distinct groups never share a label
            label += "'"
        out[label] = [hist for _, _, hist in members]
    return out


def _labels(groups: dict, differing: list[str]) -> list[str]:
    """Each group's label by ``differing`` (its first run's folder name when it has no config)."""
    return [_label(members[0][1], differing) if members[0][1] else members[0][0].name for members in groups.values()]


def _flat(cfg: dict) -> dict:
    """Config fields, algorithm tables flattened to ``table.field``."""
    flat = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{f}": x for f, x in v.items()})
        elif k not in EXECUTION_FIELDS:
            flat[k] = v
    return flat


def _differing(configs: list[dict], count_missing: bool = False) -> list[str]:
    """Fields whose values differ between the configs that have them (``count_missing``: a config without the
    field counts as one more value, e.g. beside an official code's run, whose config has other fields); an
    algorithm's ``table.field`` only among that algorithm's configs."""
    flats = [(c.get("algorithm"), _flat(c)) for c in configs if c]
    keys = sorted({k for _, f in flats for k in f})

    def differs(k):
        among = [f for alg, f in flats if ("." not in k or k.split(".")[0] == alg) and (count_missing or k in f)]
        return len({json.dumps(f.get(k)) for f in among}) > 1
    return [k for k in keys if k != "algorithm" and differs(k)]


def _label(cfg: dict, differing: list[str]) -> str:
    flat = _flat(cfg)
    # an algorithm's table only labels that algorithm's runs
    own = [k for k in differing if k in flat and ("." not in k or k.split(".")[0] == cfg.get("algorithm"))]
    parts = [f"{k.split('.', 1)[1] if '.' in k else k}={_short(flat[k])}" for k in own]
    return " ".join([str(cfg.get("algorithm", "?"))] + parts)


def _short(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def accuracy_curve(hist: list[dict], key: str = "mean_accuracy") -> tuple[np.ndarray, np.ndarray]:
    """(rounds, accuracy) of the evaluated rounds of one run; ``key``: a per-round scalar of metrics.jsonl."""
    evals = [h for h in hist if key in h]
    return np.array([h["round"] for h in evals]), np.array([h[key] for h in evals], float)


def seed_stats(hists: list[list[dict]], key: str = "mean_accuracy", tail: int = 5) -> dict:
    """Over seeds, in %: ``final``, ``best`` (best-mean) and ``tail`` (mean of the last ``tail`` evaluations),
    each (mean, std) (population std: 0 for one seed); ``seeds``; ``rounds`` (the last evaluated round);
    ``clients`` [(mean, std)] of each client's final accuracy (when the runs record per-client accuracy)."""
    curves = [accuracy_curve(h, key)[1] for h in hists]
    if any(len(c) == 0 for c in curves):
        raise ConfigError(f"a run has no evaluated round with {key!r}")
    ms = lambda xs: (float(np.mean(xs)), float(np.std(xs)))
    per_client = [np.asarray([h for h in hist if "test_accuracy" in h][-1]["test_accuracy"], float) * 100
                  for hist in hists if any("test_accuracy" in h for h in hist)]
    same = per_client and len({len(c) for c in per_client}) == 1 and len(per_client) == len(hists)
    clients = [ms(col) for col in np.stack(per_client).T] if same else []
    return {"final": ms([c[-1] * 100 for c in curves]), "best": ms([c.max() * 100 for c in curves]),
            "tail": ms([c[-tail:].mean() * 100 for c in curves]), "seeds": len(hists),
            "rounds": int(accuracy_curve(hists[0], key)[0][-1]), "clients": clients}


def compare_rows(results: dict[str, list[list[dict]]], key: str = "mean_accuracy", tail: int = 5) -> list[dict]:
    """One flat row per group (CSV columns): label, seeds, rounds, ``dp_epsilon`` (DP runs: the epsilon their
    last round had spent), and mean/std of final, best-mean, last-k (%), then ``client<j>_final_mean``/``_std``
    when the runs record per-client accuracy."""
    rows = []
    for label, hists in results.items():
        st = seed_stats(hists, key, tail)
        row = {"method": label, "seeds": st["seeds"], "rounds": st["rounds"]}
        spent = [[r["dp_epsilon"] for r in hist if "dp_epsilon" in r] for hist in hists]
        if all(spent):  # DP runs: the epsilon spent by the last round (the same for every seed)
            row["dp_epsilon"] = max(s[-1] for s in spent)
        for name, col in (("final", "final"), ("best_mean", "best"), (f"last{tail}", "tail")):
            row[f"{name}_mean"], row[f"{name}_std"] = st[col]
        for j, (m, s) in enumerate(st["clients"]):
            row[f"client{j}_final_mean"], row[f"client{j}_final_std"] = m, s
        rows.append(row)
    return rows


def seed_table(results: dict[str, list[list[dict]]], key: str = "mean_accuracy", tail: int = 5,
               paper: dict | None = None, paper_label: str = "paper", per_client: bool = False,
               client_names: list[str] | None = None) -> str:
    """Markdown: per group, final, best-mean and last-``tail`` accuracy, mean ± std over seeds (%);
    ``per_client``: each client's final accuracy too; ``paper``: a last column, by label or algorithm name."""
    rows = compare_rows(results, key, tail)
    n_clients = max((sum(1 for k in r if k.endswith("_final_mean") and k.startswith("client")) for r in rows),
                    default=0) if per_client else 0
    names = client_names or [f"client {j}" for j in range(n_clients)]
    dp = any("dp_epsilon" in r for r in rows)  # DP runs among them: a column of the epsilon each spent
    head = (["method", "seeds", "rounds"] + (["DP ε spent"] if dp else [])
            + ["final % (mean ± std)", "best-mean % (mean ± std)", f"mean of the last {tail} evaluations % (mean ± std)"]
            + names[:n_clients] + ([paper_label] if paper is not None else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["seeds"]), str(r["rounds"])]
        cells += [f"{r['dp_epsilon']:.3g}" if "dp_epsilon" in r else "-"] if dp else []
        cells += [f"{r['final_mean']:.2f} ± {r['final_std']:.2f}", f"{r['best_mean_mean']:.2f} ± {r['best_mean_std']:.2f}",
                  f"{r[f'last{tail}_mean']:.2f} ± {r[f'last{tail}_std']:.2f}"]
        cells += [f"{r[f'client{j}_final_mean']:.2f} ± {r[f'client{j}_final_std']:.2f}"
                  if f"client{j}_final_mean" in r else "-" for j in range(n_clients)]
        if paper is not None:
            cells.append(str(paper.get(r["method"], paper.get(r["method"].split(":")[0].split(" ")[0], "-"))))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    """CSV text of ``compare_rows`` (the union of their columns, in first-seen order)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, cols, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def plot_mean_accuracy(results: dict[str, list[list[dict]]], path: Path, title: str, highlight: str = "",
                       key: str = "mean_accuracy") -> None:
    """PNG: per group, the accuracy ``key`` per evaluated round, averaged over its seeds, with a band of
    ± one std over seeds (no band for one seed); ``highlight``: an algorithm drawn thicker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    crowded = len(results) > 6  # then the legend goes beside the axes, and past 10 lines the styles alternate
    fig, ax = plt.subplots(figsize=(8.5 if crowded else 6, 4))
    for i, (label, hists) in enumerate(results.items()):
        curves = [accuracy_curve(h, key) for h in hists]
        n = min(len(c[0]) for c in curves)  # seeds evaluate the same rounds; guard against a short run
        rounds, acc = curves[0][0][:n], np.stack([c[1][:n] for c in curves]) * 100
        mean, std = acc.mean(0), acc.std(0)
        name = label.split(":")[0].split(" ")[0]
        style = dict(color=plt.cm.tab10(i % 10), ls=("-", "--", ":")[i // 10 % 3]) if len(results) > 10 else {}
        line, = ax.plot(rounds, mean, marker="o", ms=3, label=label + (f" ({len(hists)} seeds)" if len(hists) > 1 else ""),
                        lw=2.5 if highlight and name == highlight else 1.2, **style)
        if len(hists) > 1:
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
    ax.set(xlabel="round", ylabel=key.replace("_", " ") + " over clients (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, **(dict(loc="center left", bbox_to_anchor=(1.01, 0.5)) if crowded else {}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def client_names(folder: Path) -> list[str] | None:
    """The client names a run's summary.json lists (None without one)."""
    try:
        return json.loads((Path(folder) / "summary.json").read_text()).get("clients")
    except (OSError, ValueError):
        return None


def compare(paths, key: str = "mean_accuracy", tail: int = 5, per_client: bool = False) -> tuple[dict, str, str]:
    """(results, markdown, csv) of the runs under ``paths``, grouped by seed (``group_by_seed``)."""
    if key not in KEYS:
        raise ConfigError(f"unknown --key {key!r}; valid: {', '.join(KEYS)}")
    if tail < 1:
        raise ConfigError(f"--last-k {tail} must be at least 1")
    folders = find_runs(paths)
    results = group_by_seed([(folder, *load_run(folder)) for folder in folders])
    names = next((n for n in map(client_names, folders) if n), None) if per_client else None
    return results, seed_table(results, key, tail, per_client=per_client, client_names=names), \
        to_csv(compare_rows(results, key, tail))
