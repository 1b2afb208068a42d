"""The client axis sharded over 2 (and, for FedAvg, 4) virtual CPU devices gives the single-device results (the device
count must be set before jax starts, so the check runs in its own process: tests/sharding_check.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxfl.core.distributed import client_mesh, cpu_cores, use_cpu_devices


def test_sharded_rounds_equal_single_device_rounds():
    script = Path(__file__).with_name("sharding_check.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 18 and all(line.endswith("equal") for line in lines), out.stdout


def test_client_map_carries_its_mesh():
    """The mesh is part of the ``ClientMap`` value: ``on`` and ``client_map(..., mesh=)`` keep the map and its
    settings, ``devices`` counts the mesh, ``place`` and ``replicate`` put rows and the server on it, and ``over``
    on a one-device mesh (``shard_map``) gives what the map gives without one (the same program per device)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxfl.core.cohort import Chunked, Map, Vmap, client_map
    mesh = client_mesh(1)
    assert Vmap().devices == 1 and Vmap().mesh is None
    assert Chunked(3).on(mesh) == Chunked(3, mesh=mesh) and Chunked(3).on(mesh).size == 3
    assert client_map("chunked", 5, mesh=mesh) == Chunked(5, mesh=mesh)
    assert client_map(Map(), mesh=mesh).mesh is mesh and client_map(Map(mesh=mesh)).mesh is mesh
    assert client_map("map", mesh=mesh).devices == 1 and Vmap(mesh=mesh) != Vmap()
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    placed = Vmap(mesh=mesh).place(rows)
    assert placed.sharding.spec == jax.sharding.PartitionSpec("clients")
    assert Vmap(mesh=mesh).replicate(jnp.ones(2)).sharding.is_fully_replicated
    assert Vmap().replicate(rows) is rows and len(Vmap().place(rows).sharding.device_set) == 1

    def fn(shared, x, n, bound=None):
        return shared * x.sum() + n + (0 if bound is None else bound)
    n = jnp.array([1, 4, 2, 3])
    for m in (Vmap(), Map(), Chunked(3)):
        want = m.over(fn, bound_arg=1)(2.0, placed, n)
        got = jax.jit(m.on(mesh).over(fn, bound_arg=1))(2.0, placed, n)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mesh_asks_for_available_devices():
    with pytest.raises(ValueError, match="num_devices=99"):
        client_mesh(99)


@pytest.mark.skipif(cpu_cores() < 2, reason="needs 2 cores")
def test_cli_devices_makes_one_cpu_device_per_core_and_resumes_exactly(tmp_path):
    """``jaxfl run --devices 2`` on a CPU asks jax for 2 CPU devices before it starts (a fresh process: with one
    device it would stop at "devices=2: jax started before this run with 1 CPU device(s)") and trains on both (the
    stacked backend: the population on both devices); a run stopped after round 2 and resumed to 3 logs what an
    uninterrupted run logs, bit for bit. That 2 devices log what one logs (1e-5) is checked by sharding_check.py."""
    flags = ["run", "--algorithm", "fedbn", "--model", "small_cnn", "--samples-per-client", "40",
             "--test-per-client", "20", "--clients-per-domain", "2", "--batch-size", "16", "--quiet",
             "--devices", "2", "--checkpoint-every", "1"]
    code = (f"import sys; from jaxfl.run.cli import main; f = {flags!r}; "
            f"sys.exit(main(f + ['--rounds', '2', '--out', sys.argv[1]]) or main(f + ['--rounds', '3', '--out', "
            f"sys.argv[1], '--resume']) or main(f + ['--rounds', '3', '--out', sys.argv[2]]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "resumed"), str(tmp_path / "whole")],
                         capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("resumed", "whole")}
    assert [r["round"] for r in logs["resumed"]] == [1, 2, 3]
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["devices"] == 2
    for a, b in zip(logs["resumed"], logs["whole"]):
        assert a["train_loss"] == b["train_loss"] and a["test_accuracy"] == b["test_accuracy"]


def test_use_cpu_devices_only_before_jax_starts_and_up_to_the_cores():
    jax.devices()  # this process's backends have started
    assert not use_cpu_devices(2)
    assert not use_cpu_devices(cpu_cores() + 1) and not use_cpu_devices(1)
    assert jax.device_count() == 1


def test_stacked_backend_is_one_process_only(monkeypatch):
    from jaxfl.errors import ConfigError
    from jaxfl.run.config import RunConfig
    from jaxfl.run.build import choose_backend
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for backend in ("stacked", "streamed"):
        with pytest.raises(ConfigError, match=f"backend={backend} runs within one process; a run over 2 processes "
                                              f"needs --backend ragged"):
            choose_backend(RunConfig(backend=backend), None, None, None)
    assert choose_backend(RunConfig(), None, None, None) == "ragged"


def test_resolve_devices_takes_the_most_devices_that_divide_the_cohort(monkeypatch):
    from jaxfl.run import build
    monkeypatch.setattr(jax, "local_device_count", lambda: 4)
    monkeypatch.setattr(build, "platform", lambda: "cpu")
    assert [build.resolve_devices(None, c, "fixed") for c in (3, 6, 8, 10, 12)] == [3, 3, 4, 2, 4]
    assert build.resolve_devices(None, 7, "fixed") == 1 and build.resolve_devices(None, 7, "poisson") == 4
    assert build.resolve_devices(1, 8, "fixed") == 1 and build.resolve_devices(0, 8, "fixed") == 0  # given
    # pFedGP's LAPACK calls on two CPU devices at once deadlock: it stays on one
    from jaxfl.algorithms import REGISTRY
    assert not REGISTRY["pfedgp"].options.cpu_device_split and REGISTRY["fedavg"].options.cpu_device_split
    assert build.resolve_devices(None, 8, "fixed", cpu_split=False) == 1
    monkeypatch.setattr(build, "platform", lambda: "gpu")
    assert build.resolve_devices(None, 8, "fixed") == 1  # an accelerator: one device unless asked


@pytest.mark.skipif(cpu_cores() < 2, reason="needs 2 cores")
def test_a_cpu_run_without_devices_splits_an_even_cohort_over_the_cores(tmp_path):
    flags = ["run", "--algorithm", "fedavg", "--model", "small_cnn", "--samples-per-client", "40", "--rounds", "1",
             "--test-per-client", "20", "--clients-per-domain", "2", "--batch-size", "16", "--out", str(tmp_path / "r")]
    out = subprocess.run([sys.executable, "-m", "jaxfl.run.cli"] + flags, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cores = max(d for d in range(1, cpu_cores() + 1) if 6 % d == 0)  # 6 clients a round
    assert f", {cores} devices," in out.stderr.splitlines()[0], out.stderr
    assert json.loads((tmp_path / "r" / "config.json").read_text())["devices"] is None  # resumes as "auto"
