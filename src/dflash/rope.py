"""RoPE's cos and sin for a step, in the form dflash's forwards rotate with: sin with its first half negated, so
that x * cos + roll(x, d/2) * sin is HF's x * cos + rotate_half(x) * sin bit for bit (negating is exact) in one op
instead of three.

In an eager CPU step they come from a table: the rotary module (HF's LlamaRotaryEmbedding and kin) computes them
for a step's few positions in some ten small ops, and the negation takes three more: 50-60 us a call on
SmolLM2-135M (AMD EPYC, AVX2), three calls a DFlash step (the target's forward, the draft's propose and its
context write). The table is what the module itself gives for positions 0..n-1, so the values are its own bits
(each position's angle is one product, inv_freq x pos, whatever the other positions; cos and sin are
elementwise), and it doubles when a later position needs more. Only for RoPE whose frequencies do not depend on
the sequence (default, linear, llama3); a compiled or GPU step computes them in its graph.
"""

from __future__ import annotations

import torch
import torch.nn as nn

_MIN_POSITIONS = 1024
_STATIC = ("default", "linear", "llama3")


def _signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rope_tables(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [b, n, head_dim] of rotary(x, positions) in x's dtype, sin's first half negated."""
    if (x.device.type != "cpu" or positions.dim() != 2 or positions.numel() == 0 or torch.compiler.is_compiling()
            or getattr(rotary, "rope_type", "default") not in _STATIC):
        return _signed(*rotary(x, positions))
    lo, hi = (int(v) for v in torch.aminmax(positions))
    if lo < 0:
        return _signed(*rotary(x, positions))
    freq = getattr(rotary, "inv_freq", None)
    # a table holds while the module's frequencies and scaling do (moved, replaced or rescaled: a new table)
    key = (x.dtype, None if freq is None else (freq.data_ptr(), freq._version, freq.dtype),
           getattr(rotary, "attention_scaling", None))
    tables: dict = rotary.__dict__.setdefault("_dflash_rope_tables", {})
    table = tables.get(key)
    if table is None or table[0].shape[0] <= hi:
        n = max(_MIN_POSITIONS, hi + 1, 2 * (0 if table is None else table[0].shape[0]))
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference mode too
            cos, sin = _signed(*rotary(x[:1, :1], torch.arange(n)[None]))
        tables.clear()  # the others are tables of frequencies no longer in use
        tables[key] = table = (cos[0], sin[0])
    return table[0][positions], table[1][positions]
