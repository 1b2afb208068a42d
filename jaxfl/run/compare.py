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

from ..core.metrics import client_spread
from ..errors import ConfigError

# config fields that say how or where a run was executed, not what it computed
EXECUTION_FIELDS = {"seed", "out", "resume", "overwrite", "data_dir", "strategy", "backend", "chunk_size",
                    "lane_segments", "lane_overhead", "devices", "client_store", "eval_batch_size", "rounds_per_call",
                    "checkpoint_every", "eval_tail_batches"}
# the per-round accuracies compare reads: the evaluated model's, and under --eval-model both / --new-clients the
# global model's (global_), the held-out clients' with the global model (new_) and after a local update (new_tuned_)
KEYS = tuple(prefix + k for prefix in ("", "global_", "new_", "new_tuned_")
             for k in ("mean_accuracy", "weighted_accuracy"))


def client_field(key: str) -> str:
    """The per-client list of metrics.jsonl behind a per-round accuracy ``key`` (new_mean_accuracy ->
    new_test_accuracy)."""
    return key.rsplit("mean_accuracy" if key.endswith("mean_accuracy") else "weighted_accuracy", 1)[0] + \
        "test_accuracy"


# a run's log: as the run writes it, or gzipped (committed logs, ``tools/compact_logs.py``)
METRICS_FILES = ("metrics.jsonl", "metrics.jsonl.gz")


def metrics_file(folder: Path) -> Path | None:
    """The run log of ``folder`` (``METRICS_FILES``, the plain one first), or None."""
    return next((Path(folder) / n for n in METRICS_FILES if (Path(folder) / n).is_file()), None)


def find_runs(paths) -> list[Path]:
    """Run folders under ``paths``: a folder with metrics.jsonl (or metrics.jsonl.gz) is a run, any other folder
    is searched recursively. ConfigError (one line) for a path that does not exist or holds no run."""
    runs = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ConfigError(f"{str(p)!r} is not a folder; give jaxfl run folders (holding metrics.jsonl)")
        found = [p] if metrics_file(p) else sorted({m.parent for n in METRICS_FILES for m in p.rglob(n)})
        if not found:
            raise ConfigError(f"{str(p)!r} holds no run (no metrics.jsonl in it or below it)")
        seen = {r.resolve() for r in runs}
        runs += [r for r in found if r.resolve() not in seen]
    return runs


def load_run(folder: Path) -> tuple[dict, list[dict]]:
    """(config, history) of a run folder; a torn last line of metrics.jsonl is dropped."""
    from .checkpoint import read_metrics
    cfg_path = Path(folder) / "config.json"
    log = metrics_file(folder)
    if log is None:
        raise ConfigError(f"{str(folder)!r} holds no run (no metrics.jsonl)")
    try:
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{str(cfg_path)!r} is not valid JSON ({e})") from None
    return config, read_metrics(log)


def group_by_seed(runs: list[tuple[Path, dict, list[dict]]]) -> dict[str, list[list[dict]]]:
    """{label: [history per seed]} (``group_runs``' groups, their histories)."""
    return {label: [hist for _, _, hist in members] for label, members in group_runs(runs).items()}


