"""The client axis sharded over 2 (and, for FedAvg, 4) virtual CPU devices gives the single-device results (the device
count must be set before jax starts, so the check runs in its own process: tests/sharding_check.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxfl.core.distributed import client_mesh


def test_sharded_rounds_equal_single_device_rounds():
    script = Path(__file__).with_name("sharding_check.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8 and all(line.endswith("equal") for line in lines), out.stdout


def test_mesh_asks_for_available_devices():
    with pytest.raises(ValueError, match="num_devices=99"):
        client_mesh(99)
