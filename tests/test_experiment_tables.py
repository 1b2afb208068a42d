"""The experiment scripts' seed statistics (experiments/common.py): mean ± std over seeds, by hand."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from common import parse_seeds, plot_mean_accuracy, run_script, seed_root, seed_stats, seed_table, table  # noqa: E402
import common as experiments_common  # noqa: E402

from jaxfl.errors import ConfigError, DataError, RunIOError, Stopped  # noqa: E402


def history(accs, per_client=None):
    """metrics.jsonl rows of a run evaluated every round (round 1..R); the train-only row 0 has no accuracy."""
    rows = [{"round": 0, "train_loss": [1.0]}]
    for r, a in enumerate(accs, 1):
        rows.append({"round": r, "mean_accuracy": a, "weighted_accuracy": a / 2,
                     "test_accuracy": list(per_client[r - 1]) if per_client else [a, a]})
    return rows


SEED0 = history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
SEED1 = history([0.2, 0.2, 0.2, 0.2, 0.2, 0.8])


def test_seed_stats_are_mean_and_std_over_seeds_of_final_and_tail():
    st = seed_stats([SEED0, SEED1], tail=5)
    finals = [60.0, 80.0]
    tails = [np.mean([20, 30, 40, 50, 60]), np.mean([20, 20, 20, 20, 80])]  # 40 and 32
    assert st["final"] == pytest.approx((np.mean(finals), np.std(finals)))  # (70, 10)
    assert st["tail"] == pytest.approx((np.mean(tails), np.std(tails)))  # (36, 4)
    assert st["seeds"] == 2 and st["rounds"] == 6
    assert seed_stats([SEED0], key="weighted_accuracy", tail=2)["final"] == pytest.approx((30.0, 0.0))


def test_dp_runs_get_a_column_of_the_epsilon_they_spent():
    dp = [dict(r, dp_epsilon=0.5 * r["round"]) for r in SEED0]  # every round's record carries it
    text = seed_table({"fedavg": [SEED0], "fedavg dp_noise=1": [dp, dp]})
    head, _, plain, private = text.splitlines()
    assert "DP ε spent" in head.split(" | ")[3]
    assert plain.split(" | ")[3] == "-" and private.split(" | ")[3] == "3"  # round 6's epsilon
    assert "DP ε" not in seed_table({"fedavg": [SEED0]})


def test_seed_table_rows():
    text = seed_table({"fedavg": [SEED0, SEED1], "local:lr=0.1": [SEED0]}, paper={"local": 74.6})
    lines = text.splitlines()
    # final, best-mean (SEED0's best 60 in round 6, SEED1's 80), last-5
    assert lines[2] == "| fedavg | 2 | 6 | 70.00 ± 10.00 | 70.00 ± 10.00 | 36.00 ± 4.00 | - |"
    assert lines[3] == "| local:lr=0.1 | 1 | 6 | 60.00 ± 0.00 | 60.00 ± 0.00 | 40.00 ± 0.00 | 74.6 |"
    early = history([0.9, 0.2, 0.3])  # the best-mean round need not be the last
    assert seed_stats([early], tail=2)["best"] == pytest.approx((90.0, 0.0))


def test_per_client_table_averages_best_and_last_over_seeds():
    a = history([0.5, 0.4], per_client=[(0.5, 0.7), (0.4, 0.9)])
    b = history([0.5, 0.4], per_client=[(0.3, 0.1), (0.6, 0.2)])
    row = table({"fedbn": [a, b]}, ["c0", "c1"], {"fedbn": (1.0, 2.0)}).splitlines()[2]
    # best per client: seed a (50, 90), seed b (60, 20); last: a (40, 90), b (60, 20)
    assert row == ("| fedbn | 55.00 ± 5.00 (50.00) | 55.00 ± 35.00 (55.00) | 55.00 ± 15.00 (52.50) "
                   "| 1.00 / 2.00 |")


def test_seeds_parse_and_lay_out_runs(tmp_path):
    assert parse_seeds("0,1, 2") == [0, 1, 2]
    for bad in ("", "1,1"):
        with pytest.raises(ConfigError, match="give distinct integers >= 0"):  # run_script's one line, exit 2
            parse_seeds(bad)
    assert seed_root(tmp_path, 3, [3]) == tmp_path
    assert seed_root(tmp_path, 3, [1, 3]) == tmp_path / "seed3"
    plot_mean_accuracy({"fedavg": [SEED0, SEED1]}, tmp_path / "a.png", "t")
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_every_variant_is_checked_before_the_first_runs():
    from jaxfl.run.config import RunConfig
    base = RunConfig(dataset="default")
    experiments_common.check_variants(["fedavg", "fedprox:mu=0.1:lr=0.05"], base)
    cases = {("fedavg", "fedprox:mu=-1"): "fedprox.mu=-1.0 must be a finite number in [0.0, inf)",
             ("fedavg", "nosuch"): "unknown algorithm 'nosuch'",
             ("fedavg", "fedprox:muu=1"): "unknown option 'muu' in 'fedprox:muu=1'",
             ("fedpick:use_pfsm=ture",): "'ture' in variant 'fedpick:use_pfsm=ture' is not a true/false",
             ("fedavg:lr=abc",): "'abc' in variant 'fedavg:lr=abc' is not a float"}
    for specs, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            experiments_common.check_variants(specs, base)
    assert experiments_common.parse_list("0.5, 0.9", "--stragglers", float) == [0.5, 0.9]
    with pytest.raises(ConfigError, match="--datasets 'nosuch': give comma-separated values from digits, pacs"):
        experiments_common.parse_list("nosuch", "--datasets", choices=("digits", "pacs"))


def test_run_script_ends_a_stop_or_an_error_in_one_line_with_the_cli_exit_code(capsys):
    def stops(argv):
        raise Stopped("stopped at round 6; continue with jaxfl run --out X --resume", 15, 6)

    def bad(argv):
        raise DataError("data directory '/nowhere' does not exist")

    def full(argv):
        raise RunIOError("writing /tmp/x: [Errno 28] No space left on device")

    seen = []
    assert run_script(lambda argv: seen.append(argv), ["--rounds", "2"]) == 0 and seen == [["--rounds", "2"]]
    assert run_script(stops) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": stopped at round 6; rerun the same command to continue")
    assert run_script(bad) == 2
    assert capsys.readouterr().err.strip().endswith(": error: data directory '/nowhere' does not exist")
    assert run_script(full) == 1
    with pytest.raises(ValueError):  # anything else is a bug: its traceback stays
        run_script(lambda argv: int("x"))


def official_script(stem: str, name: str, monkeypatch, register: bool = False):
    """experiments/official/<stem>.py as the module ``name`` (that folder is not a package); ``register`` puts it
    in ``sys.modules`` first (for the duration of the test), which a module whose dataclasses look their module
    up needs."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "experiments" / "official" / f"{stem}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def official(monkeypatch):
    """experiments/official/common.py as a module."""
    return official_script("common", "official_common", monkeypatch, register=True)


