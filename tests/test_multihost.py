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