def group_runs(runs: list[tuple[Path, dict, list[dict]]]) -> dict[str, list[tuple[Path, dict, list[dict]]]]:
    """{label: [(folder, config, history) per seed]}: runs whose configs agree outside ``EXECUTION_FIELDS``
    share a group; the label is the algorithm and the fields in which the groups differ (``fedtp
    variant=vanilla``), or the folder name when configs are missing. A seed that comes again in a group (the
    same run executed another way) starts a group of its own, labelled by the execution fields it differs in:
    a group's runs are distinct seeds."""
    def identity(cfg):
        return json.dumps({k: v for k, v in cfg.items() if k not in EXECUTION_FIELDS}, sort_keys=True)
    groups: dict[str, list] = {}
    for folder, cfg, hist in runs:
        groups.setdefault(identity(cfg) if cfg else str(folder), []).append((folder, cfg, hist))
    split = []  # (members, execution suffix)
    for members in groups.values():
        parts: list[list] = []
        for run in members:
            seed = run[1].get("seed")
            part = next((p for p in parts if seed is None or all(r[1].get("seed") != seed for r in p)), None)
            if part is None:
                parts.append([run])
            else:
                part.append(run)
        split += [(part, _execution_suffix(part[0][1], parts[0][0][1]) if i else "") for i, part in enumerate(parts)]
    configs = [members[0][1] for members, _ in split]
    labels = _labels([m for m, _ in split], _differing(configs))
    if len(set(labels)) < len(labels):  # then a field only some configs have is what tells groups apart
        labels = _labels([m for m, _ in split], _differing(configs, count_missing=True))
    out = {}
    for label, (members, suffix) in zip(labels, split):
        label += suffix
        while label in out:  # distinct groups never share a label
            label += "'"
        out[label] = members
    return out


def _execution_suffix(cfg: dict, first: dict) -> str:
    """`` backend=ragged ...``: the execution fields in which ``cfg`` differs from ``first`` (where and how a
    run was executed, less its seed and folder), or `` (again)``."""
    fields = sorted(EXECUTION_FIELDS - {"seed", "out", "resume", "overwrite", "data_dir"})
    differ = [f"{k}={_short(cfg.get(k))}" for k in fields if cfg.get(k) != first.get(k)]
    return " " + " ".join(differ) if differ else " (again)"


def _labels(groups: list[list], differing: list[str]) -> list[str]:
    """Each group's label by ``differing`` (its first run's folder name when it has no config)."""
    return [_label(members[0][1], differing) if members[0][1] else members[0][0].name for members in groups]


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


def aligned_curves(hists: list[list[dict]], key: str = "mean_accuracy") -> tuple[np.ndarray, np.ndarray]:
    """(rounds [R], accuracy [S, R]): the rounds every one of the S runs evaluated (a run stopped early, or
    resumed with another ``eval_every``, evaluated others), and each run's accuracy ``key`` at them.
    ConfigError if they share none."""
    if not hists:
        raise ConfigError("no runs to compare")
    curves = [accuracy_curve(h, key) for h in hists]
    common = sorted(set.intersection(*(set(r.tolist()) for r, _ in curves)))
    if not common:
        raise ConfigError(f"runs of one group share no evaluated round with {key!r}")
    at = [dict(zip(r.tolist(), a)) for r, a in curves]
    return np.array(common), np.array([[c[r] for r in common] for c in at], float)


def seed_stats(hists: list[list[dict]], key: str = "mean_accuracy", tail: int = 5) -> dict:
    """Over seeds, in %, at the rounds every seed evaluated (``aligned_curves``): ``final`` (the last of them),
    ``best`` (best-mean) and ``tail`` (mean of the last ``tail``), each (mean, std) (population std: 0 for one
    seed); ``seeds``; ``rounds`` (that last round); ``clients`` [(mean, std)] of each client's accuracy then
    (when the runs record per-client accuracy)."""
    if not hists:
        raise ConfigError("no runs to compare")
    if any(len(accuracy_curve(h, key)[0]) == 0 for h in hists):
        raise ConfigError(f"a run has no evaluated round with {key!r}")
    rounds, acc = aligned_curves(hists, key)
    acc = acc * 100
    ms = lambda xs: (float(np.mean(xs)), float(np.std(xs)))
    last = int(rounds[-1])
    field = client_field(key)
    per_client = [np.asarray([np.nan if a is None else a for a in rec[field]], float) * 100 for hist in hists
                  for rec in hist if rec.get("round") == last and field in rec]
    same = per_client and len({len(c) for c in per_client}) == 1 and len(per_client) == len(hists)
    clients = [ms(col) for col in np.stack(per_client).T] if same else []
    # how the final accuracy spreads over each run's clients (``core.metrics.client_spread``), over seeds
    spreads = [client_spread(c) for c in per_client] if len(per_client) == len(hists) else []
    spread = {k: ms([sp[k] for sp in spreads]) for k in ("p10", "worst10_mean")} if spreads else {}
    return {"final": ms(acc[:, -1]), "best": ms(acc.max(1)), "tail": ms(acc[:, -tail:].mean(1)),
            "seeds": len(hists), "rounds": last, "clients": clients, "spread": spread}


