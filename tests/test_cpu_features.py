"""DFLASH_MAX_CPU_ISA=avx2: an AVX-512 machine takes (and so tests) the paths of an AVX2-only CPU. Without it a
test that assumed a feature would pass on the machines that have it and fail only where CI runs on one that
does not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import kernels, machine
from dflash.errors import DFlashConfigError

TESTS = Path(__file__).parent


@pytest.fixture
def avx2_only(monkeypatch):
    monkeypatch.setenv("DFLASH_MAX_CPU_ISA", "avx2")


def test_an_avx2_limit_hides_every_later_extension_from_dflash(avx2_only):
    flags = machine.cpu_flags()
    if flags is None:
        pytest.skip("this system does not list CPU flags (/proc/cpuinfo)")
    assert not any(f.startswith(("avx512", "amx", "avx_vnni", "avx_ne_convert")) for f in flags)
    assert machine.cpu_has("avx512bw") is False
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    assert not kernels.packable(w) and kernels.widens(w)
    assert kernels.int4_build() in (None, "avx2")  # never the AVX-512 VNNI build
    assert "limited to AVX2" in machine.hardware("cpu")


def test_a_bad_isa_limit_is_named(monkeypatch):
    monkeypatch.setenv("DFLASH_MAX_CPU_ISA", "avx9")
    with pytest.raises(DFlashConfigError, match="DFLASH_MAX_CPU_ISA='avx9'"):
        machine.cpu_flags()


def _beyond_avx2() -> bool:
    flags = machine.cpu_flags() or set()
    return any(f.startswith(("avx512", "amx", "avx_vnni", "avx_ne_convert")) for f in flags)


@pytest.mark.skipif(os.environ.get("DFLASH_MAX_CPU_ISA") == "avx2", reason="already limited to AVX2")
@pytest.mark.skipif(not _beyond_avx2(), reason="this CPU has nothing beyond AVX2: the suite itself took its paths")
def test_the_kernel_and_runtime_tests_pass_as_on_an_avx2_only_cpu():
    # the tests of every path that depends on the CPU's extensions, run again in a process limited to AVX2:
    # what needs the extensions skips (and says so), everything else must pass there too
    env = dict(os.environ, DFLASH_MAX_CPU_ISA="avx2")
    files = [str(TESTS / f) for f in ("test_fast.py", "test_kernels.py", "test_engine.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *files],
                       env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
