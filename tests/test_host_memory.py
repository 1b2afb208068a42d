"""glibc's malloc kept from unmapping what XLA:CPU frees (``jaxfl.core.host_memory``): a program that stacks
16 rows of 4 MiB in a 64 MiB temporary buffer (as a cohort round stacks its clients' trained models), run ten
times, faults that buffer's pages once instead of on every run. Each case runs in its own process (the settings
are the process's, made before jax starts)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxfl.core.host_memory import glibc, own_malloc_settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = 64 * 2 ** 20 // 4096  # 4 KiB pages of the program's 64 MiB temporary buffer

FAULTS = """
import resource, sys
from jaxfl.core.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jax.lax.map(lambda row: jnp.sin(row) * 2.0, x.reshape(16, -1)).sum(0))
x = jnp.ones(16 * 2 ** 20)  # 64 MiB of float32
f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    y = f(x)
    y.block_until_ready()
    del y
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_run(mode: str, **env) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
                                        "JAX_PLATFORMS": "cpu", **env}).stdout.split()
    return out[0] == "True", float(out[1])


def thp_always() -> bool:
    """Transparent huge pages for every mapping: the system's malloc then faults 2 MiB pages, few of them."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
@pytest.mark.skipif(thp_always(), reason="huge pages for every mapping: few faults either way")
def test_freed_memory_is_reused_without_faults():
    applied, kept = faults_per_run("keep")
    _, system = faults_per_run("system")
    assert applied
    # the system's malloc maps the stacked buffer anew each run and faults every page of it; kept, its pages are
    # reused (what faults remains is the program's 4 MiB output and the runtime's own)
    assert system > PAGES / 2, f"{system:.0f} page faults a run with the system's malloc ({PAGES} pages stacked)"
    assert kept < system / 4, f"{kept:.0f} page faults a run with freed memory kept, {system:.0f} without"


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
def test_own_malloc_settings_are_kept():
    applied, _ = faults_per_run("keep", MALLOC_ARENA_MAX="4")
    assert not applied  # the environment's setting wins; nothing was changed


def test_own_malloc_settings():
    assert not own_malloc_settings({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.rtld.nns=2"})
    assert own_malloc_settings({"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.hugetlb=1"})
    assert own_malloc_settings({"MALLOC_ARENA_MAX": "2"})
    assert own_malloc_settings({"MALLOC_TRIM_THRESHOLD_": "0"})
