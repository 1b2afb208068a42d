"""Fault injection through the CLI: SIGTERM, SIGINT and SIGKILL delivered at every fail point of a ``--seeds``
sweep (``jaxfl.run.signals.FAILPOINTS``: loading, the start of training, a round's call, evaluation, a
checkpoint, the summary, the plot, the gap between seeds), each followed by the sweep's resume command.

What must hold at every point: a stop signal ends the process with 128 + the signal and one ``jaxfl:`` line
naming where it stopped and the command that continues (never a traceback); a kill leaves the folder in a
state that command accepts; and after it, every seed's log and summary are those of an uninterrupted sweep,
bit for bit (the timing fields aside). Adding a fail point to ``FAILPOINTS`` adds its cases here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxfl.run.checkpoint import run_state
from jaxfl.run.cli import main
from jaxfl.run.signals import FAILPOINT_ENV, FAILPOINTS

SWEEP = ["run", "--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40",
         "--batch-size", "16", "--test-per-client", "30", "--lr", "0.05", "--rounds", "2", "--checkpoint-every", "1",
         "--seeds", "0,1"]
JAXFL = [sys.executable, "-m", "jaxfl.run.cli"]
TIMING = ("time_s", "compile_s", "compiled_programs", "compiled_shapes", "host_share")
EXIT = {"TERM": 143, "INT": 130, "KILL": -9}


def outcome(root: Path) -> dict:
    """Each seed's metric records (timing fields aside) and summary."""
    seeds = {}
    for seed in ("seed0", "seed1"):
        records = [json.loads(line) for line in (root / seed / "metrics.jsonl").read_text().splitlines()]
        seeds[seed] = ([{k: v for k, v in r.items() if k not in TIMING} for r in records],
                       json.loads((root / seed / "summary.json").read_text()))
    return seeds


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    assert main(SWEEP + ["--out", str(root)]) == 0
    return outcome(root)


@pytest.mark.parametrize("point", FAILPOINTS)
@pytest.mark.parametrize("sig", ["TERM", "INT", "KILL"])
def test_a_signal_at_each_point_ends_in_one_line_and_the_resume_equals_an_uninterrupted_sweep(
        tmp_path, uninterrupted, point, sig):
    root = tmp_path / "sweep"
    proc = subprocess.run(JAXFL + SWEEP + ["--out", str(root)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, FAILPOINT_ENV: f"{point}:{sig}"})
    assert proc.returncode == EXIT[sig], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    started = any(root.glob("seed*/config.json"))  # a seed's saved settings: what a resume continues from
    if sig != "KILL":
        lines = [line for line in proc.stderr.splitlines() if line.startswith("jaxfl:")]
        assert len(lines) == 1, proc.stderr
        # the way on that the line names: the resume command (settings saved), or the command itself (none were)
        way = (f"; continue with jaxfl run --out {root} --seeds 0,1 --resume" if started
               else "; no seed had started, nothing was written: run the command again")
        assert lines[0].endswith(way), lines[0]
    for seed in ("seed0", "seed1"):  # never a folder that neither a new run nor a resume accepts
        assert run_state(root / seed) in ("new", "started", "resumable")
    # the way on, as the line gives it: the resume command alone (the settings come from the saved config.json),
    # or the sweep's command itself
    way_on = ["run", "--quiet", "--out", str(root), "--seeds", "0,1", "--resume"] if started else SWEEP + [
        "--out", str(root)]
    assert main(way_on) == 0
    assert outcome(root) == uninterrupted


@pytest.mark.parametrize("point", ["summary", "plot"])
def test_a_stop_during_a_single_runs_last_writes_lets_them_finish_and_says_so(tmp_path, point):
    out = tmp_path / "run"
    single = [a for a in SWEEP if a not in ("--seeds", "0,1")] + ["--out", str(out)]
    proc = subprocess.run(JAXFL + single, capture_output=True, text=True, timeout=600,
                          env={**os.environ, FAILPOINT_ENV: f"{point}:INT"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("jaxfl: SIGINT arrived as the run finished; "
                                                    "it is complete and written")
    assert (out / "summary.json").is_file() and (out / "accuracy.png").is_file()


def test_a_second_stop_signal_is_not_swallowed(tmp_path):
    # the first SIGINT is recorded, a second acts as it would have: here the fail point sends one at loading and
    # the test another at once; the process must end, not train on
    root = tmp_path / "sweep"
    # (SIGINT as a shell starts a process: a test earlier in the same pytest worker may leave it ignored, and a
    # child inherits an ignored signal, so the second one would be ignored as the previous handler says)
    code = ("import os, signal, sys, threading; from jaxfl.run import signals; from jaxfl.run.cli import main\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "real = signals.failpoint\n"
            "def twice(name):\n"
            "    real(name)\n"
            "    if name == 'load': signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
            "signals.failpoint = twice\n"
            "sys.modules['jaxfl.run.cli'].failpoint = twice\n"
            f"sys.exit(main({SWEEP + ['--out', str(root)]!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, FAILPOINT_ENV: "load:INT"})
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    assert not (root / "seed0" / "metrics.jsonl").exists()
