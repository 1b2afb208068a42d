"""Runs that survive faults: one writer per run folder, damaged checkpoints, a full disk, SIGTERM.

Each fault must end in one line (never a traceback), leave the log clean, and resume bit-identically."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_trees_close

from jaxfl.run.checkpoint import run_state
from jaxfl.run.cli import main
from jaxfl.run.config import RunConfig
from jaxfl.run.lock import LOCK_NAME, RunLock, holder
from jaxfl.run.runner import Experiment

TINY = dict(dataset="default", model="small_cnn", image_size=12, samples_per_client=40, test_per_client=30,
            batch_size=16, eval_batch_size=32, lr=0.05)
CLI = ["run", "--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40",
       "--batch-size", "16", "--test-per-client", "30", "--lr", "0.05"]
JAXFL = [sys.executable, "-m", "jaxfl.run.cli"]  # the `jaxfl` command (its entry point)


def rounds_logged(out: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted():
    """Final states and records of uninterrupted runs of 1..5 rounds (one run each, computed on demand)."""
    cache = {}

    def get(rounds):
        if rounds not in cache:
            cache[rounds] = Experiment(RunConfig(rounds=rounds, **TINY)).run()
        return cache[rounds]
    return get


def assert_same_run(result, reference):
    assert_trees_close(result.server, reference.server, atol=0, rtol=0)
    assert_trees_close(result.clients, reference.clients, atol=0, rtol=0)
    assert [h["test_accuracy"] for h in result.history] == [h["test_accuracy"] for h in reference.history]


def test_a_locked_folder_is_refused_with_the_holders_pid_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "run"
    holder_code = (f"import sys, time; from jaxfl.run.lock import RunLock; lock = RunLock({str(out)!r}); "
                   "print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert holder(out) == str(proc.pid)
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert main(CLI + ["--rounds", "1", "--out", str(out)] + extra) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"jaxfl: error: --out {str(out)!r} is in use by another jaxfl run (pid {proc.pid}); "
                           f"wait for it to finish or choose another folder"]
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        proc.kill()
        proc.wait()
    # the holder died without releasing: its lock never blocks
    assert holder(out) is None
    assert main(CLI + ["--rounds", "1", "--out", str(out)]) == 0
    assert rounds_logged(out) == [1]
    with RunLock(out):  # released when the run ended
        pass


def test_two_runs_started_into_one_folder_at_once_leave_one_clean_log(tmp_path):
    out = tmp_path / "run"
    cmd = JAXFL + CLI + ["--rounds", "3", "--checkpoint-every", "1", "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    refused = next(err for rc, err in results if rc == 2).strip().splitlines()
    # the loser either found the folder locked or (if it came late) a finished run in it
    assert len(refused) == 1 and refused[0].startswith("jaxfl: error: --out "), refused
    assert "in use by another jaxfl run (pid" in refused[0] or "is not empty" in refused[0]
    assert rounds_logged(out) == [1, 2, 3]


def _damage(step_dir: Path) -> None:
    """Truncate the step's largest file (a write cut off by a crash or a full disk)."""
    big = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 3])


def test_a_damaged_latest_checkpoint_falls_back_to_the_intact_one_and_resumes_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    Experiment(RunConfig(rounds=3, out=str(out), checkpoint_every=1, **TINY)).run()
    ckpts = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 3]  # the last two are kept
    _damage(ckpts / "3")
    notices = []
    resumed = Experiment(RunConfig(rounds=4, out=str(out), checkpoint_every=1, resume=True, **TINY)).run(
        notify=notices.append)
    assert len(notices) == 1 and notices[0].startswith("checkpoint(s) of round 3 in ")
    assert notices[0].endswith("do not restore") or "resuming from round 2, the intact one before" in notices[0]
    assert_same_run(resumed, uninterrupted(4))
    assert rounds_logged(out) == [1, 2, 3, 4]  # round 3's record was dropped and redone once

    # every checkpoint damaged: one line, exit 2, the log untouched
    for step in (3, 4):
        _damage(ckpts / str(step))
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(Exception) as e:
        Experiment(RunConfig(rounds=5, out=str(out), resume=True, **TINY)).run()
    assert type(e.value).__name__ == "ConfigError" and "restores (round 4:" in str(e.value)
    assert (out / "metrics.jsonl").read_text() == before


