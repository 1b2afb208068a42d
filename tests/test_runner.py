import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, bit_identity

from jaxfl.errors import ConfigError, NonFiniteError
from jaxfl.run.cli import command_config, main
from jaxfl.run.config import RunConfig, validate
from jaxfl.run.runner import Experiment, summarize


TINY = dict(dataset="default", model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30,
            batch_size=16, eval_batch_size=32, lr=0.05)


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    full = Experiment(RunConfig(algorithm="fedbn", rounds=4, **TINY)).run()
    first = Experiment(RunConfig(algorithm="fedbn", rounds=2, out=str(tmp_path), checkpoint_every=1, **TINY)).run()
    assert len(first.history) == 2
    resumed = Experiment(RunConfig(algorithm="fedbn", rounds=4, out=str(tmp_path), checkpoint_every=1, resume=True,
                                   **TINY)).run()
    assert_trees_close(full.server, resumed.server, atol=0, rtol=0)
    assert_trees_close(full.clients, resumed.clients, atol=0, rtol=0)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["round"] for l in lines] == [1, 2, 3, 4]
    np.testing.assert_allclose(lines[-1]["test_accuracy"], full.history[-1]["test_accuracy"])
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    # resuming with a different algorithm, or fewer rounds than checkpointed, is refused before any data is read
    from jaxfl.run import build
    with monkeypatch.context() as m:
        m.setattr(build, "load_dataset", lambda *a: pytest.fail("read the data before refusing"))
        with pytest.raises(ConfigError, match=r"the settings differ from the run.s .*config.json. in .*algorithm"):
            Experiment(RunConfig(algorithm="fedavg", rounds=5, out=str(tmp_path), resume=True, **TINY))
        with pytest.raises(ConfigError, match="the checkpoint is at round 4; --rounds 3 must be at least 4"):
            Experiment(RunConfig(algorithm="fedbn", rounds=3, out=str(tmp_path), resume=True, **TINY))
    # a run saved before a config field existed resumes when the field keeps its default
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["client_store"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    more = Experiment(RunConfig(algorithm="fedbn", rounds=5, out=str(tmp_path), resume=True, **TINY)).run()
    assert [h["round"] for h in more.history] == [1, 2, 3, 4, 5]


def test_a_run_is_never_overwritten_silently(tmp_path):
    Experiment(RunConfig(rounds=1, out=str(tmp_path), checkpoint_every=1, **TINY)).run()
    with pytest.raises(ConfigError, match="is not empty; pass --resume to continue its run, --overwrite"):
        Experiment(RunConfig(rounds=2, out=str(tmp_path), checkpoint_every=1, **TINY))
    (tmp_path / "notes.txt").write_text("mine")
    Experiment(RunConfig(rounds=2, out=str(tmp_path), overwrite=True, **TINY)).run()  # replaces the run only
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "notes.txt").read_text() == "mine"


CLI_TINY = ["--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size", "16",
            "--test-per-client", "30"]


