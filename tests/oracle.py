"""Drafts with known quality: an oracle that proposes the target's own future tokens (optionally corrupted)."""

from __future__ import annotations

import torch

from dflash import DFlashDraftModel


class OracleDraft(DFlashDraftModel):
    """Proposes futures[row][position] (the target's own greedy text) and corrupts a fraction of them.

    It still runs the real draft forward, so the context cache, positions and masks are exercised too.
    """

    def __init__(self, base: DFlashDraftModel, futures: list[list[int]], corrupt: float | list[float] = 0.0,
                 seed: int = 0):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self._target_modules = base._target_modules
        self.futures = futures
        self.corrupt = corrupt if isinstance(corrupt, list) else [corrupt] * len(futures)
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, block_ids, block_pos, cache, ctx_valid):
        real = super().propose(block_ids, block_pos, cache, ctx_valid)
        out = real.clone()
        for r in range(out.shape[0]):
            for k in range(out.shape[1]):
                pos = int(block_pos[r, k + 1])
                seq = self.futures[r % len(self.futures)]
                if pos < len(seq) and torch.rand((), generator=self.g) >= self.corrupt[r % len(self.corrupt)]:
                    out[r, k] = seq[pos]
        return out