def test_a_checkpoint_whose_arrays_changed_is_not_trusted(tmp_path, uninterrupted):
    out = tmp_path / "run"
    Experiment(RunConfig(rounds=2, out=str(out), checkpoint_every=1, **TINY)).run()
    digests = json.loads((out / "checkpoints" / "digests.json").read_text())
    assert sorted(digests) == ["1", "2"] and all(len(d) == 64 for d in digests.values())
    digests["2"] = "0" * 64  # as if round 2's arrays had been altered after they were written
    (out / "checkpoints" / "digests.json").write_text(json.dumps(digests))
    notices = []
    resumed = Experiment(RunConfig(rounds=2, out=str(out), checkpoint_every=1, resume=True, **TINY)).run(
        notify=notices.append)
    assert len(notices) == 1 and "do not match the digest" in notices[0] and "resuming from round 1" in notices[0]
    assert_same_run(resumed, uninterrupted(2))


def test_a_full_disk_while_checkpointing_stops_with_one_line_and_stays_resumable(tmp_path, uninterrupted):
    out = tmp_path / "run"
    Experiment(RunConfig(rounds=2, out=str(out), checkpoint_every=1, **TINY)).run()
    log_before = (out / "metrics.jsonl").read_text()
    # files may grow to 6 KiB: the log, config and a checkpoint's metadata fit, its arrays (~12 KiB) do not, as
    # when a disk fills up; the limit is set in the child before it imports anything (RLIMIT_FSIZE)
    limited = [sys.executable, "-c", "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (6144, 6144)); "
               "from jaxfl.run.cli import entry; entry()"]
    # (no compile cache: the child compiles programs of its own device count, whose cache entries would not fit)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.run(limited + ["run", "--quiet", "--resume", "--out", str(out), "--rounds", "4",
                                     "--compile-cache", "none"], capture_output=True, text=True, timeout=600, env=env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(err) == 1 and err[0].startswith(f"jaxfl: error: cannot write {str(out / 'checkpoints')!r} in round 3: "
                                               f"[Errno 27] File too large; "), err[0]
    assert err[0].endswith(f"the log and the checkpoint of round 2 are intact; free space or fix the error, then "
                           f"continue with jaxfl run --out {out} --resume"), err[0]
    assert (out / "metrics.jsonl").read_text().startswith(log_before)
    resumed = Experiment(RunConfig(rounds=4, out=str(out), checkpoint_every=1, resume=True, **TINY)).run()
    assert_same_run(resumed, uninterrupted(4))
    assert rounds_logged(out) == [1, 2, 3, 4]