def test_cli_writes_every_run_and_prints_a_line_per_round_when_piped(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--rounds", "2"] + CLI_TINY) == 0
    err = capsys.readouterr().err
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("fedbn-default-")  # runs/<algorithm>-<dataset>-<time>
    assert (runs[0] / "metrics.jsonl").is_file() and f"writing to runs/{runs[0].name}" in err
    assert "strategy map, backend stacked, 1 device," in err  # 3 clients a round: no hint to split them over 2 cores
    assert f"compile cache {os.environ['JAX_COMPILATION_CACHE_DIR']};" in err  # jax's own setting (conftest's) kept
    # capsys is not a terminal: plain lines, no progress bar
    assert "round 1/2: train loss" in err and "round 2/2: train loss" in err and "\r" not in err
    assert main(["run", "--rounds", "1"] + CLI_TINY) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2  # a second run gets its own folder


def test_cli_seeds_runs_each_seed_in_its_folder_resumes_them_and_tables_them(tmp_path, capsys):
    """``--seeds``: OUT/seed<S> holds the ordinary run of seed S (the config ``--seed S`` gives); the table of
    ``jaxfl compare`` is printed and saved; ``--resume`` with more rounds and a new seed continues the started
    run and starts the new one with the started one's settings (OUT from a config file's ``out`` here)."""
    out, flags = tmp_path / "sweep", ["run", "--quiet", "--checkpoint-every", "1"] + CLI_TINY
    assert main(flags + ["--seeds", "0", "--rounds", "1", "--out", str(out)]) == 0
    assert "| fedbn | 1 | 1 | " in capsys.readouterr().out
    # the folder named by a config file's `out` (no --out flag) is continued too, and the new seed 1 is run
    # with the sweep's settings (seed 0's config.json), not the defaults
    (tmp_path / "sweep.json").write_text(json.dumps({"out": str(out)}))
    assert main(["run", "--quiet", "--seeds", "0,1", "--rounds", "2", "--config", str(tmp_path / "sweep.json"),
                 "--resume"]) == 0
    table = capsys.readouterr().out
    assert "| fedbn | 2 | 2 | " in table and (out / "compare.md").read_text() == table
    assert (out / "compare.png").stat().st_size > 0
    # each seed's run is the run `--seed S --out OUT/seedS` would be (its numbers are a function of its config)
    for s in (0, 1):
        cfg = command_config(flags + ["--seed", str(s), "--rounds", "2", "--out", str(out / f"seed{s}")])
        saved = json.loads((out / f"seed{s}" / "config.json").read_text())
        # (the run sets eval_point from its cohort, eval_batch_size from the device, and tail_batches and
        # eval_tail_batches to what "auto" chose)
        unset = {"resume": None, "eval_point": None, "eval_batch_size": None, "tail_batches": None,
                 "eval_tail_batches": None}
        assert {**saved, **unset} == {**cfg.resolved().to_dict(), **unset}
    logs = [[json.loads(line) for line in (out / f"seed{s}" / "metrics.jsonl").read_text().splitlines()]
            for s in (0, 1)]
    assert [[r["round"] for r in log] for log in logs] == [[1, 2]] * 2
    assert logs[0][1]["train_loss"] != logs[1][1]["train_loss"]


def test_cli_seeds_go_on_past_a_seed_that_diverges_and_table_the_others(tmp_path, capsys, monkeypatch):
    from jaxfl.run import cli
    real = cli.run_one

    def seed_one_diverges(cfg, quiet, cache, stop=()):
        if cfg.seed == 1:
            raise NonFiniteError("training produced NaN/Inf in round 1 on client(s) x")
        return real(cfg, quiet, cache, stop)
    monkeypatch.setattr(cli, "run_one", seed_one_diverges)
    out = tmp_path / "sweep"
    assert main(["run", "--quiet", "--rounds", "1", "--seeds", "0,1,2", "--out", str(out)] + CLI_TINY) == 2
    captured = capsys.readouterr()
    assert "| fedbn | 2 | 1 | " in captured.out  # seeds 0 and 2
    err = captured.err.strip().splitlines()
    assert err == ["jaxfl: error: seed 1: training produced NaN/Inf in round 1 on client(s) x",
                   "jaxfl: error: seed(s) 1 stopped on non-finite numbers (above); the table covers the other 2"]
    assert (out / "seed2" / "summary.json").is_file()


def test_cli_resume_keeps_the_saved_config_and_allows_what_it_recommends(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main(["run", "--quiet", "--rounds", "2", "--checkpoint-every", "1", "--lr", "0.05", "--out", out]
                + CLI_TINY) == 0
    saved = json.loads((tmp_path / "o" / "config.json").read_text())
    # no other flag: the saved model, sizes, lr and checkpoint_every are kept; --lr may be lowered (NaN advice)
    assert main(["run", "--quiet", "--resume", "--out", out, "--rounds", "3", "--lr", "0.02"]) == 0
    now = json.loads((tmp_path / "o" / "config.json").read_text())
    assert now == dict(saved, rounds=3, lr=0.02, resume=True)
    assert sorted(int(p.name) for p in (tmp_path / "o" / "checkpoints").iterdir() if p.name.isdigit())[-1] == 3
    capsys.readouterr()
    # fewer rounds than the checkpoint: refused, nothing rewritten
    before = (tmp_path / "o" / "config.json").read_text()
    assert main(["run", "--quiet", "--resume", "--out", out, "--rounds", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxfl: error: --resume: the checkpoint is at round 3; --rounds 2 must be at least 3"]
    assert (tmp_path / "o" / "config.json").read_text() == before


def test_resume_drops_a_torn_last_line_and_refuses_a_log_that_disagrees(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["run", "--quiet", "--rounds", "2", "--checkpoint-every", "1", "--out", str(out)] + CLI_TINY) == 0
    full = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # power loss while round 2's line was written: the line is torn and round 2's checkpoint never landed
    import shutil
    shutil.rmtree(out / "checkpoints" / "2")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:25])
    assert main(["run", "--quiet", "--resume", "--out", str(out)]) == 0
    redone = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in redone] == [1, 2]
    assert redone[1]["test_accuracy"] == full[1]["test_accuracy"]  # the redone round is the same round
    capsys.readouterr()
    (out / "metrics.jsonl").unlink()  # a log that no longer matches the checkpoint
    assert main(["run", "--quiet", "--resume", "--out", str(out), "--rounds", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no records but the checkpoint is at round 2" in err[0]


def test_nan_stops_with_round_and_client_and_keeps_last_checkpoint(tmp_path):
    cfg = RunConfig(algorithm="local", rounds=5, out=str(tmp_path), checkpoint_every=1, **TINY)
    exp = Experiment(cfg)
    clean_rounds = exp.run_rounds

    def poisoned_rounds(server, store, first, count):
        if first == 2:  # before round 3, client 1's state turns NaN (as a diverging client's would)
            store.set(jax.tree_util.tree_map(
                lambda a: np.asarray(a).copy() if not np.issubdtype(a.dtype, np.floating) else
                np.where(np.arange(len(a)).reshape((-1,) + (1,) * (a.ndim - 1)) == 1, np.nan, a), store.state))
        return clean_rounds(server, store, first, count)
    exp.run_rounds = poisoned_rounds
    with pytest.raises(NonFiniteError,
                       match=r"in round 3 on client\(s\) sk-digits-photo;.*last good checkpoint: round 2"):
        exp.run()
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-1] == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    # the last good checkpoint restores and holds finite numbers
    from jaxfl.run.checkpoint import Checkpointer
    server, store = exp.init()
    server, clients = Checkpointer(tmp_path / "checkpoints").restore(2, server, store.state)
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves((server, clients)))


def test_huge_learning_rate_is_caught():
    with pytest.raises(NonFiniteError, match=r"non-finite loss or parameters in round 1 on client\(s\)"):
        Experiment(RunConfig(rounds=3, **dict(TINY, lr=1e8))).run()


def test_summary_names_last_best_mean_and_per_client_best():
    hist = [{"round": 1, "test_accuracy": [0.5, 0.9], "mean_accuracy": 0.7, "weighted_accuracy": 0.8},
            {"round": 2, "test_accuracy": [0.8, 0.7], "mean_accuracy": 0.75, "weighted_accuracy": 0.72},
            {"round": 3, "test_accuracy": [0.6, 0.6], "mean_accuracy": 0.6, "weighted_accuracy": 0.6}]
    s = summarize(hist, ["a", "b"])
    assert s["last"]["round"] == 3 and s["best_mean_round"]["round"] == 2
    assert s["best_per_client"]["accuracy"] == [0.8, 0.9]
    assert s["last"]["spread"]["mean"] == pytest.approx(0.6) and s["last"]["spread"]["std"] == pytest.approx(0)


def test_client_spread_by_its_definition():
    from jaxfl.core.metrics import client_spread
    values = [0.9, None, 0.1, 0.5, float("nan"), 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 1.0, 0.0]  # 11 real, 2 absent
    s = client_spread(values)
    real = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert s["mean"] == pytest.approx(real.mean()) and s["std"] == pytest.approx(real.std())
    # linear interpolation between order statistics: rank 0.1 * 10 = 1 -> 0.1; the median 0.5; 0.9
    assert (s["p10"], s["p50"], s["p90"]) == pytest.approx((0.1, 0.5, 0.9))
    assert s["worst10_mean"] == pytest.approx((0.0 + 0.1) / 2)  # ceil(1.1) = 2 worst clients
    assert all(np.isnan(v) for v in client_spread([None, float("nan")]).values())


@pytest.mark.parametrize("args,message", [
    (["--algorithm", "fedfoo"], "unknown algorithm 'fedfoo'; valid: apfl, dapperfl, ditto, fedala"),
    (["--dataset", "svhn"], "unknown dataset 'svhn'; valid: default, digits, pacs"),
    (["--momentum", "1.5"], "momentum=1.5 is outside [0.0, 1.0]"),
    (["--lr", "inf"], "lr=inf must be a finite number"),
    (["--lr", "nan"], "lr=nan must be a finite number"),
    (["--weight-decay", "inf"], "weight_decay=inf must be a finite number"),
    (["--participation", "0"], "participation=0.0 is outside (0.0, 1.0]"),
    (["--clients-per-round", "9"], "clients_per_round=9 exceeds the 3 clients"),
    (["--resume"], "need an output directory"),
])
def test_cli_bad_input_is_one_clear_line(args, message, capsys):
    code = main(["run", "--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "20"] + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_cli_run_writes_outputs(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('algorithm = "fedavg"\nrounds = 3\nmodel = "small_cnn"\nimage_size = 12\n'
                   'samples_per_client = 40\nbatch_size = 16\n')
    code = main(["run", "--config", str(cfg), "--rounds", "2", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0
    assert "sk-digits-photo" in out and "best-mean (r" in out and "weighted" in out
    lines = (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["round"] == 2  # --rounds overrode the file
    assert json.loads((tmp_path / "o" / "config.json").read_text())["algorithm"] == "fedavg"
    assert (tmp_path / "o" / "accuracy.png").is_file()


def test_a_run_without_matplotlib_skips_its_figure_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    # (text: the embedded image benchmark draws its font digits with matplotlib's fonts)
    code = main(["run", "--algorithm", "fedavg", "--rounds", "1", "--dataset", "synthetic_text", "--model",
                 "bow_logreg", "--num-clients", "4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0 and (tmp_path / "o" / "summary.json").is_file()
    assert not (tmp_path / "o" / "accuracy.png").exists()
    assert "jaxfl: matplotlib is not installed: " in err and "accuracy.png not drawn" in err
    assert "wrote " in err and "summary.json\n" in err  # the closing line names no figure
    # asked for a figure, jaxfl compare refuses in one line before writing anything
    for runs in ([str(tmp_path / "o")], [str(tmp_path / "o"), str(tmp_path / "o"), "--paired"]):
        code = main(["compare", *runs, "--plot", str(tmp_path / "c.png"), "--md",
                     str(tmp_path / "c.md")])
        err = capsys.readouterr().err
        assert code == 2 and err == "jaxfl: error: --plot needs matplotlib, which is not installed (pip install " \
                                    "matplotlib)\n"
        assert not (tmp_path / "c.md").exists()


def test_algorithm_options_come_from_the_algorithms_table():
    from jaxfl.algorithms import algorithm_options
    from jaxfl.algorithms.fedselect import FedSelectOptions
    cfg = RunConfig(algorithm="fedprox", options={"fedprox": {"mu": 0.3, "local_bn": True}, "ditto": {"lam": 0.7}})
    o = cfg.algorithm_options()
    assert (type(o).__name__, o.mu, o.local_bn) == ("FedProxOptions", 0.3, True)
    assert algorithm_options("ditto", cfg.options["ditto"]).lam == 0.7
    assert algorithm_options("fedrep", {}).head_epochs == 4  # the class owns the default
    assert algorithm_options("fedselect", {"grow_every": 2}) == FedSelectOptions(grow_every=2)
    # a config's saved form writes the run's table in full and loads back to the same options
    saved = cfg.resolved().to_dict()
    assert saved["fedprox"] == {"local_bn": True, "mu": 0.3} and "ditto" not in saved
    assert RunConfig.from_dict(saved).algorithm_options() == o


@pytest.mark.parametrize("values,message", [
    ({"algorithm": "fedprox", "fedprox": {"mu": -1.0}}, "fedprox.mu=-1.0 must be a finite number in [0.0, inf)"),
    ({"algorithm": "fedselect", "fedselect": {"alpha": 1.5}},
     "fedselect.alpha=1.5 must be a finite number in [0.0, 1.0]"),
    ({"algorithm": "fedavg", "dirichlet_alpha": float("inf")}, "dirichlet_alpha=inf must be a finite number"),
    ({"algorithm": "fedavg", "size_sigma": float("nan")}, "size_sigma=nan must be a finite number"),
    ({"algorithm": "ditto", "ditto": {"lam": float("inf")}}, "ditto.lam=inf must be a finite number"),
    ({"algorithm": "pfedme", "pfedme": {"personal_lr": float("nan")}}, "pfedme.personal_lr=nan must be a finite"),
    ({"algorithm": "fedselect", "fedselect": {"grow_every": 0}}, "fedselect.grow_every=0 must be at least 1"),
    ({"algorithm": "rfeddis", "rfeddis": {"fusion": "product"}}, "rfeddis.fusion='product' is not one of: ds, sum"),
    ({"algorithm": "fedavg", "fedselect": {"alpah": 0.5}}, "unknown fedselect option(s) alpah; fedselect takes:"),
    ({"algorithm": "fedavg", "fedfoo": {"x": 1}}, "unknown config keys ['fedfoo']"),
    ({"algorithm": "fedprox", "fedprox": {"mu": "big"}}, "fedprox.mu='big' must be a number"),
    ({"algorithm": "dapperfl", "dapperfl": {"device_ratios": [0.2, 1.5]}},
     "dapperfl.device_ratios=1.5 must be a finite number in"),
])
def test_bad_algorithm_options_are_named(values, message):
    from jaxfl.run.config import validate
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.from_dict(values))
    assert message in str(e.value)


def test_cli_options_are_addressed_by_algorithm(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('algorithm = "lg_fedavg"\n[lg_fedavg]\nwarmup_rounds = 3\nlocal_bn = true\n'
                   '[fedselect]\nalpha = 0.5\n')  # another algorithm's table is allowed (and checked)
    code = main(["run", "--quiet", "--config", str(cfg), "--lg_fedavg.warmup-rounds", "1", "--rounds", "2",
                 "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size", "16",
                 "--out", str(tmp_path / "o")])
    assert code == 0
    saved = json.loads((tmp_path / "o" / "config.json").read_text())
    # the flag overrode the file's warmup_rounds, the file's local_bn stayed; only the run's table is saved
    assert saved["algorithm"] == "lg_fedavg" and saved["lg_fedavg"] == {"local_bn": True, "warmup_rounds": 1}
    assert "fedselect" not in saved
    capsys.readouterr()
    code = main(["run", "--quiet", "--algorithm", "fedavg", "--fedselect.alpha", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == ("jaxfl: error: --fedselect.alpha: option(s) of fedselect, but the algorithm is fedavg "
                      "(its options are --fedavg.NAME)")


def test_client_optimizer_follows_pytorch_and_fedtp_gets_its_papers_weight_decay(tmp_path):
    import optax

    from jaxfl.core.trainer import client_optimizer
    w, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 0.5])}
    tx = client_optimizer("sgd", lr=0.1, momentum=0.0, weight_decay=0.01)
    upd, _ = tx.update(g, tx.init(w), w)
    np.testing.assert_allclose(optax.apply_updates(w, upd)["w"], w["w"] - 0.1 * (g["w"] + 0.01 * w["w"]), rtol=1e-6)
    tx = client_optimizer("adam", lr=0.1)
    upd, _ = tx.update(g, tx.init(w), w)
    np.testing.assert_allclose(upd["w"], [-0.1, -0.1], rtol=1e-4)  # Adam's first step is -lr * sign(g)
    # the preset: FedTP's official client optimizer has weight decay 1e-5, others none unless asked
    assert RunConfig(algorithm="fedtp").client_training()["weight_decay"] == 1e-5
    assert RunConfig(algorithm="fedtp").client_training()["momentum"] == 0.9  # run scripts' --rho=0.9
    assert RunConfig(algorithm="pfedgp").client_training()["weight_decay"] == 1e-3  # pFedGP's official SGD
    assert RunConfig(algorithm="fedavg").client_training()["weight_decay"] == 0.0
    assert RunConfig(algorithm="fedtp", weight_decay=0.0).client_training()["weight_decay"] == 0.0
    # config.json records the optimizer a run used
    Experiment(RunConfig(algorithm="fedbn", rounds=1, optimizer="adam", weight_decay=1e-4, out=str(tmp_path),
                         **TINY)).run()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["optimizer"], saved["weight_decay"], saved["lr"], saved["nesterov"]) == ("adam", 1e-4, 0.05, False)
    with pytest.raises(ConfigError, match="--nesterov needs --optimizer sgd with --momentum > 0"):
        Experiment(RunConfig(nesterov=True, momentum=0.0, **TINY))


def test_eval_point_local_evaluates_each_model_right_after_its_local_training():
    def acc(algorithm, point):
        h = Experiment(RunConfig(algorithm=algorithm, rounds=2, eval_point=point, **TINY)).run().history
        return [r["test_accuracy"] for r in h]
    # FedSelect: round 1 is evaluated before the broadcast overwrites the global entries (the official code's
    # point), so it differs; the last round does not aggregate, so there both points agree
    sel_local, sel_agg = acc("fedselect", "local"), acc("fedselect", "aggregated")
    assert sel_local[0] != sel_agg[0]
    np.testing.assert_array_equal(sel_local[1], sel_agg[1])
    with pytest.raises(ConfigError, match="every client must train every round"):
        Experiment(RunConfig(algorithm="fedselect", eval_point="local", clients_per_round=2, **TINY))


def _strip_time(history):
    return [{k: v for k, v in h.items() if k not in ("time_s", "compile_s", "compiled_programs", "host_share")}
            for h in history]


@bit_identity("K rounds per call run one round's program in a loop, under map (each client alone)")
def test_rounds_kept_on_the_device_give_the_same_run_for_any_rounds_per_call_and_resume(tmp_path):
    # K = 4 rounds per call, evaluation every 3 rounds and checkpoints every 2 cut the calls into 2, 1, 1, 2, ...
    # rounds: the same numbers, bit for bit, as one round per call; and a run resumed with another K too
    base = dict(algorithm="fedbn", backend="stacked", rounds=7, eval_every=3, clients_per_domain=2,
                clients_per_round=4, **TINY)
    one = Experiment(RunConfig(rounds_per_call=1, **base)).run()
    four = Experiment(RunConfig(rounds_per_call=4, out=str(tmp_path / "k4"), checkpoint_every=2, **base)).run()
    assert _strip_time(one.history) == _strip_time(four.history)
    assert_trees_close((one.server, one.clients), (four.server, four.clients), atol=0, rtol=0)
    assert [h["round"] for h in four.history if "test_accuracy" in h] == [3, 6, 7]
    assert all(0.0 <= h["host_share"] <= 1.0 for h in four.history)
    part = Experiment(RunConfig(rounds_per_call=4, out=str(tmp_path / "part"), checkpoint_every=2,
                                **dict(base, rounds=4))).run()
    resumed = Experiment(RunConfig(rounds_per_call=2, out=str(tmp_path / "part"), checkpoint_every=2, resume=True,
                                   **base)).run()
    # (the shorter run evaluated after its last round, 4; the rounds' training is the same)
    train_only = lambda hs: [{k: v for k, v in h.items() if not k.startswith("test_") and "accuracy" not in k or
                              k == "train_accuracy"} for h in _strip_time(hs)]
    assert len(part.history) == 4 and train_only(resumed.history) == train_only(one.history)
    assert _strip_time(resumed.history)[4:] == _strip_time(one.history)[4:]
    assert_trees_close((one.server, one.clients), (resumed.server, resumed.clients), atol=0, rtol=0)


def test_the_backends_agree_through_the_runner_and_rounds_per_call_needs_the_stacked_one():
    runs = [Experiment(RunConfig(algorithm="fedbn", rounds=3, backend=b, clients_per_round=2, **TINY)).run()
            for b in ("stacked", "streamed", "ragged")]
    for other in runs[1:]:
        assert [h["clients_trained"] for h in runs[0].history] == [h["clients_trained"] for h in other.history]
        np.testing.assert_allclose(runs[0].history[-1]["test_accuracy"], other.history[-1]["test_accuracy"],
                                   atol=0.05)
        assert_trees_close(runs[0].clients, other.clients, atol=1e-4, rtol=1e-4)
    for backend in ("ragged", "streamed"):
        with pytest.raises(ConfigError, match="rounds_per_call=4 keeps rounds on the device: it needs --backend "
                                              "stacked"):
            Experiment(RunConfig(rounds_per_call=4, backend=backend, **TINY))


def test_protocol_fields_come_from_the_algorithms_official_protocol_unless_given():
    # FedTP's run scripts (SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64), FedSelect's code (lr 0.05,
    # no momentum, batch 32), RFedDis's (lr 0.01, no momentum, batch 32), DapperFL's (momentum 0.9, wd 1e-5)
    expect = {"fedtp": (64, 0.01, 0.9, 1e-5), "fedselect": (32, 0.05, 0.0, 0.0), "rfeddis": (32, 0.01, 0.0, 0.0),
              "dapperfl": (64, 0.01, 0.9, 1e-5), "fedavg": (64, 0.01, 0.5, 0.0)}
    for name, values in expect.items():
        cfg = validate(RunConfig(algorithm=name))
        assert (cfg.batch_size, cfg.lr, cfg.momentum, cfg.weight_decay) == values, name
    given = validate(RunConfig(algorithm="fedtp", lr=0.2, momentum=0.0, batch_size=16, weight_decay=0.0))
    assert (given.batch_size, given.lr, given.momentum, given.weight_decay) == (16, 0.2, 0.0, 0.0)
    # FedSelect's code evaluates each model right after its local training: the default when every client
    # trains every round; a partial cohort falls back to evaluating after aggregation; a given value wins
    assert RunConfig(algorithm="fedselect").with_eval_point(True).eval_point == "local"
    assert RunConfig(algorithm="fedselect").with_eval_point(False).eval_point == "aggregated"
    assert RunConfig(algorithm="fedavg").with_eval_point(True).eval_point == "aggregated"
    assert RunConfig(algorithm="fedselect", eval_point="aggregated").with_eval_point(True).eval_point == "aggregated"


def test_a_run_saves_the_protocol_it_used(tmp_path):
    tiny = {k: v for k, v in TINY.items() if k not in ("batch_size", "lr")}
    Experiment(RunConfig(algorithm="fedselect", rounds=1, out=str(tmp_path), **tiny)).run()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["lr"], saved["momentum"], saved["batch_size"], saved["eval_point"]) == (0.05, 0.0, 32, "local")


def test_devices_note_suggests_the_idle_cores_only_where_the_cohort_splits_over_them(monkeypatch):
    from types import SimpleNamespace

    import jaxfl.core.distributed as distributed
    from jaxfl.core.distributed import client_mesh
    from jaxfl.run.cli import devices_note
    monkeypatch.setattr(distributed, "cpu_cores", lambda: 4)
    one = SimpleNamespace(devices=1)  # --devices 1 asked for; unset, the run would have split over the cores
    assert devices_note(SimpleNamespace(mesh=None, cohort=8, cfg=one)) == (
        "1 device (--devices 4 would split each cohort over this CPU's 4 cores)")
    assert devices_note(SimpleNamespace(mesh=None, cohort=8, cfg=SimpleNamespace(devices=None))) == "1 device"
    assert devices_note(SimpleNamespace(mesh=None, cohort=6, cfg=one)) == "1 device"
    assert devices_note(SimpleNamespace(mesh=client_mesh(1), cohort=8, cfg=one)).startswith("1 device (")
    monkeypatch.setattr(distributed, "cpu_cores", lambda: 1)
    assert devices_note(SimpleNamespace(mesh=None, cohort=8, cfg=one)) == "1 device"


def test_a_large_population_is_summarised_in_the_start_up_line_and_the_table():
    from jaxfl.run.cli import format_table, population_note
    names = [f"c{i}" for i in range(25)]
    assert population_note(names[:3], [7, 9, 8]) == "3 clients ['c0', 'c1', 'c2'], train sizes [7, 9, 8]"
    assert population_note(names, np.arange(25) + 50) == "25 clients (c0 ... c24), train sizes 50-74 (median 62)"
    acc = (np.arange(25) / 24).tolist()
    row = lambda r, a: {"round": r, "accuracy": a, "mean_accuracy": 0.5, "weighted_accuracy": 0.4}
    table = format_table({"clients": names, "last": row(3, acc), "best_mean_round": row(2, acc[::-1]),
                          "best_per_client": {"accuracy": [1.0] * 25, "mean_accuracy": 1.0}}).splitlines()
    assert len(table) == 2 + 3 + 3 and not any(line.startswith("c1") for line in table)
    assert table[2].split() == ["min", "of", "25", "0.0000", "0.0000", "1.0000"]
    assert table[3].split() == ["median", "of", "25", "0.5000", "0.5000", "1.0000"]
    assert table[4].split() == ["max", "of", "25", "1.0000", "1.0000", "1.0000"]


def test_participation_is_a_fraction_of_the_clients_up_to_float_error_and_the_poisson_rate():
    from jaxfl.run.build import cohort_size, sampling_rate
    # p N rounded up, but 0.14 x 50 = 7.000000000000001 is 7 clients, not 8
    for p, n, k in ((0.14, 50, 7), (0.07, 100, 7), (0.56, 100, 56), (0.1, 100, 10), (0.5, 3, 2), (0.001, 20, 1),
                    (1.0, 7, 7), (0.3, 10, 3), (0.29, 10, 3)):
        assert cohort_size(RunConfig(participation=p), n) == k, (p, n)
        assert sampling_rate(RunConfig(participation=p), n) == k / n
        # under Poisson sampling each client joins with probability p itself (the rate the accountant uses)
        assert sampling_rate(RunConfig(participation=p, cohort_sampling="poisson"), n) == p
    assert sampling_rate(RunConfig(clients_per_round=3, cohort_sampling="poisson"), 20) == 3 / 20
    assert sampling_rate(RunConfig(), 20) == 1.0


def test_a_config_built_in_python_is_checked_for_its_types():
    # (the CLI and config files coerce; a RunConfig built by hand reaches validate as it is)
    for kw, message in ((dict(rounds="3"), "rounds='3' must be an integer"), (dict(lr="x"), "lr='x' must be a number"),
                        (dict(resume="yes"), "resume='yes' must be true or false")):
        with pytest.raises(ConfigError, match=message):
            validate(RunConfig(**kw))
    assert validate(RunConfig(lr=1)).lr == 1  # an int where a float is asked is a number


def test_every_run_option_is_declared_once_with_its_help_and_is_a_flag():
    import dataclasses

    from jaxfl.run.cli import build_parser, generated_help
    from jaxfl.run.config import CONFIG_GROUPS, GROUPS
    placed = [name for names in CONFIG_GROUPS.values() for name in names]
    assert len(placed) == len(set(placed)), "a field in two groups"
    assert set(placed) == {f.name for f in dataclasses.fields(RunConfig)} - {"options"}
    assert list(CONFIG_GROUPS) == [g.title for g in GROUPS]
    generated = generated_help()
    undocumented = [f.name for f in dataclasses.fields(RunConfig)
                    if f.name != "options" and not (f.metadata.get("help") or generated.get(f.name))]
    assert undocumented == []
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    flags = {a.dest for a in run._actions}
    assert set(placed) <= flags


def test_a_group_checks_its_declared_values_and_its_own_fields():
    from jaxfl.run.config import ClientTraining, Engine, Output
    # declared values: the same messages whether the group stands alone or inside a RunConfig
    for group, kw, message in ((Engine, dict(lane_segments=-1), "lane_segments=-1 must be at least 0 (0: one vmap"),
                               (Engine, dict(backend="gpu"), "unknown backend 'gpu'; valid: stacked"),
                               (ClientTraining, dict(momentum=1.5), "momentum=1.5 is outside [0.0, 1.0]"),
                               (Output, dict(resume=True), "checkpoints and --resume need an output directory")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            group.validate_fields(group(**kw))
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(RunConfig(**kw))
    Engine.validate_fields(Engine(lane_segments=0))  # the edge of the range is allowed
    # a group's own check across its fields
    with pytest.raises(ConfigError, match="--nesterov needs --optimizer sgd with --momentum > 0"):
        ClientTraining.validate_fields(ClientTraining(nesterov=True, momentum=0.0))


def test_print_config_writes_the_whole_resolved_config_that_config_reads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["run", "--algorithm", "fedprox", "--rounds", "3", "--lr", "0.05", "--fedprox.mu", "0.3",
            "--eval-model", "both", "--out", str(tmp_path / "never")] + CLI_TINY
    assert main(args + ["--print-config"]) == 0
    text = capsys.readouterr().out
    assert "# -- client training\n" in text and "lr = 0.05\n" in text and "eval_model = \"both\"\n" in text
    assert "[fedprox]" in text and "mu = 0.3\n" in text
    assert "# model = (default" not in text and 'model = "small_cnn"' in text
    assert not (tmp_path / "never").exists() and not (tmp_path / "runs").exists()  # nothing written
    (tmp_path / "cfg.toml").write_text(text)
    assert main(["run", "--config", str(tmp_path / "cfg.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out == text  # the file gives the same run
    assert main(["run", "--lr", "-1", "--print-config"]) == 2  # checked like a run
