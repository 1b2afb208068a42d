"""The round-time model behind the automatic backend choice (``jaxfl/core/cost.py``) against every stacked/ragged
pair measured on a GPU: the small-model workloads of the GPU suite (``benchmarks/results/gpu_h200_2026-11-26``:
``stacked/vmap/K1`` and ``ragged/vmap`` rows; clients regenerated as ``throughput.lognormal_counts``) and the
MNIST workloads of ``benchmarks/backend_choice.py`` (``.../gpu_h200_2026-11-27/choice``; clients from the same
``jaxfl run`` split, read through ``JAXFL_DATA_DIR``). Host-side only: no GPU needed.

    python benchmarks/backend_model.py [--out DIR]    # prints the table (and writes backend_model.md)

Columns: measured and modelled round seconds of each backend, the faster one measured, and the model's pick
with the H200 rates and with the step cost tau set to 0 (FLOPs and transfers only). A second table holds each
pair out in turn: tau and P chosen from a grid on the other nine, then the held-out pair's pick.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SUITE = [RESULTS / "gpu_h200_2026-11-26" / "small", RESULTS / "gpu_h200_2026-11-26" / "rest"]
CHOICE = RESULTS / "gpu_h200_2026-11-27" / "choice"


def measured_pairs() -> list[dict]:
    """[{name, counts, cohort, batch, model, classes, sample_x, preprocess, stacked_s, ragged_s}] of every
    measured stacked/ragged pair."""
    from jaxfl.core.trainer import normalizer
    pairs = []
    for folder in SUITE:
        for r in json.loads((folder / "results.json").read_text())["results"]:
            if "stacked/vmap/K1" not in r or "ragged/vmap" not in r:
                continue
            w = throughput.SMALL[r["workload"]]
            image = w["input"] == "image"
            pairs.append(dict(
                name=f"{r['workload']} (lognormal, {r['clients']} clients)", cohort=r["cohort"], batch=w["batch"],
                counts=throughput.lognormal_counts(r["clients"], w["median"], w["sigma"]), model=w["model"],
                classes=w["classes"], preprocess=normalizer() if image else (lambda x: x),
                sample_x=np.zeros((1, 28, 28, 1), np.uint8) if image else np.zeros((1, throughput.SEQ_LEN), np.int32),
                stacked_s=r["stacked/vmap/K1"]["round_s"], ragged_s=r["ragged/vmap"]["round_s"]))
    import tempfile

    import backend_choice
    from jaxfl.data.federated import load_dataset
    from jaxfl.run.cli import command_config
    with tempfile.TemporaryDirectory() as tmp:  # (the configs name an output folder; nothing is written there)
        for part in sorted(CHOICE.glob("*.json")):
            run = json.loads(part.read_text())
            for r in run["rows"]:
                if "round_s" not in r.get("stacked", {}) or "round_s" not in r.get("ragged", {}):
                    continue
                argv = ["run", *backend_choice.COMMON.split(), *r["flags"].split(), "--out", f"{tmp}/run"]
                cfg = command_config(argv)  # the workload's config as `jaxfl run` reads it
                ds = load_dataset(cfg.data_config())
                pairs.append(dict(
                    name=f"{cfg.model} (MNIST Dirichlet {cfg.dirichlet_alpha}, {cfg.num_clients} clients)",
                    cohort=cfg.clients_per_round, batch=cfg.batch_size, counts=np.asarray(ds.train_counts()),
                    model=cfg.model, classes=ds.num_classes, sample_x=ds.train[0][0][:1],
                    preprocess=normalizer(*ds.normalize),
                    stacked_s=r["stacked"]["round_s"], ragged_s=r["ragged"]["round_s"], rounds=run["rounds"],
                    **{f"{b}_{k}": r[b][k] for b in ("stacked", "ragged") for k in ("compile_s", "wall_s")}))
    return pairs


def modelled(pair: dict, rates) -> tuple[float, float]:
    """(stacked, ragged) modelled round seconds of a measured pair (vmap, as measured: the ragged backend's
    buckets planned per cohort) at ``rates``."""
    from jaxfl.core import cost
    if "flops" not in pair:
        from jaxfl.models import build_model
        pair["flops"] = cost.train_flops_per_sample(build_model(pair["model"], pair["classes"]), pair["sample_x"],
                                                    pair["batch"], pair["preprocess"])
    b = pair["sample_x"][0].nbytes + 4  # the input and its int32 label
    return cost.backend_seconds(pair["counts"], pair["batch"], pair["cohort"], pair["flops"], b, clients="vmap",
                                rates=rates, per_cohort=True)


def bucket_programs(pair: dict, repeats: int = 50, seed: int = 0) -> float:
    """The bucket programs a ragged run of ``pair["rounds"]`` rounds compiled when the pairs were measured (its
    buckets planned per cohort, ``plan_buckets``: one program per (lanes, grid length) shape): the distinct
    shapes of that many drawn cohorts, averaged over ``repeats`` draws of the run's cohorts."""
    from jaxfl.core.buckets import plan_buckets
    steps = -(-pair["counts"] // pair["batch"])
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(repeats):
        shapes = set()
        for _ in range(pair["rounds"]):
            ids = rng.choice(len(steps), size=min(pair["cohort"], len(steps)), replace=False)
            shapes |= {(b.lanes, b.steps) for b in plan_buckets(steps[ids], max_lanes=pair["cohort"])}
        counts.append(len(shapes))
    return float(np.mean(counts))


def compile_fit(pairs: list[dict]) -> list[dict]:
    """Per pair with compile times (``backend_choice.py``'s runs): c = the ragged run's compile seconds less
    the stacked run's, over its extra programs (``bucket_programs`` less the stacked round's one; the
    evaluation's programs are the same in both); then the whole run's pick (``cost.run_seconds`` at the run's
    rounds and the programs each run compiled) against the faster whole run measured, with ``H200``'s c and
    with c fitted on the other pairs only; ``grid_programs``: the ragged backend's programs now
    (``cost.backend_programs``: its bucket grid's classes).
    [{name, cohort, rounds, programs, c, ...}]."""
    from jaxfl.core import cost
    rows = [p for p in pairs if "stacked_compile_s" in p]
    for p in rows:
        p["programs"] = bucket_programs(p)
        p["c"] = (p["ragged_compile_s"] - p["stacked_compile_s"]) / (p["programs"] - 1)
    out = []
    for k, p in enumerate(rows):
        s, r = modelled(p, cost.H200)
        steps = -(-p["counts"] // p["batch"])
        n_s, n_r = cost.backend_programs(steps, p["cohort"], "vmap")
        others = float(np.median([q["c"] for i, q in enumerate(rows) if i != k]))

        def pick(c):
            rates = dataclasses.replace(cost.H200, compile_s=c)
            whole = (cost.run_seconds(s, p["rounds"], n_s, rates),
                     cost.run_seconds(r, p["rounds"], p["programs"], rates))  # (the programs it compiled then)
            return "stacked" if whole[0] <= whole[1] else "ragged"
        out.append(dict(name=p["name"], cohort=p["cohort"], rounds=p["rounds"], programs=p["programs"], c=p["c"],
                        stacked_compile_s=p["stacked_compile_s"], ragged_compile_s=p["ragged_compile_s"],
                        measured_run="stacked" if p["stacked_wall_s"] <= p["ragged_wall_s"] else "ragged",
                        stacked_wall_s=p["stacked_wall_s"], ragged_wall_s=p["ragged_wall_s"],
                        round_pick="stacked" if s <= r else "ragged", run_pick=pick(cost.H200.compile_s),
                        held_out_c=others, held_out_pick=pick(others), grid_programs=n_r))
    return out


def compile_report(rows: list[dict]) -> str:
    from jaxfl.core import cost
    lines = ["| workload | cohort | rounds | compile s: stacked / ragged | ragged bucket programs (simulated) | "
             "c (s) | whole run s: stacked / ragged (measured) | model picks: per round / whole run (c = "
             f"{cost.H200.compile_s:g} s) / c of the other pairs |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['cohort']} | {r['rounds']} | {r['stacked_compile_s']:.1f} / "
                     f"{r['ragged_compile_s']:.1f} | {r['programs']:.1f} | {r['c']:.2f} | {r['stacked_wall_s']:.1f} / "
                     f"{r['ragged_wall_s']:.1f} ({r['measured_run']}) | {r['round_pick']} / {r['run_pick']} / "
                     f"{r['held_out_pick']} ({r['held_out_c']:.2f} s) |")
    right = sum(r["run_pick"] == r["measured_run"] for r in rows)
    held = sum(r["held_out_pick"] == r["measured_run"] for r in rows)
    per_round = sum(r["round_pick"] == r["measured_run"] for r in rows)
    grids = ", ".join(str(r["grid_programs"]) for r in rows)
    lines += ["", f"Whole runs: the faster one picked on {right} of {len(rows)} with c = {cost.H200.compile_s:g} s, "
                  f"{held} of {len(rows)} with c fitted on the other pairs, {per_round} of {len(rows)} by round time "
                  f"alone (the ragged backend's programs now: its grid's {grids})."]
    return "\n".join(lines) + "\n"


def faster(pair: dict) -> str:
    return "stacked" if pair["stacked_s"] <= pair["ragged_s"] else "ragged"


def evaluate(pair: dict) -> dict:
    from jaxfl.core import cost
    s, r = modelled(pair, cost.H200)
    s0, r0 = modelled(pair, dataclasses.replace(cost.H200, step_s=0.0))
    f, measured = pair["flops"], faster(pair)
    return dict(name=pair["name"], cohort=pair["cohort"], flops_per_sample=f, measured=measured,
                stacked_s=pair["stacked_s"], ragged_s=pair["ragged_s"], model_stacked_s=s, model_ragged_s=r,
                pick="stacked" if s <= r else "ragged", pick_without_tau="stacked" if s0 <= r0 else "ragged")


TAUS = (0.0, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3)  # the grid the held-out check chooses tau and P from
FLOPS = (5e12, 1e13, 2e13, 4e13)


def held_out(pairs: list[dict]) -> list[dict]:
    """Leave one pair out: choose (tau, P) on the others (most right picks, then the least squared log error
    of the modelled round times; W stays 2 GB/s, measured apart), then pick the held-out pair's backend.
    [{name, cohort, measured, pick, tau, flops_per_s}] per pair."""
    from jaxfl.core import cost
    grid = [dataclasses.replace(cost.H200, step_s=t, flops_per_s=p) for t in TAUS for p in FLOPS]
    times = [[modelled(pair, rates) for rates in grid] for pair in pairs]  # [pair][grid point] -> (s, r)

    def score(g, rows):
        right = sum((times[i][g][0] <= times[i][g][1]) == (faster(pairs[i]) == "stacked") for i in rows)
        err = sum(np.log(times[i][g][0] / pairs[i]["stacked_s"]) ** 2
                  + np.log(times[i][g][1] / pairs[i]["ragged_s"]) ** 2 for i in rows)
        return right, -err

    out = []
    for k, pair in enumerate(pairs):
        g = max(range(len(grid)), key=lambda g: score(g, [i for i in range(len(pairs)) if i != k]))
        s, r = times[k][g]
        out.append(dict(name=pair["name"], cohort=pair["cohort"], measured=faster(pair),
                        pick="stacked" if s <= r else "ragged", tau=grid[g].step_s, flops_per_s=grid[g].flops_per_s))
    return out


def held_out_report(rows: list[dict]) -> str:
    lines = ["| held-out workload | cohort | tau, P chosen on the other pairs | faster | model picks |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['cohort']} | {r['tau'] * 1e3:g} ms, {r['flops_per_s'] / 1e12:g} TFLOP/s | "
                     f"{r['measured']} | {r['pick']} |")
    right = sum(r["pick"] == r["measured"] for r in rows)
    lines += ["", f"Held out, the model picks the faster backend on {right} of {len(rows)} pairs."]
    return "\n".join(lines) + "\n"


def report(rows: list[dict]) -> str:
    lines = ["| workload | cohort | f (MFLOP/sample) | stacked s (model) | ragged s (model) | faster | model picks | "
             "picks with tau = 0 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['cohort']} | {r['flops_per_sample'] / 1e6:.2f} | {r['stacked_s']:.4f} "
                     f"({r['model_stacked_s']:.4f}) | {r['ragged_s']:.4f} ({r['model_ragged_s']:.4f}) | "
                     f"{r['measured']} | {r['pick']} | {r['pick_without_tau']} |")
    right = sum(r["pick"] == r["measured"] for r in rows)
    right0 = sum(r["pick_without_tau"] == r["measured"] for r in rows)
    lines += ["", f"Model's pick = the faster backend on {right} of {len(rows)} pairs ({right0} with tau = 0)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pairs = measured_pairs()
    text = (report([evaluate(pair) for pair in pairs]) + "\n" + held_out_report(held_out(pairs)) + "\n"
            + compile_report(compile_fit(pairs)))
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "backend_model.md").write_text(text)


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))