def test_sigterm_stops_after_a_round_with_one_line_and_resumes_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.Popen(JAXFL + CLI + ["--rounds", "200", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.is_file() and log.read_text().count("\n") >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    stopped = err.strip().splitlines()[-1]
    n = int(stopped.split("stopped at round ")[1].split(";")[0])
    assert stopped == f"jaxfl: stopped at round {n}; continue with jaxfl run --out {out} --resume"
    assert "Traceback" not in err and 1 <= n < 200, err
    assert rounds_logged(out) == list(range(1, n + 1))
    # the stop checkpointed round n although --checkpoint-every is 0
    resumed = Experiment(RunConfig(rounds=n + 1, out=str(out), resume=True, **TINY)).run()
    assert_same_run(resumed, uninterrupted(n + 1))
    assert rounds_logged(out) == list(range(1, n + 2))
    assert json.loads((out / "summary.json").read_text())["last"]["round"] == n + 1


def test_a_run_stopped_before_its_first_checkpoint_starts_again_under_resume(tmp_path, uninterrupted, capsys):
    # a run killed after round 1 was logged but before its first checkpoint: config.json and one record, no
    # checkpoint. A plain re-run names --resume; --resume starts it again from round 0 with its saved config,
    # saying so in one line, and ends as an uninterrupted run
    out = tmp_path / "run"
    assert main(CLI + ["--rounds", "2", "--out", str(out), "--checkpoint-every", "5"]) == 0
    for name in ("checkpoints", "summary.json", "accuracy.png"):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert run_state(out) == "started"
    capsys.readouterr()
    assert main(CLI + ["--rounds", "2", "--out", str(out)]) == 2
    assert "is not empty; pass --resume to continue its run" in capsys.readouterr().err
    assert main(CLI + ["--rounds", "2", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "starting again from round 0 with its saved config" in err
    assert "Traceback" not in err and rounds_logged(out) == [1, 2]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_accuracy"] for r in records] == [h["test_accuracy"] for h in uninterrupted(2).history]
    assert run_state(out) == "resumable"


@pytest.mark.parametrize("fault,message", [
    ("missing", "config.json' is missing, so the checkpoints in"),
    ("damaged", "config.json' is not valid JSON"),
    ("newer", "has settings this jaxfl does not know (['from_the_future']): it was written by another version"),
])
def test_resume_names_a_missing_damaged_or_newer_config_and_never_advises_overwrite(tmp_path, capsys, fault,
                                                                                      message):
    out = tmp_path / "run"
    Experiment(RunConfig(rounds=1, out=str(out), checkpoint_every=1, **TINY)).run()
    saved = out / "config.json"
    if fault == "missing":
        saved.unlink()
    elif fault == "damaged":
        saved.write_text(saved.read_text()[:-20])
    else:
        saved.write_text(json.dumps(dict(json.loads(saved.read_text()), from_the_future=1)))
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(CLI + ["--rounds", "2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in " ".join(err[0].split()) and "--overwrite" not in err[0], err
    assert (out / "metrics.jsonl").read_text() == before and run_state(out) == "resumable"


def test_a_sweep_resume_starts_again_a_seed_stopped_before_its_first_checkpoint(tmp_path, capsys):
    root = tmp_path / "sweep"
    flags = CLI + ["--checkpoint-every", "1", "--out", str(root)]
    assert main(flags + ["--seeds", "0,1", "--rounds", "1"]) == 0
    stopped = root / "seed1"  # as if killed while compiling its first round: config.json and an empty log
    for name in ("checkpoints", "summary.json", "accuracy.png"):
        path = stopped / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (stopped / "metrics.jsonl").write_text("")
    assert run_state(stopped) == "started" and run_state(root / "seed0") == "resumable"
    capsys.readouterr()
    assert main(flags + ["--seeds", "0,1", "--rounds", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("starting again from round 0") == 1 and "Traceback" not in err
    assert rounds_logged(root / "seed0") == rounds_logged(stopped) == [1, 2]


def test_a_sweep_resume_needs_a_started_sweep_whose_settings_are_saved(tmp_path, capsys):
    # as for one run: no folder, or no seed that saved its config.json, is no sweep to continue (a resume would
    # have nothing but its flags: the defaults for every setting not given)
    flags = CLI + ["--seeds", "0,1", "--rounds", "1", "--resume"]
    assert main(flags + ["--out", str(tmp_path / "none")]) == 2
    assert "--resume: " + repr(str(tmp_path / "none")) + " does not exist: no sweep to continue" in \
        capsys.readouterr().err
    (tmp_path / "empty" / "seed0").mkdir(parents=True)
    assert main(flags + ["--out", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no seed in" in err and "has started (no seed<S>/config.json)" in err and "drop --resume" in err
    assert not any((tmp_path / "empty").rglob("*.json"))  # nothing written


def test_a_failed_first_checkpoint_names_the_resume_that_starts_the_run_again(tmp_path, capsys, monkeypatch):
    # the first checkpoint cannot be written (disk full): one line naming --resume, which restarts from round 0
    from jaxfl.run import checkpoint

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.Checkpointer, "save", full)
    out = tmp_path / "r"
    assert main(CLI + ["--rounds", "2", "--checkpoint-every", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint was written yet" in err[0], err
    assert err[0].endswith(f"continue with jaxfl run --out {out} --resume (it starts again from round 0 with the "
                           f"saved config)")
    monkeypatch.undo()
    assert main(CLI + ["--rounds", "2", "--checkpoint-every", "1", "--out", str(out), "--resume"]) == 0
    assert rounds_logged(out) == [1, 2]
