"""The benchmark scripts' bookkeeping, never their speed: which workloads an earlier run measured, how a failed
runner shows in the table, that each script times the computation it names and computes its roofline from
its own times and XLA's step cost, and that bad flags are refused in one line."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_suite  # noqa: E402
import throughput  # noqa: E402


def test_every_suite_workload_has_its_own_key():
    keys = [gpu_suite.spec_key(spec) for spec, _ in gpu_suite.SUITE]
    assert len(set(keys)) == len(keys)
    assert gpu_suite.spec_key("xdev:100") == ("cross_device", 1000, 100)
    assert gpu_suite.spec_key("skewed:0.3:1000:10") == ("dirichlet 0.3", 1000, 10)
    assert gpu_suite.spec_key("equal:fedavg_cnn:10") == ("fedavg_cnn", 10, 10)


def test_skip_done_skips_measured_workloads_but_not_failed_ones(tmp_path):
    ok = {"workload": "fedavg_cnn", "clients": 10, "cohort": 10, "jax_loop": {"samples_per_s": 1.0}}
    failed = {"workload": "fedavg_cnn", "clients": 1000, "cohort": 1000, "engine/vmap": {"error": "RESOURCE_EXHAUSTED"}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps({"results": [ok, failed]}))
    assert gpu_suite.measured_keys(tmp_path) == {("fedavg_cnn", 10, 10)}


def test_a_failed_runner_is_a_row_and_the_others_keep_their_ratios():
    r = {"workload": "fedavg_cnn", "clients": 1000, "cohort": 1000, "max_over_mean": 1.0, "peak_rss_gb": 2.0,
         "engine/vmap": {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"},
         "engine/map": {"samples_per_s": 300.0, "round_s": 1.0, "padded_work": 1.0, "buckets": 1,
                        "compiled_shapes": 1, "lane_cap": None},
         "jax_loop": {"samples_per_s": 100.0, "round_s": 3.0}}
    rows = throughput.report([r]).splitlines()[2:]
    assert rows[0].startswith("| fedavg_cnn | 1000 (1000) | 1.0 | engine/vmap | failed: JaxRuntimeError: RESOURCE")
    assert "| engine/map | 300 | - | 3.00 |" in rows[1]
    assert throughput.guarded(lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


def test_small_runner_names():
    """``stacked/S/K/D`` and ``ragged/S/D``: K rounds per call (the workload then draws K cohorts), D devices."""
    runners = ("stacked/map/K1", "stacked/map/K10/D2", "ragged/map/D2", "jax_loop")
    assert [throughput.runner_devices(r) for r in runners] == [1, 2, 2, 1]
    assert throughput.cohorts_needed(["stacked/map/K1", "stacked/map/K1/D2", "torch_loop"], 2, 10) == 2
    assert throughput.cohorts_needed(["stacked/map/K1", "stacked/map/K10/D2"], 2, 10) == 10
    assert throughput.cohorts_needed(["stacked/vmap/K10"], 12, 10) == 12
    # /F: a new rows buffer each call; /T last (the runner's tail sizes are read from its end)
    assert throughput.RUNNER.fullmatch("stacked/map/K1/D2/F/T") and throughput.RUNNER.fullmatch("stacked/map/K1/F")
    assert not throughput.RUNNER.fullmatch("stacked/map/K1/T/F")


def test_conv_paths_xla_conv_has_autodiffs_gradients_inside_a_loop():
    """conv_paths' canonical-backward convolution: the same (dx, dk) as lax's autodiff, in a fori_loop too."""
    import conv_paths
    import jax
    import jax.numpy as jnp
    import numpy as np
    conv = conv_paths.make_conv_xla(2)
    ref = lambda x, k: conv_paths.conv_nhwc(x, k, 2)  # lax's convolution and its autodiff
    kx, kk = jax.random.split(jax.random.key(0))
    x, k = jax.random.normal(kx, (3, 9, 8, 2)), jax.random.normal(kk, (5, 5, 2, 4))
    loss = lambda f: (lambda x, k: jnp.sum(jnp.sin(f(x, k))))
    looped = lambda f: jax.jit(lambda x, k: jax.lax.fori_loop(
        0, 2, lambda i, c: tuple(a + b for a, b in zip(c, jax.grad(loss(f), (0, 1))(x, k))),
        (jnp.zeros_like(x), jnp.zeros_like(k))))
    for got, want in zip(looped(conv)(x, k), looped(ref)(x, k)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert float(jnp.abs(want).max()) > 1.0
    np.testing.assert_allclose(conv(x, k), ref(x, k), rtol=1e-5, atol=1e-5)


def test_conv_paths_dft_and_winograd_convolutions_are_the_convolution_and_its_gradients():
    """conv_paths' DFT and Winograd convolutions against lax's (forward, and dx, dk for a random cotangent), odd
    sizes and paddings included. Tolerance: their constant transform matrices (entries up to ~2 in Winograd's
    F(2, 5), sums over up to n1 n2 = 324 phases in the DFT) amplify float32 rounding to ~1e-6 of the output's
    scale; 2e-5 of each result's largest entry leaves room for that and fails on any wrong tap, phase or weight
    (a 0.1 % error in one transform matrix fails it)."""
    import conv_paths
    import jax
    import jax.numpy as jnp
    import numpy as np
    kx, kk = jax.random.split(jax.random.key(0))
    for shape, kshape, pad in [((2, 14, 14, 32), (5, 5, 32, 8), 2), ((3, 9, 8, 2), (5, 5, 2, 4), 2),
                               ((2, 7, 10, 3), (3, 3, 3, 4), 1), ((2, 8, 7, 2), (5, 5, 2, 3), 0)]:
        x, k = jax.random.normal(kx, shape), jax.random.normal(kk, kshape)
        ref = lambda x, k: conv_paths.conv_nhwc(x, k, pad)
        for conv in (conv_paths.conv_dft, conv_paths.conv_winograd):
            y, back = jax.vjp(lambda x, k: conv(x, k, pad), x, k)
            y_ref, back_ref = jax.vjp(ref, x, k)
            cotangent = jax.random.normal(jax.random.key(1), y_ref.shape)  # the gradients of sum(cotangent * y)
            got, want = [y, *back(cotangent)], [y_ref, *back_ref(cotangent)]
            for g, w in zip(got, want):
                assert g.shape == w.shape
                np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.abs(w).max()), rtol=0)


PEAKS = {"matmul_peak_gflops": 100.0, "copy_bandwidth_gbs": 10.0}  # (a machine's, for the bookkeeping tests)


def test_a_train_steps_cost_is_xlas_count_of_the_logreg_step_per_sample():
    # logistic regression 784 -> 10: forward x W (2 d c FLOPs a sample) and the kernel gradient x^T g (2 d c);
    # the softmax, the bias and the update add a little; no input gradient
    import numpy as np
    import roofline

    from jaxfl.models import build_model
    d, c = 784, 10
    costs = [roofline.train_step_cost(build_model("logreg", c), np.zeros((1, 28, 28, 1), np.uint8), b)
             for b in (10, 40)]
    for cost in costs:
        assert 4 * d * c <= cost["flops_per_sample"] <= 6 * d * c
        assert cost["flops"] == cost["flops_per_sample"] * cost["batch"] and cost["bytes_per_sample"] > 0
    # the weights are read once a step: their bytes spread over a larger batch
    assert costs[1]["bytes_per_sample"] < costs[0]["bytes_per_sample"]


def test_conv_paths_counts_a_whole_training_step():
    """conv_paths' FLOP count of a training step (``roofline.train_step_cost``'s) lies between 2x and 4x XLA's
    count of the forward pass alone: the backward pass is about twice the forward, SGD adds a few a weight."""
    import conv_paths
    import jax
    import jax.numpy as jnp
    import optax

    from jaxfl.algorithms._common import init_variables
    from jaxfl.core.trainer import LocalTrainer
    from jaxfl.models import build_model
    batch = 8
    flops = conv_paths.flops_per_step("femnist_cnn", batch)
    model = build_model("femnist_cnn", conv_paths.MODELS["femnist_cnn"]["classes"])
    x = jnp.zeros((batch, 28, 28, 1), jnp.float32)
    v = init_variables(model, LocalTrainer(optax.sgd(0.1), batch, 1), jax.random.key(0), x)
    fwd = jax.jit(lambda p: model.apply({"params": p}, x)).lower(v["params"]).compile().cost_analysis()
    fwd = float((fwd[0] if isinstance(fwd, (list, tuple)) else fwd)["flops"])
    assert 2.0 * fwd < flops < 4.0 * fwd, (flops, fwd)


def test_the_roofline_is_the_useful_rate_over_the_measured_peaks():
    import roofline
    cost = {"flops_per_sample": 2e6, "bytes_per_sample": 4e5}
    r = roofline.roofline(1e4, cost, PEAKS)  # 1e4 samples/s: 20 GFLOP/s, 4 GB/s
    assert r == {"gflops_per_s": 20.0, "gbytes_per_s": 4.0, "flops_fraction": 0.2, "bytes_fraction": 0.4}
    assert roofline.matmul_peak_gflops(sizes=(64,), reps=1) > 0 and roofline.copy_bandwidth_gbs(mib=1, reps=1) > 0


def test_the_seed_axis_benchmark_compares_the_same_rounds(monkeypatch):
    # one round over a seed axis (vmap) and one round per seed train the same models, unequal partitions included
    import roofline
    import seed_axis
    monkeypatch.setattr(roofline, "machine_peaks", lambda: PEAKS)
    r = seed_axis.measure("logreg", n=12, cohort=4, seeds=2, strategy="map", rounds=1, equal=False)
    assert r["seeds"] == 2 and r["sequential_s"] > 0 and r["vectorized_s"] > 0
    assert r["max_param_diff"] <= 1e-6
    # both paths did the same useful work: their FLOP rates stand as their times, inversely
    seq, vec = r["sequential_roofline"]["flops_fraction"], r["vectorized_roofline"]["flops_fraction"]
    assert abs(seq / vec - r["vectorized_s"] / r["sequential_s"]) <= 1e-9 * seq / vec


def test_the_tail_batch_benchmark_times_the_same_training_with_less_padding(monkeypatch):
    import roofline
    import tail_batches
    monkeypatch.setattr(roofline, "machine_peaks", lambda: PEAKS)
    r = tail_batches.measure("logreg", clients=40, cohort=6, reps=1)
    full, tails = r["runs"].values()
    assert tails["padded_work"] < full["padded_work"] and all(v["median_s"] > 0 for v in (full, tails))
    assert r["max_abs_param_diff"] <= 1e-5  # the same training up to float rounding (logreg weights ~1e-2)
    # the roofline counts real samples only: padding that costs time lowers it
    for v in (full, tails):
        want = r["real_samples"] / v["median_s"] * r["train_step_cost"]["flops_per_sample"] / 1e11
        assert abs(v["flops_fraction"] - want) <= 1e-9 * want


def test_the_evaluation_benchmarks_time_the_same_evaluation():
    import eval_batch
    import eval_tails
    r = eval_tails.measure("logreg", clients=12, alpha=0.3, test_samples=600, eval_batch_size=32, reps=1)
    full, tails = r["runs"].values()
    assert tails["padded_work"] < full["padded_work"] and all(v["median_s"] > 0 for v in (full, tails))
    assert r["eval_batch_size"] == 32 and r["same_accuracy"] and r["max_abs_loss_diff"] <= 1e-5
    r = eval_batch.measure("logreg", [4, 8], clients=3, per_client=8, reps=1)
    assert set(r["sizes"]) == {"4", "8"} and min(v["over_fastest"] for v in r["sizes"].values()) == 1.0
    # another algorithm's evaluation, on inputs of another shape (RFedDis: two heads and the fused prediction)
    runs = {alg: eval_batch.measure("logreg", [4], clients=2, per_client=4, reps=1, algorithm=alg, shape=(6, 6, 3))
            for alg in ("fedavg", "rfeddis")}
    # logreg on 6x6x3 inputs: 108 x 10 + 10 parameters; RFedDis holds its two MLP heads as well
    assert runs["fedavg"]["parameters"] == 1090 and runs["rfeddis"]["parameters"] > 100 * 1090
    assert runs["rfeddis"]["input_shape"] == [6, 6, 3] and runs["rfeddis"]["sizes"]["4"]["median_s_per_sample"] > 0


def test_the_vit_compile_benchmark_times_two_layouts_of_the_same_vit(tmp_path):
    import vit_compile
    out = tmp_path / "vit.json"
    vit_compile.main(["--depth", "2", "--clients", "2", "--steps", "1", "--reps", "1", "--batch", "2",
                      "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"unrolled", "scan"}
    # the same blocks, stacked on a leading axis in the scanned form: the same parameters
    assert rows["unrolled"]["parameters"] == rows["scan"]["parameters"]
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 for r in rows.values())


def test_the_scripts_refuse_bad_flags_in_one_line_before_any_work(capsys, monkeypatch):
    import backend_choice
    import compile_count
    import eval_batch
    import eval_tails
    import peer_settings
    import seed_axis
    import switch_cost
    import tail_batches
    import time_to_accuracy
    import vit_compile

    from jaxfl.run.script import run_script
    monkeypatch.setattr(sys, "argv", ["script.py"])
    cases = [(seed_axis.main, ["--workload", "nosuch"], "--workload 'nosuch': give comma-separated values from"),
             (seed_axis.main, ["--seeds", "0"], "--seeds 0: give a number >= 1"),
             (tail_batches.main, ["--reps", "0"], "--reps 0: give a number >= 1"),
             (tail_batches.main, ["--workload", "nosuch"], "--workload 'nosuch': give comma-separated values from"),
             (eval_tails.main, ["--alpha", "0"], "--alpha 0.0: give a number > 0"),
             (eval_tails.main, ["--model", "nosuch"], "--model 'nosuch': give comma-separated values from"),
             (eval_batch.main, ["--sizes", "16,48", "--per-client", "64"], "--per-client 64: give a multiple of"),
             (eval_batch.main, ["--reps", "0"], "--reps 0: give a number >= 1"),
             (eval_batch.main, ["--input-shape", "28,28"], "--input-shape '28,28': give three sizes, H,W,C"),
             (eval_batch.main, ["--algorithm", "nosuch"], "unknown algorithm 'nosuch'; valid: "),
             (switch_cost.main, ["--batch", "4"], "--batch 4: give a number >= 8"),
             (switch_cost.main, ["--model", "nosuch"], "unknown --model 'nosuch'; valid: "),
             (throughput.main, ["--strategies", "foo"], "--strategies 'foo': give comma-separated values from"),
             (throughput.main, ["--small", "--runners", "stacked/map"], "--runners: 'stacked/map' is not"),
             (gpu_suite.main, ["--out", "x", "--rounds", "0"], "--rounds 0: give a number >= 1"),
             (backend_choice.main, ["--out", "x", "--only", "nosuch"], "--only 'nosuch' matches no workload"),
             (time_to_accuracy.main, ["--lrs", "-1"], "--lrs -1.0: give a number > 0"),
             (peer_settings.main, ["--out", "x", "--settings", "nosuch"], "--settings 'nosuch': give comma-"),
             (compile_count.main, ["--out", "x", "--setting", "nosuch"], "unknown --setting 'nosuch'; valid: "),
             (compile_count.main, ["--out", "x", "--backends", "auto,foo"], "--backends 'auto,foo': give comma-"),
             (compile_count.main, ["--out", "x", "--timeout-s", "0"], "--timeout-s 0.0: give a number > 0"),
             (peer_settings.main, ["--out", "x", "--rounds", "0"], "--rounds 0: give a number >= 1"),
             (vit_compile.main, ["--depth", "0"], "--depth 0: give a number >= 1"),
             (time_to_accuracy.main, ["--out", "/no/such/folder/x.json"], "--out '/no/such/folder/x.json': give a "
                                                                          "file in an existing folder")]
    for main, argv, message in cases:
        assert run_script(main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"script.py: error: {message}"), err
    assert not Path("x").exists()


def test_compile_count_sums_a_runs_compiling_and_its_settings_are_valid_runs():
    import subprocess

    import compile_count
    hist = [{"compiled_programs": 3, "compile_s": 2.0, "time_s": 5.0, "mean_accuracy": 0.1},
            {"compiled_programs": 0, "compile_s": 0.0, "time_s": 1.0},
            {"compiled_programs": 1, "compile_s": 1.0, "time_s": 2.0, "mean_accuracy": 0.5}]
    assert compile_count.summarize(hist) == {"compiled_programs": 4, "rounds_compiling": 2, "compile_s": 3.0,
                                             "time_s": 8.0, "compile_share": 0.375, "final_mean_accuracy": 0.5}
    line = ("jaxfl: fedtp on cifar10: 10 clients, strategy map, backend ragged, 1 device, compile cache off; "
            "writing to OUT")
    assert compile_count.backend_taken(line) == "ragged" and compile_count.backend_taken("") is None
    for setting in compile_count.SETTINGS:  # each setting's command is one `jaxfl run` accepts (as on a device)
        for backend in ("auto", "ragged"):
            cmd = compile_count.run_command(setting, backend, 100, 5, "OUT", ["--print-config"])
            done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            assert ('backend = "ragged"' in done.stdout) == (backend == "ragged"), done.stdout
            assert "rounds = 100" in done.stdout and "clients_per_round = 5" in done.stdout


def test_compile_count_keeps_the_rounds_a_run_finished_before_its_time_limit(monkeypatch):
    import compile_count

    def fake_run(setting, backend, rounds, cohort, out, extra):  # two rounds logged, then a run that hangs
        rows = [{"compiled_programs": 2, "compile_s": 1.5, "time_s": 2.0},
                {"compiled_programs": 0, "compile_s": 0.0, "time_s": 0.5}]
        code = (f"import json, os, sys, time; os.makedirs({out!r})\n"
                f"f = open(os.path.join({out!r}, 'metrics.jsonl'), 'w')\n"
                f"for r in {rows!r}: f.write(json.dumps(r) + '\\n')\n"
                "f.flush(); print('jaxfl: x: strategy map, backend stacked, 1 device', file=sys.stderr, flush=True)\n"
                "time.sleep(120)")
        return ["-c", code]

    monkeypatch.setattr(compile_count, "run_command", fake_run)
    row = compile_count.run_backend("auto", 100, 5, [], "logreg_mnist", timeout_s=5)
    assert row["timed_out"] and row["rounds_done"] == 2 and row["backend_taken"] == "stacked", row
    assert row["compiled_programs"] == 2 and row["compile_s"] == 1.5 and row["time_s"] == 2.5, row


def test_peer_settings_populations_have_the_settings_shapes_and_sizes():
    import peer_settings

    from jaxfl.run.cli import command_config
    femnist = peer_settings.synthetic_population(dict(peer_settings.SETTINGS["flute_cnn_femnist"], clients=400))
    assert femnist.num_clients == 400 and femnist.x.shape[1:] == (28, 28, 1)
    assert abs(femnist.counts.mean() / 197.5 - 1) < 0.1 and femnist.y.max() < 62
    cifar = peer_settings.synthetic_population(dict(peer_settings.SETTINGS["pfl_cifar10"], clients=20))
    assert (cifar.counts == 50).all() and cifar.x.shape == (1000, 32, 32, 3)
    # the LR-MNIST setting is a valid `jaxfl run` command with FLUTE's numbers
    cfg = command_config(["run", *peer_settings.SETTINGS["flute_lr_mnist"]["cli"]])
    assert (cfg.num_clients, cfg.clients_per_round, cfg.batch_size, cfg.lr, cfg.rounds) == (1000, 10, 10, 0.03, 100)
    # ... and its roofline is costed for the model and batch the command runs
    lr_mnist = peer_settings.SETTINGS["flute_lr_mnist"]
    assert (cfg.model, cfg.batch_size, cfg.lr) == (lr_mnist["model"], lr_mnist["batch"], lr_mnist["lr"])


def test_a_synthetic_peer_setting_reports_the_roofline_of_its_real_samples(monkeypatch):
    import peer_settings
    import roofline
    monkeypatch.setattr(roofline, "machine_peaks", lambda: PEAKS)
    setting = dict(peer_settings.SETTINGS["pfl_cifar10"], clients=12, cohort=3, rounds=4)
    r = peer_settings.run_synthetic(setting, rounds=2)
    assert r["samples_per_s"] * r["round_s"] == pytest.approx(3 * 50)  # 3 clients of 50 images a round
    want = r["samples_per_s"] * r["train_step_cost"]["flops_per_sample"] / 1e11
    assert r["flops_fraction"] == pytest.approx(want) and r["projected"]


def test_the_robust_cost_benchmark_times_each_rule_beside_a_baseline_checkout(capsys):
    # the baseline is this checkout itself: every rule gets both columns, the same functions
    import robust_cost
    robust_cost.main(["--rows", "7", "--dim", "5", "--repeats", "1", "--baseline", str(Path(__file__).parents[1])])
    table = capsys.readouterr().out
    for name in ["mean", *robust_cost.RULES]:
        assert f"| {name} |" in table
    assert table.count("|") > 6 * len(robust_cost.RULES)


def test_step_profile_names_the_operations_of_a_step_with_their_shapes():
    import step_profile
    assert step_profile.op_shapes("  %dot.20 = f32[800,64]{1,0} dot(%a, %b)\n  ROOT %t = (f32[2]{0}) tuple()") == \
        {"dot.20": "f32[800,64]"}
    res = step_profile.profile("logreg", batch=4, steps=2, reps=1, shape=(4, 4, 1), classes=3)
    assert res["step_s"] > 0 and res["ops"], res
    assert not any(step_profile.WRAPPERS.match(op["name"]) for op in res["ops"])
    assert any(op["shape"].startswith("f32[") for op in res["ops"])  # the operations are the compiled module's


def test_step_profile_refuses_bad_input_in_one_line(capsys):
    import step_profile

    from jaxfl.run.script import run_script
    for argv, said in ((["--shape", "28,x,1"], "--shape '28,x,1': give one input's shape as integers H,W,C"),
                       (["--model", "small_cnn", "--shape", "8,8,1"], "--model small_cnn has state besides")):
        assert run_script(step_profile.main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_rows_buffer_times_kept_and_new_rows_alternated(capsys):
    import rows_buffer

    from jaxfl.run.script import run_script
    res = rows_buffer.compare("logreg:20:4", k=2, calls=3)
    assert len(res["kept"]["round_s"]) == len(res["new"]["round_s"]) == 3
    assert res["new_over_kept"] == res["new"]["median_s"] / res["kept"]["median_s"] > 0
    assert run_script(rows_buffer.main, ["--calls", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calls" in err[0], err


def test_op_sources_names_what_a_fusion_computes():
    from step_profile import op_sources
    hlo = """%fused_computation.1 (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %a = f32[4]{0} add(%p0, %p0), metadata={op_name="jit(f)/while/body/transpose(jvp(M))/enc/conv2/pad"}
  %b = f32[4]{0} add(%a, %a), metadata={op_name="jit(f)/while/body/transpose(jvp(M))/enc/conv2/add_any"}
  ROOT %c = f32[4]{0} select(%a, %b, %b), metadata={op_name="jit(f)/while/body/transpose(jvp(M))/enc/select_n"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %add_fusion.3 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/x"}
  ROOT %dot.7 = f32[4]{0} dot(%add_fusion.3, %x), metadata={op_name="jit(f)/while/body/jvp(M)/enc/conv1/dot_general"}
}
"""
    src = op_sources(hlo)
    assert src["add_fusion.3"] == "transpose(jvp(M))/enc/conv2 x2; transpose(jvp(M))/enc x1"
    assert src["dot.7"] == "jvp(M)/enc/conv1 x1" and "x" not in src


def test_round_profile_counts_each_operation_per_round_with_its_shape(capsys):
    import round_profile

    from jaxfl.run.script import run_script
    res = round_profile.profile("logreg:20:4", rounds=2, tails=False)
    assert res["round_s"] > 0 and res["ops"], res
    # the aggregation's reductions run once a round; the local steps' operations once per step of the cohort
    assert any(op["per_round"] == 1 for op in res["ops"]), res["ops"]
    assert max(op["per_round"] for op in res["ops"]) >= res["cohort"]
    assert any(op["shape"].startswith("f32[") for op in res["ops"])  # read off the compiled round
    # what each operation computes: the scopes jax named (the model's forward and backward passes among them)
    assert any("jvp(" in op["computes"] for op in res["ops"]), [op["computes"] for op in res["ops"]]
    assert run_script(round_profile.main, ["--plan", "logreg:20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plan 'logreg:20': give NAME:CLIENTS:COHORT" in err[0], err
