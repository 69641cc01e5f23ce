"""Linear layers with the weight laid out once for oneDNN, for inference on the CPU.

In bf16/fp16 on a CPU, `F.linear` goes through oneDNN, which reorders the (plain row-major) weight into its
blocked layout on every call. For the skinny inputs of decoding (1 to 16 rows) that reorder costs about as much
as the product itself: measured on this project's 2-core machine over SmolLM2-135M's 121 weight matrices,
20.4 ms plain vs 12.8 ms prepacked for 1 row, 28.9 vs 13.7 ms for 8 rows, with bitwise identical results
(the same oneDNN kernel runs; only the reorder moves out of the loop). fp32 goes to a different BLAS whose
summation order differs, so fp32 keeps `F.linear`: the fp32 paths stay bit-comparable with the HF model.

The packed copy is cached per weight tensor and rebuilt when the weight changes in place (a training step)
or is replaced; training itself (grad enabled) always takes `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
_packed = WeakIdKeyDictionary()  # weight -> (version, data_ptr, packed weight)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(w: torch.Tensor) -> bool:
    """Whether products with weight w [out, in] are exact and faster through a prepacked oneDNN weight."""
    return _ONEDNN and w.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES and w.dim() == 2


class PackedWeight:
    """A weight packed once, for holders of frozen snapshots (the fast runtime): no cache lookup per call."""

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, b, "none", [], "")


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """The oneDNN layout of weight w [out, in], made on first use and again whenever w has changed."""
    # an inference tensor (made under inference_mode, e.g. a fused weight) keeps no version counter
    key = (None if w.is_inference() else w._version, w.data_ptr())
    entry = _packed.get(w)
    if entry is None or entry[0] != key:
        entry = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1))
        _packed[w] = entry
    return entry[1]


@torch.library.custom_op("dflash::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # an op of its own so that torch.compile treats the (cached, opaque-layout) packed weight as a black box
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(w), b, "none", [], "")


@packed_linear.register_fake
def _(x, w, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through the prepacked weight where that is exact and faster (see the module doc)."""
    if (not packable(w) or x.dtype != w.dtype or torch.is_grad_enabled()
            or (b is not None and b.dtype != w.dtype)):
        return F.linear(x, w, b)
    if torch.compiler.is_compiling():
        return packed_linear(x, w, b)
    # eager: the custom op's dispatch would cost ~40 us a call, a fifth of a decode step
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(w), b, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
