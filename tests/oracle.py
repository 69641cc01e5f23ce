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

    def _oracle(self, real, block_pos):
        out = real.clone()
        for r in range(out.shape[0]):
            for k in range(out.shape[1]):
                pos = int(block_pos[r, k + 1])
                seq = self.futures[r % len(self.futures)]
                if pos < len(seq) and torch.rand((), generator=self.g) >= self.corrupt[r % len(self.corrupt)]:
                    out[r, k] = seq[pos]
        return out

    def propose(self, block_ids, block_pos, cache, ctx_valid):
        return self._oracle(super().propose(block_ids, block_pos, cache, ctx_valid), block_pos)

    def propose_topk(self, block_ids, block_pos, cache, ctx_valid, k, compile=False):
        """The oracle's token first (as `propose` proposes it), then the real draft's others."""
        ids, logp = super().propose_topk(block_ids, block_pos, cache, ctx_valid, k + 1)
        first = self._oracle(ids[..., 0], block_pos)
        return _put(ids, first, 0)[..., :k], logp[..., :k]


class SecondChoiceOracle(OracleDraft):
    """A draft whose argmax is wrong at a fraction `second` of the slots while the target's token is its
    second choice: a chain loses the rest of the block there, a tree with two tokens per slot does not."""

    def __init__(self, base, futures, second: float = 0.5, seed: int = 0):
        super().__init__(base, futures, seed=seed)
        self.second = second

    def propose(self, block_ids, block_pos, cache, ctx_valid):  # a chain takes the argmax
        return self.propose_topk(block_ids, block_pos, cache, ctx_valid, 1)[0][..., 0]

    def propose_topk(self, block_ids, block_pos, cache, ctx_valid, k, compile=False):
        ids, logp = DFlashDraftModel.propose_topk(self, block_ids, block_pos, cache, ctx_valid, k + 2)
        for r in range(ids.shape[0]):
            seq = self.futures[r % len(self.futures)]
            for s in range(ids.shape[1]):
                pos = int(block_pos[r, s + 1])
                if pos < len(seq):
                    rank = 1 if torch.rand((), generator=self.g) < self.second else 0
                    ids[r, s] = _put(ids[r, s][None, None], torch.tensor([[seq[pos]]]), rank)[0, 0]
        return ids[..., :k], logp[..., :k]


def _put(ids, token, rank: int):
    """ids [..., k] with `token` [...] moved to `rank` (the other tokens keep their order), distinct as before."""
    out = ids.clone().view(-1, ids.shape[-1])
    for i, (row, t) in enumerate(zip(out.tolist(), token.reshape(-1).tolist())):
        row = [x for x in row if x != t]
        row.insert(rank, t)
        out[i] = torch.tensor(row[:ids.shape[-1]])
    return out.view(ids.shape)
