"""tools/slow_tests.py: the fast tier's list, from a full run's durations."""
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "slow_tests.py"
spec = importlib.util.spec_from_file_location("slow_tests", TOOL)
slow_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slow_tests)

REPORT = """============================= slowest durations =============================
12.50s call     tests/test_a.py::test_big[x]
2.00s setup    tests/test_a.py::test_big[x]
0.10s teardown tests/test_a.py::test_big[x]
3.00s call     tests/test_a.py::test_small
9.00s call     tests/test_b.py::test_only
1.00s call     tests/test_c.py::test_one
0.50s call     tests/test_c.py::test_two
"""


def test_durations_sum_the_phases_of_each_test():
    times = slow_tests.durations(REPORT)
    assert times["tests/test_a.py::test_big[x]"] == 14.6
    assert len(times) == 5


def test_the_slowest_go_first_and_every_module_keeps_its_fastest_test():
    times = slow_tests.durations(REPORT)  # 14.6 + 3 + 9 + 1 + 0.5 = 28.1 s
    assert slow_tests.slow_set(times, budget=28.1) == []
    assert slow_tests.slow_set(times, budget=14.0) == ["tests/test_a.py::test_big[x]"]
    # test_b's only test and test_a's and test_c's fastest stay, whatever the budget
    assert slow_tests.slow_set(times, budget=0.0) == ["tests/test_a.py::test_big[x]", "tests/test_c.py::test_one"]


def test_the_run_options_reference_is_what_the_declarations_generate():
    # docs/reference/run_options.md is generated (tools/run_options_reference.py) from jaxfl.run.config's groups;
    # an option added, removed or re-documented without regenerating it fails here
    spec = importlib.util.spec_from_file_location("run_options_reference",
                                                  TOOL.with_name("run_options_reference.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.OUT.read_text() == tool.reference(), "run: python tools/run_options_reference.py"


def test_the_algorithm_reference_is_what_the_registry_generates():
    # docs/reference/algorithms.md is generated (tools/algorithm_reference.py); an option, a sharing note or a
    # Deviations item changed without regenerating it fails here
    spec = importlib.util.spec_from_file_location("algorithm_reference", TOOL.with_name("algorithm_reference.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.OUT.read_text() == tool.reference(), "run: python tools/algorithm_reference.py"
    assert tool.deviations("x\n\nDeviations:\n- a\n  b\n- c\n\nmore") == ["a b", "c"]
    assert tool.allowed({"lo": 0.0, "hi": 1.0, "lo_open": True}) == "(0, 1]" and tool.allowed({"minimum": 1}) == ">= 1"


def _import_logs_tool():
    spec = importlib.util.spec_from_file_location("import_logs", TOOL.with_name("import_logs.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _run_folder(root, config):
    import json
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "metrics.jsonl").write_text('{"round": 1, "acc": 0.5}\n')


def test_import_logs_strips_machine_paths_and_compacts(tmp_path):
    import gzip
    import json
    tool = _import_logs_tool()
    official = tmp_path / "official" / "FedTP"
    _run_folder(tmp_path / "src" / "seed2" / "vanilla",
                {"official_repo": str(official), "data": str(tmp_path / "data") + "/cifar10.npz",
                 "out": str(tool.REPO / "runs" / "x"), "nested": [{"root": str(official / "models")}], "lr": 0.01})
    (tmp_path / "src" / "seed2" / "vanilla" / "checkpoints").mkdir()  # not copied
    written = tool.import_logs(tmp_path / "src", tmp_path / "dst", strip=[f"{tmp_path}/data=$JAXFL_DATA_DIR"],
                               environ={"FEDTP_OFFICIAL": str(official)})
    target = tmp_path / "dst" / "seed2" / "vanilla"
    assert written == [target]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "metrics.jsonl.gz"]
    config = json.loads((target / "config.json").read_text())
    assert config == {"official_repo": "$FEDTP_OFFICIAL", "data": "$JAXFL_DATA_DIR/cifar10.npz", "out": "runs/x",
                      "nested": [{"root": "$FEDTP_OFFICIAL/models"}], "lr": 0.01}
    assert gzip.decompress((target / "metrics.jsonl.gz").read_bytes()) == b'{"round": 1, "acc": 0.5}\n'


def test_import_logs_refuses_a_path_left_or_a_run_already_there_before_writing(tmp_path, capsys):
    tool = _import_logs_tool()
    _run_folder(tmp_path / "src" / "a", {"out": "runs/a"})
    _run_folder(tmp_path / "src" / "b", {"data": "/somewhere/else/data.npz"})
    assert tool.main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert "'/somewhere/else/data.npz'" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()  # the good run 'a' was not written either
    assert tool.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--strip", "/somewhere/else=$DATA"]) == 0
    assert tool.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--strip", "/somewhere/else=$DATA"]) == 2
    assert "already holds a run" in capsys.readouterr().err
