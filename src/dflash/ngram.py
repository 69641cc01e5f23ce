"""Prompt lookup (n-gram) drafting: the draft-free baseline, verified by the same loop as DFlash.

The last n tokens of a sequence are looked up in its earlier text (prompt and answer so far); the tokens that
followed the most recent earlier occurrence are proposed (longest n first, as transformers'
`prompt_lookup_num_tokens` / `max_matching_ngram_size`). Nothing found: no proposal, and the step verifies
the anchor alone (a plain decoding step).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class NgramDraft:
    num_tokens: int = 10  # most tokens proposed per step (block size = num_tokens + 1)
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.num_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("NgramDraft needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")

    @classmethod
    def repeats(cls, num_tokens: int) -> "NgramDraft":
        """The lookup of text that repeats: the last 3, else 2 tokens (one token alone matches too loosely). What
        prompt lookup ahead of a DFlash draft proposes (generate's prompt_lookup) and what dflash.evaluate counts
        as copyable."""
        return cls(num_tokens=num_tokens, max_ngram=3, min_ngram=2)

    @property
    def block_size(self) -> int:
        return self.num_tokens + 1

    def propose(self, history: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the history's last n tokens."""
        return self.match(history, k)[1]

    def match(self, history: Sequence[int], k: int | None = None) -> tuple[int, list[int]]:
        """(n, continuation): the longest n (min_ngram..max_ngram) whose last n tokens occurred earlier, and up
        to k tokens that followed its latest earlier occurrence; (0, []) where none did. The length matters to
        a caller weighing the proposal: a long match is far likelier to go on than a one-token one.
        The history's tokens as 4-byte words are searched from the end by bytes.rfind, in C: a step looks up
        every row's whole text, which a scan in Python pays for by the token. Callers that look up a growing text
        every step keep it as an array('i') (extended as tokens commit), which needs no conversion."""
        k = self.num_tokens if k is None else k
        end = len(history) - 1
        if end < 1:
            return 0, []
        words = (history if isinstance(history, array) else array("i", history)).tobytes()
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):  # the longest first
            tail = words[4 * (end + 1 - n):]
            limit = 4 * end  # an earlier occurrence ends before the last token
            while (at := words.rfind(tail, 0, limit)) >= 0:
                if at % 4 == 0:  # aligned on tokens (a match across two tokens' bytes is none)
                    start = at // 4 + n
                    return n, list(history[start:start + k])
                limit = at + len(tail) - 1
        return 0, []
