"""A two-process run on localhost (jax.distributed, gloo collectives, 1 CPU device per process, each process
holding only its clients' rows) equals the one-process run: tests/multihost_check.py."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxfl.core import distributed
from jaxfl.errors import ConfigError


SCRIPT = Path(__file__).with_name("multihost_check.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(num_processes: int, out: Path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(i), str(num_processes), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(num_processes)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return np.load(out / f"result_{num_processes}.npz")


def test_two_processes_equal_one_process(tmp_path):
    one, two = launch(1, tmp_path), launch(2, tmp_path)
    assert sorted(one.files) == sorted(two.files)
    for key in one.files:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-5, err_msg=key)
    # both processes checkpointed into one folder; process 0 alone wrote the log
    assert (tmp_path / "fedbn_2" / "checkpoints" / "2").is_dir()
    assert len((tmp_path / "fedbn_2" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(coordinator_address="localhost:1", num_processes=0, process_id=0), "num_processes=0"),
    (dict(coordinator_address="localhost:1", num_processes=2, process_id=2), r"process_id=2 must be in \[0, 2\)"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), "host:port"),
])
def test_initialize_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        distributed.initialize(**kwargs)


def test_cli_rejects_bad_process_id(capsys):
    from jaxfl.run.cli import main
    assert main(["run", "--num-processes", "2", "--process-id", "5", "--coordinator-address", "localhost:1"]) == 2
    assert "process_id=5 must be in [0, 2)" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--process-id", "1"], "--process-id is for a run of several processes; add --num-processes N"),
    (["--coordinator-address", "localhost:1"], "--coordinator-address is for a run of several processes"),
    (["--num-processes", "-1"], "num_processes=-1 must be >= 1"),
    (["--num-processes", "2", "--coordinator-address", "localhost:1"], "process_id=None must be in [0, 2)"),
    # refused before joining the other process (which it would otherwise wait for)
    (["--num-processes", "2", "--process-id", "0", "--coordinator-address", "localhost:1", "--devices", "0",
      "--rounds", "0"], "rounds=0"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator-address", "localhost:1", "--devices", "1"],
     "--num-processes 2: a run over several processes splits the clients over all of their devices; drop --devices 1 "
     "(or give 0)"),
])
def test_cli_refuses_launch_options_it_would_ignore_or_hang_on(args, message, tmp_path, capsys):
    from jaxfl.run.cli import main
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_processes_started_with_other_options_are_refused(tmp_path):
    port = str(free_port())
    code = "import sys; from jaxfl.run.cli import main; raise SystemExit(main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, "run", "--quiet", "--out", str(tmp_path / "run"),
                               "--devices", "0", "--num-processes", "2", "--process-id", str(i),
                               "--coordinator-address", f"localhost:{port}", "--lr", lr],
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
             for i, lr in enumerate(("0.01", "0.5"))]
    errs = [p.communicate(timeout=300)[1].strip().splitlines() for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs[1] == ["jaxfl: error: process 1 was started with other options than process 0: lr (0.5 here, 0.01 in "
                       "process 0); start every process with the same options"]
    assert errs[0] == ["jaxfl: error: process(es) 1 were started with other options than this one (see their error "
                       "line); start every process with the same options"]
    assert not (tmp_path / "run").exists()