def compare_rows(results: dict[str, list[list[dict]]], key: str = "mean_accuracy", tail: int = 5) -> list[dict]:
    """One flat row per group (CSV columns): label, seeds, rounds, ``dp_epsilon`` (DP runs: the epsilon their
    last round had spent), and mean/std of final, best-mean, last-k (%), then, when the runs record per-client
    accuracy, ``p10_final`` and ``worst10_final`` (the 10th percentile and the worst 10% of clients' mean of the
    final accuracies) and ``client<j>_final_mean``/``_std``."""
    rows = []
    for label, hists in results.items():
        st = seed_stats(hists, key, tail)
        row = {"method": label, "seeds": st["seeds"], "rounds": st["rounds"]}
        spent = [[r["dp_epsilon"] for r in hist if "dp_epsilon" in r] for hist in hists]
        if all(spent):  # DP runs: the epsilon spent by the last round (the same for every seed)
            row["dp_epsilon"] = max(s[-1] for s in spent)
        for name, col in (("final", "final"), ("best_mean", "best"), (f"last{tail}", "tail")):
            row[f"{name}_mean"], row[f"{name}_std"] = st[col]
        for name, col in (("p10_final", "p10"), ("worst10_final", "worst10_mean")):
            if col in st["spread"]:
                row[f"{name}_mean"], row[f"{name}_std"] = st["spread"][col]
        for j, (m, s) in enumerate(st["clients"]):
            row[f"client{j}_final_mean"], row[f"client{j}_final_std"] = m, s
        rows.append(row)
    return rows


