"""Prompt lookup (n-gram) drafting: the draft-free baseline, verified by the same loop as DFlash.

The last n tokens of a sequence are looked up in its earlier text (prompt and answer so far); the tokens that
followed the most recent earlier occurrence are proposed (longest n first, as transformers'
`prompt_lookup_num_tokens` / `max_matching_ngram_size`). Nothing found: no proposal, and the step verifies
the anchor alone (a plain decoding step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NgramDraft:
    num_tokens: int = 10  # most tokens proposed per step (block size = num_tokens + 1)
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.num_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("NgramDraft needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")

    @property
    def block_size(self) -> int:
        return self.num_tokens + 1

    def propose(self, history: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the history's last n tokens."""
        k = self.num_tokens if k is None else k
        n_tokens = len(history)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = history[n_tokens - n:]
            for start in range(n_tokens - n - 1, -1, -1):  # latest match first, never the tail itself
                if history[start:start + n] == tail:
                    return history[start + n:start + n + k]
        return []
