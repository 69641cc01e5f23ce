"""The tensors of a batch of sequences decoding together: both caches and one draft -> verify step.

`_Generation` (one `generate` call) and the serving engine (sequences joining and leaving between steps)
drive the same object, so the step that makes the output lossless exists once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .adaptive import NGRAM, TREE
from .eagle import Eagle3DraftModel
from .model import DFlashDraftModel, DraftKVCache
from .ngram import NgramDraft
from .fast import make_adapter, resolve_runtime
from .kernels import argmax
from .tree import accept, accepted_nodes, build_trees


@dataclass
class TreeSpec:
    """How a step's candidate trees are made (dflash.tree): `budget` draft nodes per row, the draft's `topk`
    tokens per slot, and per row an n-gram continuation of its text to add, or None."""
    budget: int
    topk: int = 4
    continuations: list[list[int]] | None = None


def step_args(option: tuple[str, int], found: list[tuple[int, list[int]]] | None, topk: int, block_size: int):
    """What `SpecBatch.step` takes for a TreeBudgetController option, given each row's n-gram match (length,
    continuation) or None: (tree, proposals, width). A tree also carries the continuations as branches; an
    n-gram chain checks them alone, no draft forward; a plain step checks the anchor."""
    kind, size = option
    continuations = None if found is None else [c for _, c in found]
    if kind == TREE:
        return TreeSpec(size, topk, continuations), None, block_size
    if kind == NGRAM:
        return None, continuations, size + 1
    return None, None, 1


# Rows of logits that cost about one row's time on a CPU: the output layer streams its whole weight for a few
# rows (SmolLM2-135M's Q8_0 head on an AVX2 EPYC, 2 threads, benchmarks/linear_rows.py: 1.5 / 1.5 / 1.9 / 3.4 ms
# for 1 / 2 / 4 / 8 rows)
HEAD_ROWS_AT_ONE_ROW_COST = 4


def read_choices(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: torch.Tensor,
                 parent: torch.Tensor, alive: torch.Tensor | None, max_depth: int, first: int) -> torch.Tensor:
    """The target's argmax after every node that greedy verification reads, 0 after the others (a node whose
    parent was not read is never accepted, and a token id keeps the choices a valid input for the chain
    drafter's cache entries, which past the kept slots are never read): the output layer (`head`) runs on the
    first `first` nodes of every row, and on the rest only for the rows whose accepted path goes on past them.
    hidden: [L, N, H] the nodes' final-normed states; tokens, parent: [L, N] (a chain is a tree whose node j's
    parent is j - 1); alive: [L, N] real nodes (None: all). The head computes each row alone (dflash's kernels),
    so the choices read are the bits a full head would give."""
    L, N = tokens.shape
    # fewer rows than the head's cost floor gain nothing from waiting
    first = N if L * N <= HEAD_ROWS_AT_ONE_ROW_COST else min(N, max(first, -(-HEAD_ROWS_AT_ONE_ROW_COST // L)))
    choice = tokens.new_zeros((L, N))
    choice[:, :first] = argmax(head(hidden[:, :first]))
    if first == N:
        return choice
    # a node past the first ones may count as accepted by an unread parent's placeholder choice, but only below a
    # node past them that is accepted for real (its first ancestor past them has a read parent): the same rows
    ok = accepted_nodes(tokens, parent, alive, choice, max_depth)
    rows = ok[:, first:].any(1).nonzero()[:, 0].tolist()  # the host decides: free on a CPU
    if rows:
        index = torch.tensor(rows, device=tokens.device)
        choice[index, first:] = argmax(head(hidden[index, first:]))
    return choice


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions [b, P] of left-padded prompts: each row's first real token is at 0 (padding gets 0 too)."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)


class SpecBatch:
    """Target cache, draft cache and the speculative step for a batch of rows.

    Rows are independent sequences at their own positions that write into shared slot columns: every forward
    writes its q tokens at slots [pointer, pointer+q) of every row, and a row's `valid` flags say which slots
    hold its committed tokens. Rolling back is moving the pointer; rows that accepted fewer tokens than the
    others leave masked holes that `make_room` squeezes out when the storage runs out.
    """

    def __init__(self, target, draft: DFlashDraftModel | NgramDraft | None, block_size: int, max_capacity: int,
                 runtime: str = "auto"):
        self.B = block_size if draft is not None else 1
        # an n-gram draft proposes from the text alone: no draft model, no target features
        self.ngram = draft if isinstance(draft, NgramDraft) else None
        draft = None if self.ngram is not None else draft
        self.target, self.draft = target, draft
        # a chain drafter's cache entry j pairs f_j with the token after it, so its pending features wait for
        # those tokens: (features, next ids or None = the rest of the chunk then the anchor, last row index)
        self.eagle = draft if isinstance(draft, Eagle3DraftModel) else None
        self.adapter = make_adapter(target, draft.config.target_layer_ids if draft is not None else None, runtime)
        if isinstance(draft, DFlashDraftModel):
            # beside a 4-bit target the draft's layers run at 4 bits too: every propose streams their weights
            # (the default draft's propose, AVX-512 Xeon, 2 threads, profile_step.py: 1.1-1.2 ms, 1.3 at 8 bits)
            draft.inference_bits = 4 if resolve_runtime(target, runtime).startswith("fast-int4") else 8
            draft.prepare()  # not inside a timed step: the adaptive controllers price steps by their seconds
        # the target's steps are compiled: the draft's too (asked only then, so drafts without the option work)
        self.draft_kw = {"compile": True} if runtime.endswith("-compile") else {}
        self.max_capacity = max_capacity  # enough for every row once the holes are squeezed out
        self.dcache: DraftKVCache | None = None
        self.pending: tuple[torch.Tensor, int] | None = None  # target features not yet in the draft cache, slot
        self.compactions = 0
        # seconds the last step spent writing context held back by earlier steps (the prompt's, or a run of plain
        # steps'): the adaptive controllers price a width by the step's own work, not by what the steps before
        # it left pending (a drafted step after a prompt or a run of plain steps would otherwise look dear, and
        # the choice would stick to plain decoding)
        self.flush_seconds = 0.0
        self.growths = 0

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def num_rows(self) -> int:
        return 0 if self.adapter.valid is None else self.adapter.valid.shape[0]

    @property
    def pointer(self) -> int:
        return self.adapter.pointer

    def start(self, batch_size: int, capacity: int) -> None:
        """Empty storage for `batch_size` rows and `capacity` slots."""
        self.adapter.reset(batch_size, min(capacity, self.max_capacity))
        if self.draft is not None:
            self.dcache = DraftKVCache(self.draft.config, batch_size, self.adapter.capacity, self.device,
                                       self.draft.fc.weight.dtype)
            self.pending = None

    def extend(self, input_ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Appends prompt tokens input_ids [b, q] (left padding: mask False) at positions pos [b, q]; a long
        prompt can come in several chunks. Returns the target's logits at the last position [b, V]."""
        q = input_ids.shape[1]
        if self.pointer + q > self.adapter.capacity:
            self._grow(max(self.pointer + q, min(self.max_capacity, 2 * self.adapter.capacity)))
        slot = self.pointer
        logits, feats = self.adapter.forward(input_ids, pos, capture=self.draft is not None, logits_to_keep=1,
                                             slot_valid=mask)
        if self.draft is not None:
            self.flush(input_ids[:, 0])
            self.dcache.positions[:, slot:slot + q] = pos
            self.pending = (feats.masked_fill(~mask[..., None], 0), slot)
            if self.eagle is not None:
                self._chunk = (input_ids, None, input_ids.new_full((input_ids.shape[0],), q - 1))
        return logits[:, -1]

    def step(self, anchor: torch.Tensor, block_pos: torch.Tensor,
             choose: Callable[[torch.Tensor], torch.Tensor] | None, histories: list[list[int]] | None = None,
             width: int | None = None, tree: "TreeSpec | None" = None, proposals: list[list[int]] | None = None,
             prefix: list[list[int]] | None = None, trim: Callable[[list[list[float]], int], int] | None = None):
        """One speculative step: the draft fills [anchor, MASK x (B-1)], the target checks the block in one
        forward and `choose` turns its logits [L, q, V] into its own choice at every position [L, q]; None: the
        target's argmax (greedy), where the target's output layer then runs only on the rows that are read
        (see `read_choices`): a choice after the first rejected token is never used, and is 0.

        anchor: [L] last committed token of each row; block_pos: [L, B] absolute positions of the block;
        histories: each row's tokens so far (an n-gram draft looks its proposals up there).
        Returns (choice [L, q], accepted [L]): draft tokens 1..accepted equal the target's choices before them,
        so choice[:, :accepted+1] may be committed. Call `commit` next. q = B, except for an n-gram draft,
        whose blocks are only as wide as its longest proposal, and when a narrower `width` is asked for
        (1 = a plain decoding step; the draft cache still receives the target's features).
        tree: verify a candidate tree instead of the argmax chain (a DFlash draft, greedy choices; see dflash.tree):
        the same contract, choice[:, :accepted+1] being the accepted path's tokens and the target's one after.
        proposals: verify these tokens per row (an n-gram continuation, at most width - 1 each) instead of the
        draft's, without running the draft: its cache gets the target's features later, as after a plain step.
        prefix: tokens per row (prompt lookup's continuation of the text) that take the place of the DFlash
        draft's first proposals, its own filling the slots after them: the draft's slots do not see each other's
        guesses, so its later ones are as good after a prefix as after its own.
        trim: for a DFlash draft's block, trim(probs, width) -> how many of its tokens to verify, from the draft's
        probability of each proposal per row (probs [L][width - 1], read to the host; 1.0 for a prefix's
        tokens, which the draft did not propose).
        """
        anchor = anchor[:, None]
        width = self.B if width is None else max(1, min(width, self.B))
        # fresh row-major strides whatever the width (a one-row slice counts as contiguous with its parent's
        # strides): a compiled step's graph is specific to its inputs' stride pattern
        block_pos = block_pos[:, :width].clone(memory_format=torch.contiguous_format)
        if self.draft is not None and proposals is None and (width > 1 or self.eagle is not None):
            # pending target features go into the draft cache before the draft reads it; plain steps leave
            # them pending and `commit` appends theirs, so a run of plain steps writes its context in one go
            # (a chain drafter's entries need the token after each, so it writes every step)
            t = time.perf_counter()
            self.flush(anchor[:, 0])
            self.flush_seconds = time.perf_counter() - t
        else:
            self.flush_seconds = 0.0
        if width == 1:
            verify_ids = anchor
        elif self.ngram is not None or proposals is not None:
            found = ([p[:width - 1] for p in proposals] if proposals is not None else
                     [self.ngram.propose(h, width - 1) for h in histories])
            q = 1 + max(map(len, found))
            # a short proposal is padded with its row's anchor: a pad the target happens to choose is still
            # the target's own token, so acceptance stays exact
            rows = [f + [int(a)] * (q - 1 - len(f)) for f, a in zip(found, anchor[:, 0].tolist())]
            verify_ids = torch.cat([anchor, torch.tensor(rows, dtype=torch.long, device=anchor.device)], 1)
            block_pos = block_pos[:, :q].clone(memory_format=torch.contiguous_format)
        elif self.eagle is not None:
            proposal = self.eagle.chain(*self._chain_start, self.dcache, self.adapter.valid[:, :self.pointer],
                                        width - 1)
            verify_ids = torch.cat([anchor, proposal], 1)
        elif self.draft is not None and tree is not None:
            return self._tree_step(anchor, block_pos, choose, tree)
        elif self.draft is not None:
            mask_block = anchor.new_full((anchor.shape[0], width - 1), self.draft.config.mask_token_id)
            self.draft.keep_confidence = trim is not None
            proposal = self.draft.propose(torch.cat([anchor, mask_block], 1), block_pos, self.dcache,
                                          self.adapter.valid[:, :self.pointer], **self.draft_kw)
            probs = self.draft.last_confidence if trim is not None else None
            if prefix is not None and any(prefix):
                over = torch.tensor([(p + [-1] * (width - 1))[:width - 1] for p in prefix], device=proposal.device)
                proposal = torch.where(over >= 0, over, proposal)
                probs = None if probs is None else torch.where(over >= 0, 1.0, probs)
            if probs is not None:
                keep = trim(probs.tolist(), width)
                if keep < width:
                    width, proposal = keep, proposal[:, :keep - 1]
                    block_pos = block_pos[:, :keep].clone(memory_format=torch.contiguous_format)
            verify_ids = torch.cat([anchor, proposal], 1)
        else:
            verify_ids = anchor
        self._slot, self._block_pos, self._q = self.pointer, block_pos, verify_ids.shape[1]
        lazy = choose is None and self.adapter.lazy_head
        out, self._feats = self.adapter.forward(verify_ids, block_pos, capture=self.draft is not None, head=not lazy)
        if lazy:
            q = verify_ids.shape[1]
            chain = (torch.arange(q, device=self.device) - 1).clamp(min=0).expand_as(verify_ids)
            choice = read_choices(self.adapter.head, out, verify_ids, chain, None, q - 1, (q + 1) // 2)
        else:
            choice = argmax(out) if choose is None else choose(out)
        self._choice = choice
        accepted = (verify_ids[:, 1:] == choice[:, :-1]).long().cumprod(1).sum(1)
        return choice, accepted

    def _tree_step(self, anchor, block_pos, choose, spec: "TreeSpec"):
        """A candidate tree's step: the draft's top-k per slot (read back: the tree is built on the host), the
        tree verified in one forward, its accepted path moved to the block's first slots. Afterwards the state is
        what a chain step accepting that path leaves, so `commit` and everything after it are the same."""
        L = anchor.shape[0]
        mask_block = anchor.new_full((L, self.B - 1), self.draft.config.mask_token_id)
        ids, logp = self.draft.propose_topk(torch.cat([anchor, mask_block], 1), block_pos, self.dcache,
                                            self.adapter.valid[:, :self.pointer], spec.topk, **self.draft_kw)
        host = torch.cat([anchor.float(), ids.reshape(L, -1).float(), logp.reshape(L, -1)], 1).tolist()
        k = ids.shape[2]
        top_ids = [[[int(v) for v in row[1 + s * k:1 + (s + 1) * k]] for s in range(self.B - 1)] for row in host]
        top_logp = [[row[1 + (self.B - 1) * k + s * k:1 + (self.B - 1) * k + (s + 1) * k] for s in range(self.B - 1)]
                    for row in host]
        trees = build_trees([int(row[0]) for row in host], top_ids, top_logp, spec.budget, spec.continuations,
                            self.device, min_nodes=self.B)
        N = trees.size
        if self.pointer + max(N, self.B) >= self.adapter.capacity:
            self.make_room(max(N, self.B))
        p = self.pointer
        lazy = choose is None and self.adapter.lazy_head
        out, feats = self.adapter.forward(trees.tokens, block_pos[:, :1] + trees.depth, capture=True,
                                          tree_mask=trees.visible, head=not lazy)
        # nodes come best path first: the accepted path mostly lies among the first ones
        choice = (read_choices(self.adapter.head, out, trees.tokens, trees.parent, trees.alive, self.B - 1,
                               (N + 3) // 4) if lazy else
                  argmax(out) if choose is None else choose(out))  # [L, N] the target's token after every node
        path, accepted = accept(trees, choice, self.B - 1)  # [L, B] nodes, root first
        self.last_tree = (trees, path, accepted)
        # the accepted path to slots p..p+B, as a chain's block lies; the rest of the tree is dropped
        self.adapter.gather_slots(p, path)
        self.adapter.valid[:, p + self.B:p + N] = False
        self.adapter.rewind(N - self.B)
        self._slot, self._q = p, self.B
        self._block_pos = block_pos[:, :1] + torch.arange(self.B, device=self.device)
        self._feats = feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))
        self._choice = choice.gather(1, path)
        return self._choice, accepted

    def commit(self, n_keep: torch.Tensor, advance: int) -> None:
        """Keeps the first n_keep[r] verified slots of each row ([anchor, accepted drafts]) and moves the
        pointer to the end of the longest (advance = max n_keep, an int the caller has already synced)."""
        p, q = self._slot, self._q
        j = torch.arange(q, device=self.device)
        self.adapter.valid[:, p:p + q] = j < n_keep[:, None]
        if self.draft is not None:
            self.dcache.positions[:, p:p + q] = self._block_pos
            if self.pending is None:
                self.pending = (self._feats, p)
            else:  # a plain step after unwritten ones: the earlier slots up to this step's stay pending
                feats, slot = self.pending
                self.pending = (torch.cat([feats[:, :p - slot], self._feats], 1), slot)
            if self.eagle is not None:  # the token after each kept slot is the target's own choice there
                self._chunk = (None, self._choice, n_keep - 1)
        self.adapter.rewind(q - advance)
        if self.pointer + self.B >= self.adapter.capacity:
            self.make_room()

    def flush(self, next_token: torch.Tensor | None = None):
        """Writes pending target features (of one step, or of a run of plain steps) into the draft cache
        (before a draft forward or moving slots).
        A chain drafter also needs the token after the last pending slot when it is not yet known: the next
        prompt chunk's first token or the anchor (next_token [b]); it keeps its last entry per row
        (stream [b, H], u [b, 2H], position [b]), where its chain starts."""
        if self.pending is None:
            return
        feats, slot = self.pending
        self.pending = None
        if self.eagle is None:
            self.draft.write_context(feats, self.dcache, slot, **self.draft_kw)
            return
        ids, next_ids, last = self._chunk
        if next_ids is None:
            if next_token is None:
                raise RuntimeError("the chain drafter's prompt entries need the token that follows the prompt")
            next_ids = torch.cat([ids[:, 1:], next_token[:, None]], 1)
        stream, u = self.eagle.write_entries(feats, next_ids, self.dcache, slot)
        rows = torch.arange(len(last), device=last.device)
        self._chain_start = (stream[rows, last], u[rows, last], self.dcache.positions[rows, slot + last])

    # ---- reshaping ---------------------------------------------------------------------------------------
    def select_rows(self, keep: torch.Tensor) -> None:
        """Keeps only rows `keep` (finished rows leave the batch: one copy of the caches)."""
        self.adapter.select_rows(keep)
        if self.draft is not None:
            self.dcache.select_rows(keep)
            if self.pending is not None:
                self.pending = (self.pending[0][keep], self.pending[1])
                if self.eagle is not None:
                    self._chunk = tuple(None if t is None else t[keep] for t in self._chunk)
            elif self.eagle is not None:  # already flushed: the chain starts are ready
                self._chain_start = tuple(t[keep] for t in self._chain_start)

    def merge(self, other: "SpecBatch") -> None:
        """Appends the rows of `other` (freshly prefilled sequences) to this batch."""
        if self.num_rows == 0:
            self.adapter, self.dcache, self.pending = other.adapter, other.dcache, other.pending
            return
        self.flush()
        other.flush()
        shifts = self.adapter.merge(other.adapter)
        if self.draft is not None:
            self.dcache.merge(other.dcache, shifts, self.adapter.capacity)
        if self.pointer + self.B >= self.adapter.capacity:
            self.make_room()

    def mask_rows(self, rows: torch.Tensor) -> None:
        """Masks every slot of these rows (finished ones, whose place a joining sequence will take)."""
        self.adapter.valid[rows] = False

    def put_row(self, row: int, other: "SpecBatch") -> bool:
        """Puts the one row of `other` (a freshly prefilled sequence) in place of row `row` (a finished one),
        its slots ending at this batch's pointer: one row's copy instead of `merge`'s copy of every row. False
        (nothing done) when its prompt is longer than the batch's slots so far."""
        shift = self.pointer - other.pointer
        if shift < 0 or self.eagle is not None:
            return False
        self.flush()
        other.flush()
        self.adapter.put_row(row, other.adapter, shift)
        if self.draft is not None:
            self.dcache.put_row(row, other.dcache, shift, other.pointer)
        return True

    def _grow(self, capacity: int) -> None:
        self.adapter.grow(capacity)
        self.growths += 1
        if self.draft is not None:
            self.dcache.grow(capacity)

    def _compact(self) -> None:
        self.compactions += 1
        index, new_valid = self.adapter.compaction_index()
        self.adapter.compact(index, new_valid)
        if self.draft is not None:
            self.dcache.gather_slots(index)

    def make_room(self, B: int | None = None) -> None:
        """Frees room for the next block (B slots, default the block size) and one slot more: squeeze out holes
        when there are enough, else grow (doubling), and squeeze anyway once the storage is at its full size (which
        always fits every row after compaction). The spare slot keeps a step's slots short of the storage's end:
        torch.compile specialises a compiled step on whether they reach it, so a step that did would build a graph
        of its own mid-run, at whatever moment rows happened to fill the storage exactly."""
        adapter, B = self.adapter, (B or self.B) + 1
        self.flush()  # pending features must be in the draft cache before slots move
        if adapter.pointer - int(adapter.valid.sum(1).max()) >= B:
            self._compact()
        if adapter.pointer + B > adapter.capacity and adapter.capacity < self.max_capacity:
            self._grow(min(self.max_capacity, max(adapter.pointer + B, 2 * adapter.capacity)))
        if adapter.pointer + B > adapter.capacity:
            self._compact()
