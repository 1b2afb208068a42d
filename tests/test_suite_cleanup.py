"""The suite leaves nothing behind: its compile cache goes when a run ends, also when SIGTERM stops it, and a
folder that a killed run left is removed by a later run once it is a day old (``conftest.remove_stale_caches``).

Each check runs a copy of ``conftest.py`` beside one test that waits, in a pytest of its own, with its own
temporary folder."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CACHE_PREFIX, STALE_CACHE_S, remove_stale_caches

WAITING_TEST = '''
import os
import time
from pathlib import Path

import jax


def test_waits_for_a_stop():
    jax.jit(lambda x: x + 1)(1.0)  # an entry in the run's compile cache
    ready = Path(os.environ["JAXFL_TEST_READY"])
    part = ready.with_suffix(".part")  # written whole, then renamed: the waiting check never reads it half-written
    part.write_text(os.environ["JAX_COMPILATION_CACHE_DIR"])
    part.replace(ready)
    time.sleep(300)
'''


def aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_remove_stale_caches_takes_only_old_cache_folders_and_never_its_own(tmp_path):
    now = time.time()
    old = tmp_path / (CACHE_PREFIX + "a")
    old.mkdir()
    (old / "entry").write_text("x")
    aged(old, STALE_CACHE_S + 60)
    own = tmp_path / (CACHE_PREFIX + "own")
    own.mkdir()
    aged(own, STALE_CACHE_S + 60)
    fresh = tmp_path / (CACHE_PREFIX + "b")
    fresh.mkdir()
    other = tmp_path / "not-a-cache"
    other.mkdir()
    aged(other, STALE_CACHE_S + 60)
    assert remove_stale_caches(tmp_path, own, now) == [old]
    assert not old.exists() and own.exists() and fresh.exists() and other.exists()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_a_run_stopped_by_sigterm_removes_its_compile_cache(tmp_path, workers):
    suite, temp = tmp_path / "suite", tmp_path / "tmp"
    suite.mkdir()
    temp.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    (suite / "test_wait.py").write_text(WAITING_TEST)
    stale = temp / (CACHE_PREFIX + "killed")
    stale.mkdir()
    aged(stale, STALE_CACHE_S + 60)
    ready = tmp_path / "ready"
    # the child owns its cache: none of this run's settings for it, nor xdist's worker variables
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(temp), JAXFL_TEST_READY=str(ready))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "test_wait.py"],
                            cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the waiting test never started"
        cache = Path(ready.read_text())
        assert cache.parent == temp and any(cache.iterdir()), "no compile cache entry to remove"
        assert not stale.exists(), "the run did not remove a day-old cache folder a killed run left"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode not in (0, -signal.SIGTERM), out  # stopped as interrupted, not killed by the signal
    assert not cache.exists(), f"the compile cache {cache} is left behind:\n{out}"
