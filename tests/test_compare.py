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
