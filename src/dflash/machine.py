"""Facts about the machine: where dflash keeps its files, the CPU's cores and instruction sets, the device.

The ground floor of the package: it imports nothing of dflash's, so the kernels, the compiled paths and the
loaders can all ask it.

`DFLASH_MAX_CPU_ISA=avx2` makes dflash treat the CPU as one without AVX-512, AMX, AVX-VNNI or AVX-NE-CONVERT
(the extensions its kernel choices depend on), as oneDNN's `ONEDNN_MAX_CPU_ISA` does for oneDNN: an AVX-512
machine then takes, and tests, the code paths an AVX2-only CPU takes. `DFLASH_MAX_CPU_ISA=avx_vnni` keeps AVX-VNNI
and hides the rest, as on Intel's client CPUs from Alder Lake on (oneDNN's AVX2_VNNI). PyTorch's own kernels are
not affected.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

from .errors import DFlashConfigError

MAX_CPU_ISA = ("native", "avx2", "avx_vnni")
# the flag prefixes each limit hides: every extension past it that a dflash kernel choice asks about ("avx_vnni"
# also covers "avx_vnni_int8")
_PAST_AVX_VNNI = ("avx512", "amx", "avx_ne_convert", "avx_vnni_int8")
_BEYOND = {"avx2": (*_PAST_AVX_VNNI, "avx_vnni"), "avx_vnni": _PAST_AVX_VNNI}


def dflash_home() -> Path:
    return Path(os.environ.get("DFLASH_HOME") or Path.home() / ".cache" / "dflash")


def cpuinfo(field: str) -> str | None:
    """The first value of a /proc/cpuinfo field ("model name", "flags"), None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith(field)), None)
    except OSError:
        return None


def max_cpu_isa() -> str:
    isa = os.environ.get("DFLASH_MAX_CPU_ISA", "native").lower()
    if isa not in MAX_CPU_ISA:
        raise DFlashConfigError(f"DFLASH_MAX_CPU_ISA={isa!r}: expected one of {', '.join(MAX_CPU_ISA)}")
    return isa


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as /proc/cpuinfo names them, less those DFLASH_MAX_CPU_ISA masks; None where
    the system does not say (then kernels ask their libraries)."""
    return _cpu_flags(max_cpu_isa())


@functools.cache
def _cpu_flags(isa: str) -> frozenset[str] | None:
    flags = cpuinfo("flags")
    if flags is None:
        return None
    found = frozenset(flags.split())
    if isa in _BEYOND:
        found = frozenset(f for f in found if not f.startswith(_BEYOND[isa]))
    return found


def cpu_has(*flags: str) -> bool | None:
    """Whether the CPU has all of `flags` (None where unknown)."""
    found = cpu_flags()
    return None if found is None else set(flags) <= found


def physical_cores() -> int:
    """Physical cores (not hyper-threads) of this machine, from /proc/cpuinfo where it exists."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = value.strip()
                elif key == "core id":
                    core = value.strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return min(len(cores), os.cpu_count() or len(cores))
    except OSError:
        pass
    return os.cpu_count() or 1


def set_default_threads(threads: int | None = None) -> int:
    """torch intra-op threads: `threads`, else OMP_NUM_THREADS if the user set it, else the physical cores."""
    if threads is None:
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else physical_cores()
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory a process frees for its next allocations instead of handing it back to
    the kernel: the heap is trimmed only past 1 GiB free at its top, and blocks up to 32 MiB come from the heap
    rather than from fresh mappings. A draft's training step allocates and frees a few hundred MB of activations;
    by default glibc returns the top of the heap once a few tens of MB lie free there, and the kernel then zeroes
    every page again on first touch (`clear_page_erms` took 9% of a training step's CPU time on a 2-core
    AVX-512 Xeon; with this, the default draft's steps took 0.525 s instead of 0.56, medians of three 110-step
    runs each). The process keeps up to its peak use; the values computed do not change. False where the C
    library is not glibc."""
    import ctypes
    import ctypes.util

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # malloc.h
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes free for new tensors: the GPU's free memory, or the system's MemAvailable; None where unknown."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024
    except (OSError, StopIteration, ValueError):
        return None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hardware(device: torch.device | str | None = None) -> str:
    """What the numbers were measured on, e.g. "AMD EPYC (AVX2)" or "NVIDIA H200": the CPU's vector ISA
    decides which kernels are fast (without AVX-512, bf16 products of several rows cost several times one row),
    so a benchmark result means little without it."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = cpuinfo("model name") or platform.processor() or platform.machine()
    limit = {"avx2": "AVX2", "avx_vnni": "AVX2 and AVX-VNNI"}.get(max_cpu_isa())
    masked = f", dflash limited to {limit} by DFLASH_MAX_CPU_ISA" if limit else ""
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}{masked})"