def test_official_comparisons_take_the_rounds_both_sides_evaluated(official):
    """experiments/official/common.py's ``common_rounds``: an official run evaluated every round beside a jaxfl run
    evaluated every 5th is compared at rounds 5 and 10 only; train-only rows stay; seed_stats then reads those."""
    every = history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.3])
    sparse = [r for r in history([0.5] * 10) if "mean_accuracy" not in r or r["round"] % 5 == 0]
    out = official.common_rounds({"official": [every], "jaxfl": [sparse]})
    assert [r["round"] for r in out["official"][0] if "mean_accuracy" in r] == [5, 10]
    assert out["official"][0][0] == {"round": 0, "train_loss": [1.0]}
    assert out["jaxfl"] == [sparse]
    st = seed_stats(out["official"], tail=5)
    assert st["final"][0] == pytest.approx(30.0) and st["tail"][0] == pytest.approx(40.0)  # mean of 50 and 30
    assert st["best"][0] == pytest.approx(50.0)
    assert official.common_rounds({"a": [every], "b": [every]}) == {"a": [every], "b": [every]}


def test_official_agreement_bound_is_two_pooled_stds_or_one_and_a_half_points(official):
    """experiments/official/common.py's criterion, by hand: pooled std sqrt((s_a^2 + s_b^2) / 2)."""
    assert official.pooled_std(3.0, 4.0) == pytest.approx((12.5) ** 0.5)
    assert official.agreement_bound(3.0, 4.0) == pytest.approx(2 * 12.5 ** 0.5)  # 7.07: the stds decide
    assert official.agreement_bound(0.3, 0.4) == 1.5  # 0.71 < 1.5: the floor decides
    assert official.agreement_bound(0.0, 0.0) == 1.5


