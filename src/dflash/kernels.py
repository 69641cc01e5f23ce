"""Linear layers with the weight laid out once for oneDNN, for inference on the CPU.

In bf16/fp16 on a CPU, `F.linear` goes through oneDNN, which reorders the (plain row-major) weight into its
blocked layout on every call. For the skinny inputs of decoding (1 to 16 rows) that reorder costs about as much
as the product itself (see the target forward time of `benchmarks/profile_step.py`). Packing once gives bitwise
identical results: the same oneDNN kernel runs, only the reorder moves out of the loop. fp32 goes to a different BLAS whose
summation order differs, so fp32 keeps `F.linear`: the fp32 paths stay bit-comparable with the HF model.

The packed copy is cached per weight tensor and rebuilt when the weight changes in place (a training step)
or is replaced; training itself (grad enabled) always takes `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
_packed = WeakIdKeyDictionary()  # weight -> ((version, data_ptr), packed weight)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of this dtype: bf16 needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT,
    fp16 AVX512-FP16 or AVX-NE-CONVERT. oneDNN's own check is the authority, so ask it with a tiny weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def packable(w: torch.Tensor) -> bool:
    """Whether products with weight w [out, in] are exact and faster through a prepacked oneDNN weight."""
    return (_ONEDNN and w.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES and w.dim() == 2
            and _cpu_packs(w.dtype))


class PackedWeight:
    """A weight [out, in] packed once; the fast runtime holds these for its frozen weight snapshots."""

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, b, "none", [], "")


def packed_weight(w: torch.Tensor) -> PackedWeight:
    """w packed, made on first use and again whenever w has changed in place or been replaced."""
    # an inference tensor (made under inference_mode, e.g. a fused weight) keeps no version counter
    key = (None if w.is_inference() else w._version, w.data_ptr())
    entry = _packed.get(w)
    if entry is None or entry[0] != key:
        entry = _packed[w] = (key, PackedWeight(w))
    return entry[1]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through the packed weight where that is exact and faster (see the module doc)."""
    if (not packable(w) or x.dtype != w.dtype or torch.is_grad_enabled()
            or (b is not None and b.dtype != w.dtype)):
        return F.linear(x, w, b)
    return packed_weight(w).linear(x, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
