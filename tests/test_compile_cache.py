"""``jaxfl run``'s persistent compilation cache: where it lives, bad paths refused up front, the same numbers
from cached programs, and a damaged cache costing one line of warning, not a traceback or a different run."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from jaxfl.errors import ConfigError
from jaxfl.run.compile_cache import (cache_warnings, check_compile_cache, default_compile_cache,
                                     resolve_compile_cache)


def test_default_folder_follows_jaxfl_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXFL_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache() == str(tmp_path / "xdg" / "jaxfl" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache() == str(tmp_path / "home" / ".cache" / "jaxfl" / "xla")
    monkeypatch.setenv("JAXFL_COMPILE_CACHE", str(tmp_path / "mine"))
    assert default_compile_cache() == str(tmp_path / "mine")


def test_check_accepts_a_new_folder_without_creating_it_and_refuses_a_file(tmp_path, monkeypatch):
    assert check_compile_cache("none") is None and check_compile_cache("None") is None
    assert check_compile_cache(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []  # checked, nothing written
    (tmp_path / "f").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="'f/sub': 'f' is not a folder"):
        check_compile_cache("f/sub")  # under a file


def test_an_unusable_default_folder_turns_the_cache_off_but_a_named_one_is_bad_input(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXFL_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/sys/none")  # a read-only home must not stop a run
    folder, named, note = resolve_compile_cache(None)
    assert folder is None and not named and note.startswith("compiling without a cache: the compile cache '/sys/")
    assert resolve_compile_cache(str(tmp_path / "c")) == (tmp_path / "c", True, None)
    monkeypatch.setenv("JAXFL_COMPILE_CACHE", "/sys/x")
    with pytest.raises(ConfigError, match=r"\$JAXFL_COMPILE_CACHE '/sys/x': '/sys' is not writable"):
        resolve_compile_cache(None)


def test_cache_warnings_become_one_line_and_other_warnings_pass(monkeypatch):
    said, shown = [], []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with cache_warnings("/c", said.append):
            for name in ("jit_a", "jit_b"):
                warnings.warn(f"Error reading persistent compilation cache entry for '{name}': truncated")
            warnings.warn("something else")
        warnings.warn("after the block")
    assert len(said) == 1 and said[0].startswith("warning: the compile cache /c has entries") and "jit_a" in said[0]
    assert shown == ["something else", "after the block"]


def test_a_second_run_reads_every_program_from_the_cache_and_logs_the_same_numbers(tmp_path, monkeypatch):
    """Three CLI runs in one fresh process (the cache is set up once per process, before its first compilation):
    the first fills DIR; the second (another --out) compiles nothing that the first compiled (jax's cache hits,
    no misses) and logs the same records; after every entry is truncated, the third logs them too and says so
    in one line."""
    cache = tmp_path / "cache"
    flags = ["run", "--quiet", "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "24",
             "--test-per-client", "12", "--batch-size", "12", "--rounds", "2", "--compile-cache", str(cache)]
    code = f"""
import sys, pathlib, jax.monitoring
from jaxfl.run.cli import main
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
f, out = {flags!r}, pathlib.Path(sys.argv[1])
assert main(f + ['--out', str(out / 'first')]) == 0
events.clear()
assert main(f + ['--out', str(out / 'second')]) == 0
print('hits', events.count('/jax/compilation_cache/cache_hits'), 'misses',
      events.count('/jax/compilation_cache/cache_misses'), flush=True)
for entry in pathlib.Path({str(cache)!r}).glob('*-cache'):
    entry.write_bytes(entry.read_bytes()[:50])
sys.stderr.write('THIRD\\n')
assert main(f + ['--out', str(out / 'third')]) == 0
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the suite's own cache
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    hits, misses = (int(x) for x in out.stdout.split("hits ")[1].split()[::2][:2])
    assert hits >= 1 and misses == 0, out.stdout  # (programs jitted at module level stay in memory)
    third = out.stderr.split("THIRD\n")[1].splitlines()
    assert len(third) == 1 and third[0].startswith(f"jaxfl: warning: the compile cache {cache} has entries"), third
    assert "Traceback" not in out.stderr

    def logged(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    def records(name):  # (a program read from the cache is not compiled: compiled_programs differ)
        return [{k: v for k, v in r.items() if not k.endswith("_s") and k not in ("host_share", "compiled_programs")}
                for r in logged(name)]
    assert records("first") == records("second") == records("third") and len(records("first")) == 2
    # (a few small programs bypass the persistent cache and compile in every process)
    compiled = {name: sum(r["compiled_programs"] for r in logged(name)) for name in ("first", "second")}
    assert compiled["second"] < compiled["first"], compiled
