"""Skip marks for tests that need a CPU feature; each names what is missing. The code paths such a test stands
for run everywhere else: with the feature reported unavailable (DFLASH_MAX_CPU_ISA=avx2, see
test_cpu_features.py) an AVX-512 machine takes an AVX2-only CPU's paths."""

import pytest
import torch

from dflash import kernels

needs_bf16_packing = pytest.mark.skipif(
    not (kernels._ONEDNN and kernels._cpu_packs(torch.bfloat16)),
    reason="needs oneDNN bf16 weight packing (AVX-512 bw/vl/dq or AVX-NE-CONVERT; PyTorch with oneDNN)")
needs_int4_kernel = pytest.mark.skipif(not kernels.int4_kernel(), reason="dflash's int4 kernel needs an x86 CPU with "
                                       "AVX-512 VNNI, or AVX2 with FMA and F16C, and a C++ compiler")
needs_attention_kernel = pytest.mark.skipif(not kernels.cache_attention_kernel(),
                                            reason="dflash's attention kernel needs an x86 CPU and a C++ compiler")
