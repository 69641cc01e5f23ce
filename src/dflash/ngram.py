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

    @classmethod
    def repeats(cls, num_tokens: int) -> "NgramDraft":
        """The lookup of text that repeats: the last 3, else 2 tokens (one token alone matches too loosely). What
        prompt lookup ahead of a DFlash draft proposes (generate's prompt_lookup) and what dflash.evaluate counts
        as copyable."""
        return cls(num_tokens=num_tokens, max_ngram=3, min_ngram=2)

    @property
    def block_size(self) -> int:
        return self.num_tokens + 1

    def propose(self, history: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the history's last n tokens."""
        return self.match(history, k)[1]

    def match(self, history: list[int], k: int | None = None) -> tuple[int, list[int]]:
        """(n, continuation): the longest n (min_ngram..max_ngram) whose last n tokens occurred earlier, and up
        to k tokens that followed its latest earlier occurrence; (0, []) where none did. The length matters to
        a caller weighing the proposal: a long match is far likelier to go on than a one-token one.
        One pass over the history finds the earlier places of the last token; each is then extended backwards,
        so a miss at every n costs one pass, not one per n."""
        k = self.num_tokens if k is None else k
        end = len(history) - 1
        if end < 1:
            return 0, []
        last, longest = history[end], min(self.max_ngram, end)
        best_n, best_at = 0, -1
        for at in range(end - 1, -1, -1):  # latest first: an equal length found later does not replace it
            if history[at] != last:
                continue
            n = 1
            while n < longest and n <= at and history[at - n] == history[end - n]:
                n += 1
            if n > best_n:
                best_n, best_at = n, at
                if n == longest:
                    break
        if best_n < self.min_ngram:
            return 0, []
        return best_n, history[best_at + 1:best_at + 1 + k]
