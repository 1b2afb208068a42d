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
