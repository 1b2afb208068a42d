"""``jaxfl compare`` on real run folders: grouping by seed, the numbers, CSV/markdown/PNG, bad input."""
import csv
import io
import json

import numpy as np
import pytest

from jaxfl.run.cli import main
from jaxfl.run.config import RunConfig
from jaxfl.run.runner import Experiment

TINY = dict(dataset="default", model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30,
            batch_size=16, eval_batch_size=32, lr=0.05, rounds=3)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Three real runs: fedavg with seeds 0 and 1, fedprox (mu 0.1) with seed 0, under one folder."""
    root = tmp_path_factory.mktemp("sweep")
    runs = {}
    for name, seed, extra in (("fedavg", 0, {}), ("fedavg", 1, {}), ("fedprox", 0, {"fedprox": {"mu": 0.1}})):
        out = root / f"seed{seed}" / name
        runs[(name, seed)] = Experiment(RunConfig.from_dict(dict(TINY, algorithm=name, seed=seed, out=str(out),
                                                                 **extra))).run()
    return root, runs


def test_compare_groups_seeds_and_reports_final_best_and_last_k(sweep, tmp_path, capsys):
    root, runs = sweep
    md, csv_path, png = tmp_path / "t.md", tmp_path / "t.csv", tmp_path / "t.png"
    assert main(["compare", str(root), "--last-k", "2", "--md", str(md), "--csv", str(csv_path),
                 "--plot", str(png), "--per-client"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == md.read_text().strip()
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO(csv_path.read_text()))}
    assert sorted(rows) == ["fedavg", "fedprox"]  # runs differing only by seed form one group
    curves = [np.array([h["mean_accuracy"] for h in runs[("fedavg", s)].history]) * 100 for s in (0, 1)]
    fedavg = rows["fedavg"]
    assert int(fedavg["seeds"]) == 2 and int(fedavg["rounds"]) == 3
    np.testing.assert_allclose(float(fedavg["final_mean"]), np.mean([c[-1] for c in curves]), rtol=1e-9)
    np.testing.assert_allclose(float(fedavg["final_std"]), np.std([c[-1] for c in curves]), rtol=1e-9)
    np.testing.assert_allclose(float(fedavg["best_mean_mean"]), np.mean([c.max() for c in curves]), rtol=1e-9)
    np.testing.assert_allclose(float(fedavg["last2_mean"]), np.mean([c[-2:].mean() for c in curves]), rtol=1e-9)
    last = [np.array(runs[("fedavg", s)].history[-1]["test_accuracy"]) * 100 for s in (0, 1)]
    np.testing.assert_allclose(float(fedavg["client1_final_mean"]), np.mean([a[1] for a in last]), rtol=1e-9)
    assert float(rows["fedprox"]["final_std"]) == 0.0
    # the spread over clients: each seed's 10th percentile and worst-10% mean of the final accuracies
    from jaxfl.core.metrics import client_spread
    np.testing.assert_allclose(float(fedavg["worst10_final_mean"]),
                               np.mean([client_spread(a)["worst10_mean"] for a in last]), rtol=1e-9)
    np.testing.assert_allclose(float(fedavg["p10_final_std"]), np.std([np.percentile(a, 10) for a in last]),
                               rtol=1e-9, atol=1e-12)
    assert main(["compare", str(root), "--spread"]) == 0
    assert "worst 10% of clients" in capsys.readouterr().out.splitlines()[0]
    header = printed.splitlines()[0]
    names = json.loads((root / "seed0" / "fedavg" / "summary.json").read_text())["clients"]
    assert all(n in header for n in names)  # per-client columns carry the clients' names
    assert png.stat().st_size > 1000


def test_compare_refuses_bad_input_in_one_line(sweep, tmp_path, capsys):
    root, _ = sweep
    (tmp_path / "empty").mkdir()
    cases = [([str(tmp_path / "nope")], f"jaxfl: error: {str(tmp_path / 'nope')!r} is not a folder"),
             ([str(tmp_path / "empty")], f"jaxfl: error: {str(tmp_path / 'empty')!r} holds no run"),
             ([str(root), "--key", "accuracy"], "jaxfl: error: unknown --key 'accuracy'; valid: mean_accuracy"),
             ([str(root), "--last-k", "0"], "jaxfl: error: --last-k 0 must be at least 1"),
             ([str(root), "--csv", str(tmp_path / "no" / "t.csv")], "jaxfl: error: --csv ")]
    for args, message in cases:
        assert main(["compare", *args]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err
        assert captured.out == ""
    assert not (tmp_path / "no").exists()


def test_the_library_functions_refuse_an_empty_input_clearly(tmp_path):
    from jaxfl.errors import ConfigError
    from jaxfl.run.compare import aligned_curves, load_run, seed_stats
    for fn, arg, message in ((seed_stats, [], "no runs to compare"), (aligned_curves, [], "no runs to compare"),
                             (load_run, tmp_path / "nope", "holds no run \\(no metrics.jsonl\\)")):
        with pytest.raises(ConfigError, match=message):
            fn(arg)


def test_groups_are_labelled_by_what_differs_among_them():
    from pathlib import Path
    from jaxfl.run.compare import group_by_seed
    base = {"algorithm": "fedprox", "lr": 0.05, "out": "a", "seed": 0, "fedprox": {"mu": 0.1, "local_bn": False}}
    runs = [(Path("a"), base, ["h0"]), (Path("b"), dict(base, seed=1, out="b", strategy="vmap"), ["h1"]),
            (Path("c"), dict(base, fedprox={"mu": 0.01, "local_bn": False}), ["h2"]),
            (Path("d"), dict(base, lr=0.1), ["h3"]),
            (Path("e"), {"algorithm": "fedavg", "lr": 0.05, "fedavg": {}}, ["h4"])]
    groups = group_by_seed(runs)
    # seed, out and strategy say how a run was executed: a and b are one group; fedavg has no mu to differ in
    assert groups == {"fedprox mu=0.1 lr=0.05": [["h0"], ["h1"]], "fedprox mu=0.01 lr=0.05": [["h2"]],
                      "fedprox mu=0.1 lr=0.1": [["h3"]], "fedavg lr=0.05": [["h4"]]}


def test_runs_of_other_codes_are_labelled_by_the_fields_both_sides_have():
    """An official code's run (its own config fields) beside jaxfl's: fields only one side has do not label the
    groups (else every jaxfl field would), fields both have and that differ do; when only a field some configs
    lack tells two groups apart, it labels them."""
    from pathlib import Path
    from jaxfl.run.compare import group_by_seed
    official = {"official": "a/b", "algorithm": "FedX", "lr": 0.01, "seed": 0, "arguments": {"ld": 1}}
    jaxfl = {"algorithm": "fedx", "lr": 0.01, "seed": 0, "batch_size": 10, "model": "mlp_2nn", "fedx": {"lam": 1.0}}
    runs = [(Path("o0"), official, ["o0"]), (Path("o1"), dict(official, seed=1), ["o1"]),
            (Path("j0"), jaxfl, ["j0"]), (Path("j1"), dict(jaxfl, lr=0.05), ["j1"])]
    assert group_by_seed(runs) == {"FedX lr=0.01": [["o0"], ["o1"]], "fedx lr=0.01": [["j0"]],
                                   "fedx lr=0.05": [["j1"]]}
    older = dict(jaxfl)
    del older["model"]  # e.g. a config written before a field existed
    assert group_by_seed([(Path("j0"), jaxfl, ["j0"]), (Path("k0"), older, ["k0"])]) == {
        "fedx model=mlp_2nn": [["j0"]], "fedx": [["k0"]]}


def _copy_run(src, dst, config=None, rounds=None, names=None, clients=None):
    """A copy of run folder ``src`` with its config updated by ``config``, its log cut to ``rounds`` records (no
    summary.json then), or its per-client accuracy widened to ``clients`` columns named ``names``."""
    import shutil
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    recs = [json.loads(line) for line in (dst / "metrics.jsonl").read_text().splitlines()]
    if rounds is not None:
        recs = recs[:rounds]
        (dst / "summary.json").unlink()
    if clients is not None:
        for r in recs:
            r["test_accuracy"] = [r["test_accuracy"][j % len(r["test_accuracy"])] for j in range(clients)]
        summary = json.loads((dst / "summary.json").read_text())
        (dst / "summary.json").write_text(json.dumps({**summary, "clients": names}))
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_compare_aligns_rounds_keeps_seeds_distinct_and_names_each_groups_clients(sweep, tmp_path, capsys):
    root, runs = sweep
    fedavg = [root / "seed0" / "fedavg", root / "seed1" / "fedavg"]
    # seed 2, stopped after round 2: the group is compared at round 2, with a note
    cut = _copy_run(fedavg[1], tmp_path / "seed2", {"seed": 2}, rounds=2)
    # seed 0 again on another backend: a group of its own, not a third seed
    _copy_run(fedavg[0], tmp_path / "ragged", {"backend": "ragged"})
    # a run of six clients (another population): its clients in a table of their own
    wide = _copy_run(fedavg[0], tmp_path / "six", {"clients_per_domain": 2}, names=[f"c{j}" for j in range(6)],
                     clients=6)
    csv_path = tmp_path / "t.csv"
    args = ["compare", *map(str, fedavg), str(fedavg[0]), str(tmp_path / "seed2"), str(tmp_path / "ragged"),
            str(tmp_path / "six"), "--csv", str(csv_path), "--per-client"]
    assert main(args) == 0
    captured = capsys.readouterr()
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO(csv_path.read_text()))}
    assert sorted(rows) == ["fedavg clients_per_domain=1", "fedavg clients_per_domain=1 backend=ragged",
                            "fedavg clients_per_domain=2"]
    group = rows["fedavg clients_per_domain=1"]
    assert (int(group["seeds"]), int(group["rounds"])) == (3, 2)  # fedavg[0] given twice counts once
    at2 = [runs[("fedavg", s)].history[1]["mean_accuracy"] * 100 for s in (0, 1)] + [cut[1]["mean_accuracy"] * 100]
    np.testing.assert_allclose(float(group["final_mean"]), np.mean(at2), rtol=1e-9)
    assert captured.err.strip().splitlines() == [
        f"jaxfl: note: fedavg clients_per_domain=1: its runs end at different rounds ({str(tmp_path / 'seed2')!r} "
        f"at round 2, the others at 3); compared at round 2, the last all of them evaluated"]
    table = captured.out
    assert "| fedavg clients_per_domain=2 | c5 | " in table and "| method | client | final % (mean ± std) |" in table
    np.testing.assert_allclose(float(rows["fedavg clients_per_domain=2"]["client4_final_mean"]),
                               wide[-1]["test_accuracy"][4] * 100, rtol=1e-9)
    # the plot follows the same rounds (a run that evaluated other rounds is not lined up by position)
    from jaxfl.run.compare import aligned_curves
    rounds, acc = aligned_curves([runs[("fedavg", 0)].history, cut])
    assert rounds.tolist() == [1, 2] and acc.shape == (2, 2)


def test_compare_output_faults_are_one_line(sweep, tmp_path, capsys):
    root, _ = sweep
    assert main(["compare", str(root), "--plot", str(tmp_path / "t.xyz")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"jaxfl: error: --plot {str(tmp_path / 't.xyz')!r}: give a file "
                                                 f"ending in one of .png, .pdf, .svg, .svgz, .jpg, .jpeg, .tif, "
                                                 f".tiff, .eps, .ps"] and captured.out == ""
    assert main(["compare", str(root), "--md", "/proc/jaxfl-t.md"]) == 1  # an OS error: a fault, not bad input
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxfl: error: could not write '/proc/jaxfl-t.md' (")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert main(["compare", str(root), str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (f"jaxfl: error: {str(empty)!r} has no evaluated round with "
                                               f"'mean_accuracy' (its metrics.jsonl is empty or the run has not "
                                               f"evaluated yet); leave it out")


# ---- the paired equivalence test

def _history(values, rounds=None):
    rounds = rounds or list(range(1, len(values) + 1))
    return [{"round": r, "mean_accuracy": v} for r, v in zip(rounds, values)]


def test_t_interval_is_the_student_t_formula():
    from scipy import stats

    from jaxfl.run.compare import t_interval
    d = np.array([1.0, -0.5, 2.0, 0.25])
    mean, low, high = t_interval(d, 0.9)
    half = stats.t.ppf(0.95, 3) * d.std(ddof=1) / 2.0  # sqrt(4) = 2
    np.testing.assert_allclose([mean, low, high], [d.mean(), d.mean() - half, d.mean() + half], rtol=1e-12)
    # t_{0.95, 2} = 2.919986 (tables): three differences of 0, 1, 2 give 1 -+ 2.919986 * 1 / sqrt(3)
    np.testing.assert_allclose(t_interval([0.0, 1.0, 2.0], 0.9)[1:], [1 - 1.685854, 1 + 1.685854], atol=1e-6)
    with pytest.raises(Exception, match="at least 2 paired seeds"):
        t_interval([1.0])


@pytest.mark.parametrize("low,high,verdict", [(-1.0, 1.0, "equivalent"), (-1.6, 1.0, "inconclusive"),
                                              (1.6, 3.0, "different"), (-3.0, -1.51, "different"),
                                              (0.5, 2.0, "inconclusive"), (-1.5, 0.0, "inconclusive")])
def test_equivalence_verdict(low, high, verdict):
    from jaxfl.run.compare import equivalence_verdict
    assert equivalence_verdict(low, high, 1.5) == verdict


def test_paired_equivalence_pairs_seeds_uses_common_rounds_and_sees_a_constant_offset():
    from jaxfl.run.compare import paired_equivalence
    rng = np.random.default_rng(0)
    base = {s: rng.uniform(0.5, 0.9, 6) for s in range(5)}
    # B evaluated every round, A every other one: the window is A's last 2 evaluations (rounds 4 and 6)
    a = {s: _history(v[1::2] + 0.02, rounds=[2, 4, 6]) for s, v in base.items()}
    b = {s: _history(v) for s, v in base.items()}
    b[9] = _history(base[0])  # a seed only B has is left out
    res = paired_equivalence(a, b, tail=2, margin=1.5)
    assert res["seeds"] == [0, 1, 2, 3, 4] and res["only_b"] == [9] and res["rounds"] == [2, 4, 6]
    want_a = [100 * (base[s][[3, 5]].mean() + 0.02) for s in range(5)]
    np.testing.assert_allclose(res["a"], want_a, rtol=1e-12)
    np.testing.assert_allclose(res["diff"], 2.0, atol=1e-9)  # 0.02 -> 2 points on every seed
    np.testing.assert_allclose(res["curve"], 2.0, atol=1e-9)
    # the same offset on every seed: the interval is a point at +2, outside a margin of 1.5, inside one of 3
    assert res["verdict"] == "different" and res["low"] == pytest.approx(2.0) == res["high"]
    assert paired_equivalence(a, b, tail=2, margin=3.0)["verdict"] == "equivalent"
    # unpaired, the same runs would look alike: noise of +-3 points around the offset makes it inconclusive
    noisy = {s: _history(base[s][1::2] + 0.02 + 0.03 * (-1) ** s, rounds=[2, 4, 6]) for s in range(5)}
    assert paired_equivalence(noisy, b, tail=2, margin=1.5)["verdict"] == "inconclusive"


def test_compare_paired_through_the_cli(sweep, tmp_path, capsys):
    root, runs = sweep
    md, png = tmp_path / "p.md", tmp_path / "p.png"
    # fedavg against itself: every difference 0, an interval of width 0 inside any margin
    assert main(["compare", "--paired", str(root / "seed*" / "fedavg"), str(root / "seed*" / "fedavg"),
                 "--md", str(md), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "A - B: +0.00 points, 90% t-interval [+0.00, +0.00] over 2 paired seeds; margin ±1.5: **equivalent**" in out
    assert md.read_text().strip() == out.strip() and png.stat().st_size > 0
    # fedprox has seed 0 only: no interval
    assert main(["compare", "--paired", str(root / "seed*" / "fedavg"), str(root / "seed*" / "fedprox")]) == 0
    assert "**inconclusive**" in capsys.readouterr().out
    # a side holding two runs of one seed, one side only, a bad margin: one line each, exit 2
    for argv, message in ((["compare", "--paired", str(root), str(root / "seed*" / "fedavg")],
                           "holds two runs of seed 0"),
                          (["compare", "--paired", str(root)], "--paired compares two sides"),
                          (["compare", "--paired", str(root / "seed*" / "fedavg"), str(root / "seed*" / "fedavg"),
                            "--margin", "0"], "--margin 0 must be a positive number"),
                          (["compare", "--paired", str(root / "nothing*"), str(root)], "matches no folder")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_compare_reads_logs_compacted_by_the_tool_as_the_plain_ones(sweep, tmp_path, capsys):
    import shutil
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import compact_logs
    root, _ = sweep
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    assert main(["compare", str(root), "--per-client", "--spread"]) == 0
    plain = capsys.readouterr().out
    assert compact_logs.main([str(copy)]) == 0
    assert "3 logs: " in capsys.readouterr().out
    assert not list(copy.rglob("metrics.jsonl")) and len(list(copy.rglob("metrics.jsonl.gz"))) == 3
    assert main(["compare", str(copy), "--per-client", "--spread"]) == 0
    assert capsys.readouterr().out == plain
