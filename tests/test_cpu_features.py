"""DFLASH_MAX_CPU_ISA=avx2: an AVX-512 machine takes (and so tests) the paths of an AVX2-only CPU. Without it a
test that assumed a feature would pass on the machines that have it and fail only where CI runs on one that
does not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_features import needs_attention_kernel
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


def test_an_avx_vnni_limit_keeps_avx_vnni_alone(monkeypatch):
    # an AVX-512 machine with AVX-VNNI then runs the int4 build an Alder Lake-class CPU runs
    monkeypatch.setenv("DFLASH_MAX_CPU_ISA", "avx_vnni")
    flags = machine.cpu_flags()
    if flags is None:
        pytest.skip("this system does not list CPU flags (/proc/cpuinfo)")
    assert not any(f.startswith(("avx512", "amx", "avx_ne_convert", "avx_vnni_int8")) for f in flags)
    assert ("avx_vnni" in flags) == ("avx_vnni" in machine.cpuinfo("flags").split())
    expected = "avx_vnni" if "avx_vnni" in flags else "avx2"
    assert kernels.int4_build() in (None, expected)
    assert "limited to AVX2 and AVX-VNNI" in machine.hardware("cpu")


def test_a_bad_isa_limit_is_named(monkeypatch):
    monkeypatch.setenv("DFLASH_MAX_CPU_ISA", "avx9")
    with pytest.raises(DFlashConfigError, match="DFLASH_MAX_CPU_ISA='avx9'"):
        machine.cpu_flags()


def _beyond_avx2() -> bool:
    flags = machine.cpu_flags() or set()
    return any(f.startswith(("avx512", "amx", "avx_vnni", "avx_ne_convert")) for f in flags)


# a process limited to AVX2 takes paths other than this one's only where this one may use more than AVX2
_LIMITED = os.environ.get("DFLASH_MAX_CPU_ISA") == "avx2"
needs_paths_beyond_avx2 = pytest.mark.skipif(
    _LIMITED or not _beyond_avx2(), reason="already limited to AVX2" if _LIMITED else
    "this CPU has nothing beyond AVX2: the suite itself took an AVX2-only CPU's paths")


@needs_paths_beyond_avx2
def test_the_kernel_and_runtime_tests_pass_as_on_an_avx2_only_cpu():
    # the tests of every path that depends on the CPU's extensions, run again in a process limited to AVX2:
    # what needs the extensions skips (and says so), everything else must pass there too
    env = dict(os.environ, DFLASH_MAX_CPU_ISA="avx2")
    files = [str(TESTS / f) for f in ("test_fast.py", "test_kernels.py", "test_engine.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *files],
                       env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


_ATTENTION_CASES = """
import sys, torch
from dflash import kernels
assert kernels.cache_attention_kernel()
g = torch.Generator().manual_seed(0)
out = []
for d in (64, 128, 32):  # 64 and 128 take the unrolled paths, 32 the general one
    for nq in (1, 2, 3, 5, 8, 16):  # rows in pairs and alone, value rows four at a time and alone
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(2, 6, nq, d, generator=g)
            k, v = (torch.randn(2, 2, 77, d, generator=g).to(dtype) for _ in range(2))
            visible = torch.rand(2, nq, 77, generator=g) > 0.2  # some queries skip some keys
            visible[0, :, 40:] = True  # and some see every key of a block
            out.append(torch.ops.dflash_attn.cache_attention(q, k, v, visible, d ** -0.5))
torch.save(out, sys.argv[1])
"""


@needs_paths_beyond_avx2
@needs_attention_kernel
def test_the_attention_kernel_gives_the_same_bits_built_for_avx512_as_for_avx2(tmp_path):
    # the AVX-512 build's 16-lane paths (two keys per register for the scores, 64 value elements per pass) must
    # make every sum the AVX2 code makes, in its order: a model's tokens do not depend on the build
    for isa, path in (("native", tmp_path / "native.pt"), ("avx2", tmp_path / "avx2.pt")):
        env = dict(os.environ, DFLASH_MAX_CPU_ISA=isa)
        r = subprocess.run([sys.executable, "-c", _ATTENTION_CASES, str(path)], env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    native, avx2 = torch.load(tmp_path / "native.pt"), torch.load(tmp_path / "avx2.pt")
    assert len(native) == len(avx2) == 36
    for i, (a, b) in enumerate(zip(native, avx2)):
        assert torch.equal(a, b), i