def seed_table(results: dict[str, list[list[dict]]], key: str = "mean_accuracy", tail: int = 5,
               paper: dict | None = None, paper_label: str = "paper", per_client: bool = False,
               client_names: list[str] | dict | None = None, spread: bool = False) -> str:
    """Markdown: per group, final, best-mean and last-``tail`` accuracy, mean ± std over seeds (%);
    ``spread``: the final accuracy's 10th percentile over clients and the worst 10% of clients' mean too;
    ``per_client``: each client's final accuracy too (``client_names``: one list, or {label: list or None}):
    as columns when every group has the same clients, else as a second table (method, client, final);
    ``paper``: a last column, by label or algorithm name."""
    rows = compare_rows(results, key, tail)
    counts = [sum(1 for k in r if k.endswith("_final_mean") and k.startswith("client")) for r in rows]
    by_group = (client_names if isinstance(client_names, dict) else {r["method"]: client_names for r in rows})
    named = [by_group.get(r["method"]) or [f"client {j}" for j in range(c)] for r, c in zip(rows, counts)]
    shared = per_client and all(n == named[0] and c == counts[0] for n, c in zip(named, counts))
    n_clients = counts[0] if shared and rows else 0
    names = named[0] if n_clients else []
    dp = any("dp_epsilon" in r for r in rows)  # DP runs among them: a column of the epsilon each spent
    head = (["method", "seeds", "rounds"] + (["DP ε spent"] if dp else [])
            + ["final % (mean ± std)", "best-mean % (mean ± std)",
               f"mean of the last {tail} evaluations % (mean ± std)"]
            + (["final, 10th percentile of clients %", "final, worst 10% of clients %"] if spread else [])
            + names[:n_clients] + ([paper_label] if paper is not None else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["seeds"]), str(r["rounds"])]
        cells += [f"{r['dp_epsilon']:.3g}" if "dp_epsilon" in r else "-"] if dp else []
        cells += [f"{r['final_mean']:.2f} ± {r['final_std']:.2f}",
                  f"{r['best_mean_mean']:.2f} ± {r['best_mean_std']:.2f}",
                  f"{r[f'last{tail}_mean']:.2f} ± {r[f'last{tail}_std']:.2f}"]
        if spread:
            cells += [f"{r[f'{c}_mean']:.2f} ± {r[f'{c}_std']:.2f}" if f"{c}_mean" in r else "-"
                      for c in ("p10_final", "worst10_final")]
        cells += [f"{r[f'client{j}_final_mean']:.2f} ± {r[f'client{j}_final_std']:.2f}"
                  if f"client{j}_final_mean" in r else "-" for j in range(n_clients)]
        if paper is not None:
            cells.append(str(paper.get(r["method"], paper.get(r["method"].split(":")[0].split(" ")[0], "-"))))
        lines.append("| " + " | ".join(cells) + " |")
    if per_client and not shared:  # groups of different clients: a row per (group, client)
        lines += ["", "| method | client | final % (mean ± std) |", "|---|---|---|"]
        for r, group_names, count in zip(rows, named, counts):
            lines += [f"| {r['method']} | {name} | {r[f'client{j}_final_mean']:.2f} ± {r[f'client{j}_final_std']:.2f} |"
                      for j, name in enumerate(group_names[:count])]
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
        rounds, acc = aligned_curves(hists, key)  # the rounds every seed evaluated
        acc = acc * 100
        mean, std = acc.mean(0), acc.std(0)
        name = label.split(":")[0].split(" ")[0]
        style = dict(color=plt.cm.tab10(i % 10), ls=("-", "--", ":")[i // 10 % 3]) if len(results) > 10 else {}
        seeds = f" ({len(hists)} seeds)" if len(hists) > 1 else ""
        line, = ax.plot(rounds, mean, marker="o", ms=3, label=label + seeds,
                        lw=2.5 if highlight and name == highlight else 1.2, **style)
        if len(hists) > 1:
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
    ax.set(xlabel="round", ylabel=key.replace("_", " ") + " over clients (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, **(dict(loc="center left", bbox_to_anchor=(1.01, 0.5)) if crowded else {}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def client_names(folder: Path, key: str = "mean_accuracy") -> list[str] | None:
    """The names of the clients behind ``key`` that a run's summary.json lists: the held-out clients
    (``new_clients``) for a ``new_`` key, else the training clients (None without a summary)."""
    try:
        summary = json.loads((Path(folder) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary.get("new_clients" if key.startswith("new_") else "clients")


def check_key_and_tail(key: str, tail: int) -> None:
    """ConfigError (one line) for an unknown ``--key`` or a ``--last-k`` below 1."""
    if key not in KEYS:
        raise ConfigError(f"unknown --key {key!r}; valid: {', '.join(KEYS)}")
    if tail < 1:
        raise ConfigError(f"--last-k {tail} must be at least 1")


def compare(paths, key: str = "mean_accuracy", tail: int = 5, per_client: bool = False,
            notes: list | None = None, spread: bool = False) -> tuple[dict, str, str]:
    """(results, markdown, csv) of the runs under ``paths``, grouped by seed (``group_runs``). ``notes`` (a
    list) receives a line for each group whose runs evaluated different last rounds (it is compared at the
    last round all of them evaluated)."""
    check_key_and_tail(key, tail)
    runs = []
    for folder in find_runs(paths):
        cfg, hist = load_run(folder)
        if not any(key in h for h in hist):
            raise ConfigError(f"{str(folder)!r} has no evaluated round with {key!r} (its metrics.jsonl is empty or "
                              f"the run has not evaluated yet); leave it out")
        runs.append((folder, cfg, hist))
    grouped = group_runs(runs)
    results = {label: [hist for _, _, hist in members] for label, members in grouped.items()}
    for label, members in grouped.items():
        last = {folder: int(accuracy_curve(hist, key)[0][-1]) for folder, _, hist in members}
        if len(set(last.values())) > 1 and notes is not None:
            at = int(aligned_curves(results[label], key)[0][-1])
            short = ", ".join(f"{str(f)!r} at round {r}" for f, r in last.items() if r != max(last.values()))
            notes.append(f"{label}: its runs end at different rounds ({short}, the others at {max(last.values())}); "
                         f"compared at round {at}, the last all of them evaluated")
    names = None
    if per_client:  # each group's client names (its first run's summary.json); one header if they agree
        names = {label: next((n for n in (client_names(f, key) for f, _, _ in members) if n), None)
                 for label, members in grouped.items()}
    return results, seed_table(results, key, tail, per_client=per_client, client_names=names, spread=spread), \
        to_csv(compare_rows(results, key, tail))


# ---- paired equivalence: the same seeds run two ways (official code against jaxfl, two versions, two options)

def run_seed(folder: Path, cfg: dict) -> int | None:
    """A run's seed: its config's ``seed``, else the number of the nearest ``seed<S>`` folder on its path."""
    if isinstance(cfg.get("seed"), int):
        return cfg["seed"]
    import re
    for part in reversed(Path(folder).parts):
        found = re.fullmatch(r"seed(\d+)", part)
        if found:
            return int(found.group(1))
    return None


def runs_by_seed(path: str) -> dict[int, tuple[Path, list[dict]]]:
    """{seed: (folder, history)} of the runs under ``path`` (a folder searched as ``find_runs`` does, or a glob
    pattern such as ``logs/seed*/fedtp``); ConfigError unless each run has a seed and each seed one run."""
    import glob
    paths = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
    if not paths:
        raise ConfigError(f"{path!r} matches no folder")
    out: dict[int, tuple[Path, list[dict]]] = {}
    for folder in find_runs(paths):
        cfg, hist = load_run(folder)
        seed = run_seed(folder, cfg)
        if seed is None:
            raise ConfigError(f"{str(folder)!r} has no seed (none in its config.json, no seed<S> folder on its path)")
        if seed in out:
            raise ConfigError(f"{path!r} holds two runs of seed {seed} ({str(out[seed][0])!r}, {str(folder)!r}): give "
                              f"the runs of one method, e.g. a pattern such as '{path}/seed*/NAME' (quoted)")
        out[seed] = (folder, hist)
    return out


def t_interval(diffs, level: float = 0.9) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided ``level`` Student-t confidence interval of the mean of ``diffs``
    (n >= 2): mean -+ t_{(1+level)/2, n-1} * s / sqrt(n), s the sample std (ddof 1). A 90% interval inside
    (-m, m) is the two one-sided tests (TOST) at 5% for equivalence within margin m."""
    from scipy import stats
    d = np.asarray(diffs, float)
    n, mean = len(d), float(np.mean(d))
    if n < 2:
        raise ConfigError(f"a confidence interval needs at least 2 paired seeds, got {n}")
    half = float(stats.t.ppf((1 + level) / 2, n - 1) * np.std(d, ddof=1) / np.sqrt(n))
    return mean, mean - half, mean + half


def equivalence_verdict(low: float, high: float, margin: float) -> str:
    """``equivalent`` when the interval lies inside (-margin, margin), ``different`` when it lies wholly
    outside [-margin, margin], else ``inconclusive`` (more seeds, or a longer window, would decide)."""
    if -margin < low and high < margin:
        return "equivalent"
    if low > margin or high < -margin:
        return "different"
    return "inconclusive"


def paired_equivalence(a: dict[int, list[dict]], b: dict[int, list[dict]], key: str = "mean_accuracy",
                       tail: int = 5, margin: float = 1.5, level: float = 0.9) -> dict:
    """The paired test of two sides run on the same seeds (``a``, ``b``: {seed: history}). Per seed, at the
    rounds both of its runs evaluated, d_s = (last-``tail``-evaluation mean of a) - (that of b), in points
    (accuracy x 100); over the seeds both sides have: the mean of d, its ``t_interval`` and the
    ``equivalence_verdict`` against ``margin`` (points, stated before looking at the runs); and the per-round
    curve of differences at the rounds every pair evaluated. -> {"seeds", "a", "b", "diff" (per seed), "mean",
    "low", "high", "verdict", "margin", "level", "tail", "rounds", "curve" [S, R], "only_a", "only_b"}"""
    check_key_and_tail(key, tail)
    if not (margin > 0 and np.isfinite(margin)) or not 0 < level < 1:
        raise ConfigError(f"--margin {margin:g} must be a positive number of points and --level {level:g} in (0, 1)")
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ConfigError(f"no seed was run on both sides (seeds {sorted(a)} and {sorted(b)})")
    per_a, per_b, curves = [], [], []
    for s in seeds:
        rounds, acc = aligned_curves([a[s], b[s]], key)
        acc = acc * 100
        per_a.append(float(acc[0, -tail:].mean()))
        per_b.append(float(acc[1, -tail:].mean()))
        curves.append(dict(zip(rounds.tolist(), (acc[0] - acc[1]).tolist())))
    diff = [x - y for x, y in zip(per_a, per_b)]
    mean, low, high = t_interval(diff, level) if len(diff) >= 2 else (float(np.mean(diff)) if diff else float("nan"),
                                                                       float("-inf"), float("inf"))
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return {"seeds": seeds, "a": per_a, "b": per_b, "diff": diff, "mean": mean, "low": low, "high": high,
            "verdict": equivalence_verdict(low, high, margin), "margin": margin, "level": level, "tail": tail,
            "rounds": common, "curve": np.array([[c[r] for r in common] for c in curves]).reshape(len(seeds), -1),
            "only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a))}


def paired_table(result: dict, label_a: str = "A", label_b: str = "B") -> str:
    """Markdown: a row per seed (each side's last-k mean and the difference), then the mean difference, its
    interval and the verdict."""
    k = result["tail"]
    lines = [f"A: {label_a}; B: {label_b}; per seed, the mean of the last {k} evaluations at the rounds both "
             f"evaluated", "", "| seed | A % | B % | A - B (points) |", "|---|---|---|---|"]
    lines += [f"| {s} | {x:.2f} | {y:.2f} | {d:+.2f} |"
              for s, x, y, d in zip(result["seeds"], result["a"], result["b"], result["diff"])]
    lines.append(f"| **mean over {len(result['seeds'])} seeds** | {np.mean(result['a']):.2f} | "
                 f"{np.mean(result['b']):.2f} | **{result['mean']:+.2f}** |")
    lines += ["", f"A - B: {result['mean']:+.2f} points, {result['level']:.0%} t-interval "
              f"[{result['low']:+.2f}, {result['high']:+.2f}] over {len(result['seeds'])} paired seeds; margin "
              f"±{result['margin']:g}: **{result['verdict']}**"]
    for side, only in (("A", result["only_a"]), ("B", result["only_b"])):
        if only:
            lines.append(f"(seeds only in {side}, left out: {', '.join(map(str, only))})")
    return "\n".join(lines)


def plot_paired_curve(result: dict, path: Path, title: str, label_a: str = "A", label_b: str = "B") -> None:
    """PNG: the mean over seeds of the per-round difference A - B (points), with its t-interval band, the
    margin and zero."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rounds, curve = np.asarray(result["rounds"]), np.asarray(result["curve"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    mean = curve.mean(0)
    ax.plot(rounds, mean, marker="o", ms=3, color="C0", label=f"{label_a} - {label_b} ({len(curve)} seeds)")
    if len(curve) >= 2:
        bands = np.array([t_interval(col, result["level"])[1:] for col in curve.T])
        ax.fill_between(rounds, bands[:, 0], bands[:, 1], color="C0", alpha=0.2, lw=0,
                        label=f"{result['level']:.0%} t-interval")
    for m in (-result["margin"], result["margin"]):
        ax.axhline(m, color="C3", ls="--", lw=1)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="round", ylabel="difference (points)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