@pytest.fixture
def pfl_setting(official, monkeypatch):
    """experiments/official/pfl_setting.py, whose ``from common import`` means experiments/official/common.py."""
    monkeypatch.setitem(sys.modules, "common", official)
    return official_script("pfl_setting", "pfl_setting", monkeypatch, register=True)


def test_library_comparison_pairs_runs_by_seed_and_applies_the_criterion(pfl_setting, tmp_path):
    """pfl_setting.compare_methods (the PFLlib, FedRepo and FedProto adapters' table) on run folders laid out as
    pfl_methods.py (``seed<s>/<variant>_lr<lr>/``) and the adapters (``seed<s>/<variant>/``) write them: a method
    whose final means differ by 1 point with seed-stds of 1 agrees, one 10 points apart differs, one that only
    one side ran is left out, and the figure is written."""
    import json

    def write(folder, finals, lr=None):
        for s, final in enumerate(finals):
            d = folder(s)
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in history([0.5, 0.6, final])))
            (d / "config.json").write_text(json.dumps({"lr": lr}))

    jax, off = tmp_path / "jaxfl", tmp_path / "lib"
    write(lambda s: off / f"seed{s}" / "near", [0.90, 0.92])
    write(lambda s: jax / f"seed{s}" / "near_lr0.05", [0.91, 0.93], lr=0.05)
    write(lambda s: off / f"seed{s}" / "far", [0.80, 0.80])
    write(lambda s: jax / f"seed{s}" / "far_lr0.02", [0.90, 0.90], lr=0.02)
    write(lambda s: off / f"seed{s}" / "alone", [0.7, 0.7])
    table, pairs = pfl_setting.compare_methods(experiments_common, "Lib", {"near": True, "far": False, "alone": False},
                                               off, jax, [0, 1])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert sorted(rows) == ["far", "near"] and sorted(pairs) == ["far", "near"]
    assert rows["near"][1:4] == ["official", "0.05", "91.00 ± 1.00"] and rows["near"][5:8] == ["+1.00", "2.00", "agree"]
    assert rows["far"][1:3] == ["a reference", "0.02"] and rows["far"][5:8] == ["+10.00", "1.50", "DIFFER"]
    assert table.splitlines()[0].startswith("| method | Lib is | lr | Lib final | jaxfl final |")
    pfl_setting.plot_panels(experiments_common, pairs, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_fedfomo_adapter_splits_each_client_as_jaxfl_does(pfl_setting, official, monkeypatch):
    """experiments/official/fedfomo.py gives the official clients jaxfl's train/validation split: the positions
    ``split_rows`` orders for a client padded to M (what ``fedfomo``'s local update uses) start with the adapter's
    unpadded ones, so both codes validate on the same samples; the two parts cover the client's samples once."""
    import jax
    import numpy as np

    from jaxfl.algorithms.fedfomo import split_rows
    monkeypatch.setitem(sys.modules, "common", official)
    adapter = official_script("fedfomo", "fedfomo_adapter", monkeypatch)
    opts = {"split_seed": 3, "val_frac": 0.2}
    for count, cid in [(37, 5), (500, 0), (8, 19)]:
        train, val = adapter.split_indices(count, cid, opts)
        key = jax.random.fold_in(jax.random.key(3), cid)
        order, n_train = split_rows(key, np.int32(count), 512, 0.2)  # padded to 512 positions, as in a bucket
        order = np.asarray(order)
        assert len(val) == count // 5 and len(train) == count - count // 5 == int(n_train)
        np.testing.assert_array_equal(train, order[:int(n_train)])
        np.testing.assert_array_equal(val, order[int(n_train):count])
        assert sorted(np.concatenate([train, val]).tolist()) == list(range(count))



def test_fedtp_adapter_converts_jaxfls_weights_to_the_official_layout(official, monkeypatch):
    """experiments/official/fedtp.py's converters, against what the official modules compute with the converted
    weights (written here with numpy as the official code computes them): ``ViTHyper``'s head output viewed as
    [3I, D] and used as x @ W^T equals jaxfl's generated W_qkv [D, 3I] used as x @ W; a Linear layer's torch
    weight is jaxfl's kernel transposed; the state-dict names are the official ``ViT``'s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfl.models import build_model
    from jaxfl.ops.hypernet import hypernetwork
    monkeypatch.setitem(sys.modules, "common", official)
    adapter = official_script("fedtp", "fedtp_adapter", monkeypatch)

    dim, inner3, hidden, depth = 6, 12, 5, 2
    hnet = hypernetwork({f"qkv{l}": (dim, inner3) for l in range(depth)}, embed_dim=4, hidden=hidden, n_hidden=1)
    params = hnet.init(jax.random.key(0))
    z = np.asarray(jax.random.normal(jax.random.key(1), (3, 4)))
    sd = adapter.hypernet_to_torch(params, z, dim, inner3)
    h = z[2]  # the official trunk: Linear, ReLU, Linear (torch weights [out, in])
    h = np.maximum(sd["mlp.0.weight"] @ h + sd["mlp.0.bias"], 0.0)
    h = sd["mlp.2.weight"] @ h + sd["mlp.2.bias"]
    ours = hnet.apply(params, jnp.asarray(z[2]))
    x = np.asarray(jax.random.normal(jax.random.key(2), (7, dim)))
    for l in range(depth):
        w_official = (sd[f"to_qkv_value_list.{l}.weight"] @ h + sd[f"to_qkv_value_list.{l}.bias"]).reshape(inner3, dim)
        np.testing.assert_allclose(x @ w_official.T, x @ np.asarray(ours[f"qkv{l}"]), rtol=1e-5, atol=1e-5)
    assert set(sd) == {"embeddings.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                       *(f"to_qkv_value_list.{l}.{k}" for l in range(depth) for k in ("weight", "bias"))}

    model = build_model("vit_tiny", 10)
    vit = model.init(jax.random.key(3), jnp.zeros((1, 32, 32, 3)), train=False)["params"]
    sd = adapter.vit_to_torch(vit, model.encoder.depth)
    e = vit["encoder"]
    np.testing.assert_array_equal(sd["to_patch_embedding.1.weight"], np.asarray(e["patch_embed"]["linear"]["kernel"]).T)
    np.testing.assert_array_equal(sd["mlp_head.1.weight"], np.asarray(vit["head"]["fc1"]["linear"]["kernel"]).T)
    np.testing.assert_array_equal(sd["transformer.layers.1.1.norm.weight"], np.asarray(e["ln_ff1"]["scale"]))
    per_block = {"0.norm.weight", "0.norm.bias", "0.fn.to_out.0.weight", "0.fn.to_out.0.bias", "1.norm.weight",
                 "1.norm.bias", "1.fn.net.0.weight", "1.fn.net.0.bias", "1.fn.net.3.weight", "1.fn.net.3.bias"}
    assert set(sd) == {"to_patch_embedding.1.weight", "to_patch_embedding.1.bias", "pos_embedding", "cls_token",
                       "mlp_head.0.weight", "mlp_head.0.bias", "mlp_head.1.weight", "mlp_head.1.bias",
                       *(f"transformer.layers.{l}.{k}" for l in range(model.encoder.depth) for k in per_block)}

def test_library_adapter_command_line(pfl_setting, tmp_path, capsys):
    """pfl_setting.Library.main, the command line of the library adapters: ``--compare`` prints the table of
    the runs both sides logged under the library's label; ``--all`` without ``--out`` and a run without its
    folders are refused with a usage error (exit 2) before anything runs."""
    import json

    for folder, final in [(tmp_path / "lib" / "seed0" / "m", 0.90), (tmp_path / "jaxfl" / "seed0" / "m_lr0.1", 0.91)]:
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in history([0.5, final])))
        (folder / "config.json").write_text(json.dumps({"lr": 0.1}))
    ran = []
    lib = pfl_setting.Library("Lib", "owner/lib", "0123456789abcdef", "LIB_CHECKOUT", {"m": True})
    lib.main(["--compare", "--official-logs", str(tmp_path / "lib"), "--jaxfl-logs", str(tmp_path / "jaxfl"),
              "--seeds", "0", "--experiments-common", str(Path(experiments_common.__file__))], "doc", "script",
             ran.append)
    out = capsys.readouterr().out
    assert "| m | official | 0.1 | 90.00 ± 0.00 | 91.00 ± 0.00 | +1.00 | 1.50 | agree |" in out
    for argv in (["--all"], ["--method", "m", "--out", str(tmp_path / "o")]):
        with pytest.raises(SystemExit) as e:
            lib.main(argv, "doc", "script", ran.append)
        assert e.value.code == 2
    assert ran == [] and not (tmp_path / "o").exists()


def test_stub_unimportable_stands_in_only_for_modules_that_do_not_import(official, monkeypatch):
    """experiments/official/common.py's ``stub_unimportable``: a module that does not import becomes a stub from
    which any name imports, as a class constructible with any arguments, usable as a base class and in
    annotations, its attributes again such classes, its instances not callable; its submodules are set on it; a
    module that imports is kept. It says whether it stubbed (the FedTP adapter records the names)."""
    import json
    import typing

    for name in ("no_such_pkg_xyz", "no_such_pkg_xyz.io", "no_such_pkg_xyz.io.image"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert official.stub_unimportable("no_such_pkg_xyz", ("io", "io.image")) is True
    from no_such_pkg_xyz.io.image import ImageReadMode  # the import a first version of the stub failed
    import no_such_pkg_xyz
    assert ImageReadMode.__name__ == "ImageReadMode"
    assert no_such_pkg_xyz.io.image is sys.modules["no_such_pkg_xyz.io.image"]
    transform = no_such_pkg_xyz.transforms.Compose([1, 2], size=3)
    assert type(transform).__name__ == "Compose"
    with pytest.raises(TypeError):  # applying a stubbed transform fails loudly
        transform([0])
    assert typing.Optional[no_such_pkg_xyz.transforms.Compose] is not None
    assert no_such_pkg_xyz.models.ResNet18_Weights.DEFAULT.__name__ == "DEFAULT"

    class Dataset(no_such_pkg_xyz.data.Dataset):
        pass

    assert Dataset() is not None
    assert official.stub_unimportable("json") is False
    assert sys.modules["json"] is json  # (monkeypatch removes the stubs again: the names were absent)


def test_the_codec_table_checks_every_codec_before_any_run_and_files_each_under_its_spec(tmp_path):
    import robustness
    assert robustness.codec_dir("quantize:bits=2,rotate=1") == "quantize_bits2_rotate1"
    with pytest.raises(ConfigError, match=r"fraction=2 must be a number in \(0, 1\]"):
        robustness.main(["--aggregators", "mean", "--attacks", "none", "--out", str(tmp_path / "r"),
                         "--compressions", "topk", "topk:fraction=2"])
    assert not (tmp_path / "r").exists()


def test_the_new_clients_table_reads_the_four_evaluations_of_each_run():
    import new_clients
    hist = [{"round": 1, "train_loss": [1.0]},
            {"round": 2, "mean_accuracy": 0.9, "global_mean_accuracy": 0.5, "new_mean_accuracy": 0.4,
             "new_tuned_mean_accuracy": 0.8}]
    text = new_clients.table({"fedper": [hist, hist]}, [0, 1], 2)
    assert "| fedper | 90.0 ± 0.0 | 50.0 ± 0.0 | 40.0 ± 0.0 | 80.0 ± 0.0 |" in text
    untuned = [hist[0], {**hist[1], "new_tuned_mean_accuracy": None}]
    assert "| 40.0 ± 0.0 | - |" in new_clients.table({"pfedgp": [untuned]}, [0], 2)


def test_the_committed_fedopt_configs_are_the_scripts_and_valid():
    import fedopt

    from jaxfl.run.config import RunConfig, load_config_file, validate
    folder = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "fedopt"
    assert sorted(p.name for p in folder.glob("*.toml")) == sorted(
        f"{t}_{m}.toml" for t in fedopt.TASKS for m in fedopt.METHODS)
    for task in fedopt.TASKS:
        for method in fedopt.METHODS:
            path = folder / f"{task}_{method}.toml"
            assert path.read_text() == fedopt.toml_text(task, method), f"{path} is stale: rerun fedopt.py --write"
            cfg = validate(RunConfig.from_dict(dict(load_config_file(path),
                                                    dataset=f"{fedopt.TASKS[task]['prefix']}:DATA")))
            assert cfg.lr == pytest.approx(10 ** fedopt.TASKS[task]["client_lr"][method], rel=1e-4)
    # FedAdam on EMNIST: client lr 10^-1.5, server lr 10^-2.5, tau 10^-4 (the source's table)
    s = fedopt.settings("emnist_cr", "fedadam")
    assert (s["server_opt"], s["server_lr"], s["server_tau"]) == ("adam", 0.003162, 1e-4)


def test_the_fedopt_settings_run_end_to_end_on_fabricated_tff_files(tmp_path, capsys):
    pytest.importorskip("h5py")
    import fedopt
    from conftest import emnist_files
    emnist_files(tmp_path / "data", writers=tuple(f"w{i:02d}" for i in range(10)), n=(6,) * 10)  # (cohort 10)
    fedopt.main(["--data", str(tmp_path / "data"), "--tasks", "emnist_cr,emnist_ae,shakespeare",
                 "--methods", "fedyogi,fedavg", "--rounds", "1", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "shakespeare: skipped, missing" in out and "shakespeare_train.h5" in out
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| emnist_cr | fedyogi | 1 |" in table
    rows = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| emnist_cr |")}
    assert rows["fedavg"].endswith("| 84.9 |") and rows["fedyogi"].endswith("|  |")  # (the paper's FedAvg only)
    assert "| emnist_ae | fedyogi | 1 |" in table  # (the autoencoder: the same files, float targets)
    cfg = json.loads((tmp_path / "out" / "emnist_ae" / "fedyogi" / "fedavg" / "config.json").read_text())
    assert cfg["model"] == "emnist_ae" and cfg["dataset"].startswith("tff_emnist_ae:") and cfg["lr"] == 10.0
    cfg = json.loads((tmp_path / "out" / "emnist_cr" / "fedyogi" / "fedavg" / "config.json").read_text())
    assert cfg["server_opt"] == "yogi" and cfg["model"] == "cnn_dropout" and cfg["batch_size"] == 20
