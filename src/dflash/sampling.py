"""The target's sampling distribution (temperature, top-k, top-p) and draws from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import DFlashInputError
from .kernels import argmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DFlashInputError(f"temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise DFlashInputError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise DFlashInputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 logits of the distribution actually sampled from (-inf where excluded)."""
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
        drop_sorted = (cum - sorted_x.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's choice at every position: argmax when greedy, else a sample. [..., V] -> [...]."""
    if params.greedy:
        return argmax(logits)
    probs = processed_logits(logits, params).softmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
