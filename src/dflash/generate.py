"""Lossless speculative generation with a DFlash draft, and the plain autoregressive baseline.

Both run the same loop: a step feeds the target [anchor, draft_1..draft_{B-1}] (B = 1 and no draft for the
baseline), the target's choice at every position is its argmax or a sample, and each row commits the longest
prefix where the draft agreed plus the target's own next token. Every committed token is the target's
choice given a prefix that was itself committed, so greedy output equals the target's greedy output and
sampled output has exactly the target's distribution.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .adaptive import TREE, TreeBudgetController, WidthController, trims_pay
from .batch import SpecBatch, prompt_positions, step_args
from .eagle import Eagle3DraftModel
from .fast import resolve_runtime
from .errors import DFlashInputError
from .model import DFlashDraftModel
from .ngram import NgramDraft
from .sampling import SamplingParams, choose_tokens
from .tree import NGRAM as FROM_NGRAM


@dataclass
class TreeOptions:
    budget: int | None  # draft nodes per tree; None: chosen step by step (dflash.adaptive.TreeBudgetController)
    topk: int = 4  # the draft's best tokens per slot that paths are made of
    ngram: bool = True  # add the text's n-gram continuation as a branch


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [b, P + max new] prompt (as given, left-padded) + new tokens, right-padded
    num_new_tokens: list[int]
    block_size: int  # 1 for plain decoding
    acceptance_lengths: list[int] = field(repr=False)  # tokens committed per (row, step), bonus included
    num_steps: int = 0  # draft + verify steps after the prefill
    # per row: the steps it took part in, and the tokens they committed (its acceptance lengths summed): a row's
    # own τ, which `dflash evaluate` keeps per prompt so that two drafts compare prompt by prompt
    row_steps: list[int] = field(default_factory=list, repr=False)
    row_accepted: list[int] = field(default_factory=list, repr=False)
    compactions: int = 0  # times the cache squeezed out the holes left by rows that accepted less
    cache_growths: int = 0  # times the cache storage was enlarged (answers longer than it started for)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    width_counts: list[int] | None = None  # adaptive width: steps verified at each width 0..B (index = width)
    # adaptive trees: steps per check chosen, e.g. {"plain": 90, "ngram-3": 40, "tree-8": 2}
    step_choices: dict[str, int] | None = None
    runtime: str = ""  # the target's forward that ran ('auto' resolved, see dflash.fast.resolve_runtime)
    # candidate trees: per (row, step) the accepted drafts, the rank of the accepted path among the draft's
    # paths (-1: an n-gram branch alone) and its source (1 draft, 2 n-gram, 3 both); see dflash.tree
    tree_paths: list[tuple[int, int, int]] | None = field(default=None, repr=False)

    @property
    def tau(self) -> float:
        """Mean acceptance length τ (bonus token included; 1.0 for plain decoding)."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def acceptance_histogram(self) -> list[int]:
        """Counts of acceptance lengths 1..block_size (index k-1 holds length k)."""
        h = [0] * self.block_size
        for a in self.acceptance_lengths:
            h[a - 1] += 1
        return h

    @property
    def time_per_output_token(self) -> float:
        """Decode time after the first token over the tokens that followed it (longest row)."""
        n = max(self.num_new_tokens, default=0)
        return (self.total_time - self.time_to_first_token) / (n - 1) if n > 1 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.num_new_tokens) / self.total_time if self.total_time > 0 else 0.0

    def summary(self) -> str:
        widths = f", widths={self.width_counts[1:]}" if self.width_counts else ""
        if self.step_choices:
            widths += f", checks={self.step_choices}"
        return (f"{sum(self.num_new_tokens)} new tokens, {self.tokens_per_second:.1f} tok/s, τ={self.tau:.2f}, "
                f"steps={self.num_steps}, ttft={self.time_to_first_token * 1000:.0f} ms, "
                f"histogram={self.acceptance_histogram}{widths}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_stop_token_ids(target) -> list[int]:
    for cfg in (getattr(target, "generation_config", None), target.config.get_text_config()):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    return []


def _pad_token_id(target, stop_ids: list[int]) -> int:
    for cfg in (getattr(target, "generation_config", None), target.config.get_text_config()):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return stop_ids[0] if stop_ids else 0


def _check_inputs(target, input_ids, attention_mask, max_new_tokens):
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise DFlashInputError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise DFlashInputError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.as_tensor(attention_mask)
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if attention_mask.shape != input_ids.shape:
        raise DFlashInputError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                               f"input_ids shape {tuple(input_ids.shape)}")
    mask = attention_mask.to(torch.bool)
    empty = (~mask.any(1)).nonzero().flatten().tolist()
    if empty:
        raise DFlashInputError(f"empty prompt in batch row(s) {empty}: attention_mask has no ones")
    # left padding only: once a row's real tokens start they must run to the end
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise DFlashInputError("attention_mask has padding after real tokens; pad on the left "
                               "(tokenizer.padding_side = 'left')")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise DFlashInputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if int(input_ids[mask].min()) < 0 or int(input_ids[mask].max()) >= vocab:
        raise DFlashInputError(f"input_ids contain ids outside the vocabulary (size {vocab})")
    longest = int(mask.sum(1).max())
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit and longest + max_new_tokens > limit:
        raise DFlashInputError(f"prompt too long: {longest} prompt tokens + max_new_tokens={max_new_tokens} "
                               f"exceeds the model's context of {limit} tokens")
    device = next(target.parameters()).device
    return input_ids.to(device), mask.to(device)


class _Generation:
    """State of one batched generation; `steps()` yields the tokens each step commits, row by row."""

    def __init__(self, target, draft: DFlashDraftModel | None, input_ids, attention_mask, *, block_size,
                 max_new_tokens, sampling: SamplingParams, stop_token_ids, generator, runtime="auto",
                 adaptive_width: bool = False, tree: TreeOptions | None = None, prompt_lookup: bool = False):
        self.target, self.draft = target, draft
        self.input_ids, self.mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens)
        self.device = self.input_ids.device
        self.B = block_size if draft is not None else 1
        self.max_new = max_new_tokens
        self.sampling = sampling
        self.runtime = runtime
        self.generator = generator
        self.stop_ids = default_stop_token_ids(target) if stop_token_ids is None else list(stop_token_ids)
        self.stop = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        self.pad_id = _pad_token_id(target, self.stop_ids)
        b = self.input_ids.shape[0]
        # room for a whole block past max_new_tokens, so the scatter in _commit never needs clamping
        self.out = torch.full((b, max_new_tokens + self.B), self.pad_id, dtype=torch.long, device=self.device)
        self.n_gen = torch.zeros(b, dtype=torch.long, device=self.device)
        self.acceptance: list[int] = []
        self.row_steps, self.row_accepted = [0] * b, [0] * b
        self.num_steps = 0
        # an n-gram draft already sizes its blocks by what it found; a seeded sampling run keeps whole blocks,
        # so that its draws do not depend on timing and repeat
        self.widths = WidthController(self.B) if adaptive_width and draft is not None and \
            not isinstance(draft, NgramDraft) and (sampling.greedy or generator is None) else None
        if self.widths is not None:
            # a DFlash draft's block is trimmed to what its probabilities say pays; a chain drafter's length is
            # set before it drafts
            self.widths.trims = not isinstance(draft, Eagle3DraftModel) and trims_pay(self.device)
        # candidate trees where they stay exact: a DFlash draft, greedy choices (sampling verifies the chain)
        self.tree = tree if (tree is not None and sampling.greedy and isinstance(draft, DFlashDraftModel) and
                             not isinstance(draft, Eagle3DraftModel)) else None
        self.budgets = None
        if self.tree is not None:
            self.widths = None
            if self.tree.budget is None:
                self.budgets = TreeBudgetController(self.B, ngram_sizes=None if self.tree.ngram else [])
        self.tree_stats: list[tuple[int, int, int]] = []  # per (row, step): accepted, rank of its path, source
        # prompt lookup ahead of a DFlash chain's own proposals: where the text's last 3 (else 2) tokens occurred
        # before, what followed them there fills the block's first slots (a draft layer that cannot look
        # anything up in its context misses exactly those tokens; see dflash.evaluate.copyable)
        self.prompt_lookup = NgramDraft.repeats(self.B - 1) if (
            prompt_lookup and self.tree is None and isinstance(draft, DFlashDraftModel) and
            not isinstance(draft, Eagle3DraftModel)) else None
        self.history: list[array] | None = None  # each row's text so far, on the host, where lookups need it
        self.ttft = 0.0
        self.total = 0.0

    def _commit(self, live: torch.Tensor, choice: torch.Tensor, n_commit: torch.Tensor, done: torch.Tensor):
        """Appends choice[:, :n] to each live row, cut at the first stop token and at max_new_tokens.
        live: [L] batch rows still decoding; choice: [L, q]; n_commit, done: [L]. Returns (n_take, done)."""
        q = choice.shape[1]
        j = torch.arange(q, device=self.device)
        n_gen = self.n_gen[live]
        is_stop = torch.isin(choice, self.stop) & (j < n_commit[:, None])
        first_stop = torch.where(is_stop.any(1), is_stop.to(torch.int8).argmax(1) + 1, q + 1)
        n_take = torch.minimum(torch.minimum(n_commit, self.max_new - n_gen), first_stop)
        n_take = torch.where(done, 0, n_take)
        idx = n_gen[:, None] + j
        rows = self.out[live]
        rows.scatter_(1, idx, torch.where(j < n_take[:, None], choice, rows.gather(1, idx)))
        self.out[live] = rows
        n_gen = n_gen + n_take
        self.n_gen[live] = n_gen
        done = done | (first_stop <= n_take) | (n_gen >= self.max_new)
        return n_take, done

    @torch.inference_mode()  # on a generator, active only while it runs, not between yields
    def steps(self) -> Iterator[list[list[int]]]:
        t0 = time.perf_counter()
        b, P = self.input_ids.shape
        if self.max_new == 0:
            return
        # enough for every row after compaction; storage starts smaller and grows only if answers run long
        most = (self.tree.budget or self.budgets.largest_tree) if self.tree is not None else 0
        # a tree's nodes at the end, and the spare slot of SpecBatch.make_room
        room = self.B + (most + self.B if self.tree is not None else 0) + 1
        self.batch = batch = SpecBatch(self.target, self.draft, self.B, P + self.max_new + room, self.runtime)
        batch.start(b, P + min(self.max_new, 256) + self.B)
        live = torch.arange(b, device=self.device)  # batch rows still decoding (finished ones are retired)
        pos = prompt_positions(self.mask)
        anchor_pos = self.mask.sum(1)  # [b] position of each row's last committed token (the anchor)

        # prefill: the whole prompt in one forward; the first token is the target's alone
        first = choose_tokens(batch.extend(self.input_ids, pos, self.mask), self.sampling, self.generator)  # [b]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        _, done = self._commit(live, first[:, None], torch.ones_like(first), done)
        _sync(self.device)
        self.ttft = time.perf_counter() - t0
        yield [[t] for t in first.tolist()]
        if batch.ngram is not None or (self.tree is not None and self.tree.ngram) or self.prompt_lookup is not None:
            prompts = [self.input_ids[r][self.mask[r]].tolist() for r in range(b)]
            self.history = [array("i", p + [t]) for p, t in zip(prompts, first.tolist())]
        # matches up to the longest length the budget controller tells apart (a longer match proposes better)
        lookup = NgramDraft(num_tokens=self.B - 1, max_ngram=TreeBudgetController.MATCH_BUCKETS[-1]) \
            if self.tree is not None and self.tree.ngram else None

        j = torch.arange(self.B, device=self.device)
        live_rows = list(range(b))  # the host's copy of `live`
        done_rows = done.tolist()  # and of `done`, as of the last step
        n_done = sum(done_rows)
        while n_done < len(live_rows):
            if n_done >= max(1, len(live_rows) // 8):
                # retire finished rows so the batch stops paying for them (one copy of the caches)
                keep_rows = [i for i, d in enumerate(done_rows) if not d]
                keep = torch.tensor(keep_rows, device=self.device)
                live, done, anchor_pos = live[keep], done[keep], anchor_pos[keep]
                live_rows = [live_rows[i] for i in keep_rows]
                batch.select_rows(keep)
            n_gen = self.n_gen[live]
            anchor = self.out[live].gather(1, (n_gen - 1)[:, None])[:, 0]  # [L] last committed token
            # n-gram lookups run on the host
            histories = [self.history[r] for r in live_rows] if batch.ngram is not None else None
            t_step = time.perf_counter()
            width = self.widths.choose(len(live_rows)) if self.widths is not None else None
            spec, option, found, proposals, prefix = None, None, None, None, None
            drafts = (width or self.B) - 1
            if self.prompt_lookup is not None and drafts > 0:
                prefix = [self.prompt_lookup.propose(self.history[r], drafts) for r in live_rows]
            if self.tree is not None:
                found = None if lookup is None else [lookup.match(self.history[r]) for r in live_rows]
                option = (self.budgets.choose(len(live_rows), None if found is None else [n for n, _ in found])
                          if self.budgets is not None else (TREE, self.tree.budget))
                spec, proposals, width = step_args(option, found, self.tree.topk, self.B)
            trim = self.widths.trim if self.widths is not None and self.widths.trimming else None
            choice, accepted = batch.step(anchor, anchor_pos[:, None] + j,
                                          None if self.sampling.greedy else
                                          lambda logits: choose_tokens(logits, self.sampling, self.generator),
                                          histories, width, spec, proposals, prefix, trim)
            active = ~done
            n_take, done = self._commit(live, choice, accepted + 1, done)
            anchor_pos = anchor_pos + n_take
            # the step's one read back to the host (on a GPU, its one synchronisation): what each row commits
            L, q = len(live_rows), choice.shape[1]
            host = torch.cat([n_take, accepted + 1, done.long(), active.long(), choice.reshape(-1)]).tolist()
            n_rows, done_rows, tokens = host[:L], host[2 * L:3 * L], host[4 * L:]
            acc = []  # the active rows' acceptance lengths, also summed per row
            for r, a, on in zip(live_rows, host[L:2 * L], host[3 * L:4 * L]):
                if on:
                    acc.append(a)
                    self.row_steps[r] += 1
                    self.row_accepted[r] += a
            n_done = sum(done_rows)
            # the cache keeps [anchor, accepted drafts] = the slots before the new anchor
            batch.commit(n_take, max(n_rows))
            seconds = time.perf_counter() - t_step - batch.flush_seconds
            if self.widths is not None:  # at the width verified, which a trim may have narrowed
                self.widths.observe([a - 1 for a in acc], q, L * q, seconds, drafted=width > 1)
            if self.budgets is not None:
                self.budgets.observe([a - 1 for a in acc], option, seconds,
                                     [n for (n, _), on in zip(found, host[3 * L:4 * L]) if on] if found else None, q)
            self.acceptance += acc
            self.num_steps += 1
            step = [[] for _ in range(b)]
            for i, (r, n) in enumerate(zip(live_rows, n_rows)):
                step[r] = tokens[i * q:i * q + n]
                if self.history is not None:
                    self.history[r].extend(step[r])
            if spec is not None:
                self._tree_stats(batch.last_tree, live_rows, host[3 * L:4 * L])
            elif proposals is not None:  # an n-gram chain: its accepted tokens came from the text
                self.tree_stats += [(a - 1, -1 if a > 1 else 0, FROM_NGRAM if a > 1 else 0)
                                    for a in acc]
            yield step
        _sync(self.device)
        self.total = time.perf_counter() - t0

    def _tree_stats(self, last_tree, live_rows: list[int], active: list[int]) -> None:
        """Per active row: accepted draft tokens, the rank of the accepted path among the draft's paths (-1: an
        n-gram branch alone; 0 when nothing was accepted) and where it came from (DRAFT | NGRAM bits)."""
        trees, path, accepted = last_tree
        deepest = path.gather(1, accepted[:, None])[:, 0].tolist()  # a small read, of stats only
        for i, (node, on) in enumerate(zip(deepest, active)):
            if on:
                self.tree_stats.append((trees.depth[i, node].item() if node else 0, trees.rank[i][node],
                                        trees.source[i][node]))

    def result(self) -> GenerationOutput:
        n = self.n_gen.tolist()
        width = max(n, default=0)
        seq = torch.cat([self.input_ids, self.out[:, :width]], 1)
        return GenerationOutput(sequences=seq, num_new_tokens=n, block_size=self.B,
                                acceptance_lengths=self.acceptance, num_steps=self.num_steps,
                                row_steps=self.row_steps, row_accepted=self.row_accepted,
                                compactions=self.batch.compactions if self.max_new else 0,
                                cache_growths=self.batch.growths if self.max_new else 0,
                                time_to_first_token=self.ttft, total_time=self.total,
                                width_counts=self.widths.width_counts if self.widths is not None else None,
                                runtime=resolve_runtime(self.target, self.runtime),
                                tree_paths=self.tree_stats if self.tree is not None else None,
                                step_choices=self.budgets.choice_counts() if self.budgets is not None else None)


def _resolve_block_size(draft: DFlashDraftModel, block_size, num_speculative_tokens) -> int:
    if block_size is not None and num_speculative_tokens is not None and block_size != num_speculative_tokens:
        raise DFlashInputError(f"block_size={block_size} and num_speculative_tokens={num_speculative_tokens} "
                               "disagree (both mean the block size B here)")
    B = block_size if block_size is not None else num_speculative_tokens
    if B is None:
        B = draft.block_size if isinstance(draft, NgramDraft) else draft.config.block_size
    if not isinstance(B, int) or B < 2:
        raise DFlashInputError(f"block size must be an integer >= 2, got {B!r}")
    return B


def stream_generate(target, draft: DFlashDraftModel | None, input_ids, attention_mask=None, *, block_size=None,
                    num_speculative_tokens=None, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, stop_token_ids=None,
                    generator: torch.Generator | None = None, runtime: str = "auto",
                    adaptive_width: bool = False, tree_budget: int | str | None = None, tree_topk: int = 4,
                    tree_ngram: bool = True, prompt_lookup: bool = False) -> Iterator[list[list[int]]]:
    """Streaming form of `spec_generate` (draft=None: plain decoding). Yields, after every step, the list of
    token ids each row committed in that step. The generator's return value is the GenerationOutput.
    runtime: 'auto' | 'fast' | 'hf', the target's forward (see dflash.fast). adaptive_width: verify each
    step only as many drafted tokens as pay for their cost (see dflash.adaptive); off, every step verifies
    the whole block. tree_budget: verify candidate trees of that many draft nodes (the most probable paths
    through the draft's `tree_topk` best tokens per slot, and with `tree_ngram` the text's n-gram
    continuation) instead of the argmax chain (greedy only; see dflash.tree); 'auto': step by step what pays
    (dflash.adaptive.TreeBudgetController): a plain step, the n-gram continuation alone, or a tree.
    prompt_lookup: where the text's last 3 (else 2) tokens occurred before, the tokens that followed them there
    take the place of a DFlash draft's first proposals in the chain (the rest stay the draft's)."""
    B = 1
    if draft is not None:
        B = _resolve_block_size(draft, block_size, num_speculative_tokens)
        if not isinstance(draft, NgramDraft) and not draft.is_bound_to(target):
            draft.bind(target)  # checks that the draft fits this target
    if tree_budget is not None and tree_budget != "auto" and (not isinstance(tree_budget, int) or tree_budget < 1):
        raise DFlashInputError(f"tree_budget must be an integer >= 1 or 'auto', got {tree_budget!r}")
    if tree_topk < 1:
        raise DFlashInputError(f"tree_topk must be >= 1, got {tree_topk}")
    tree = None if tree_budget is None else TreeOptions(None if tree_budget == "auto" else tree_budget, tree_topk,
                                                        tree_ngram)
    g = _Generation(target, draft, input_ids, attention_mask, block_size=B, max_new_tokens=max_new_tokens,
                    sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                    stop_token_ids=stop_token_ids, generator=generator, runtime=runtime,
                    adaptive_width=adaptive_width, tree=tree, prompt_lookup=prompt_lookup)
    yield from g.steps()
    return g.result()


def run(stream) -> GenerationOutput:
    """Drives a `stream_generate` stream to its end and returns its GenerationOutput."""
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return stop.value


@torch.inference_mode()
def spec_generate(target, draft: DFlashDraftModel, input_ids, attention_mask=None, *, block_size=None,
                  num_speculative_tokens=None, max_new_tokens: int = 256, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, stop_token_ids=None, generator: torch.Generator | None = None,
                  return_stats: bool = False, runtime: str = "auto", adaptive_width: bool = False,
                  tree_budget: int | str | None = None, tree_topk: int = 4, tree_ngram: bool = True,
                  prompt_lookup: bool = False):
    """DFlash speculative generation.

    `num_speculative_tokens` is the block size B (anchor + B-1 drafted tokens), as in the published example;
    vLLM's setting of the same name counts B-1. Returns the sequences like HF `generate` (prompt as given,
    then new tokens, rows that stopped early padded on the right), or a GenerationOutput with stats.
    tree_budget / tree_topk / tree_ngram: candidate-tree verification; prompt_lookup: the text's own
    continuation ahead of the draft's proposals (see stream_generate).
    """
    if draft is None:
        raise DFlashInputError("spec_generate needs a draft; use ar_generate for plain decoding")
    out = run(stream_generate(target, draft, input_ids, attention_mask, block_size=block_size,
                               num_speculative_tokens=num_speculative_tokens, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
                               generator=generator, runtime=runtime, adaptive_width=adaptive_width,
                               tree_budget=tree_budget, tree_topk=tree_topk, tree_ngram=tree_ngram,
                               prompt_lookup=prompt_lookup))
    return out if return_stats else out.sequences


@torch.inference_mode()
def ar_generate(target, input_ids, attention_mask=None, *, max_new_tokens: int = 256, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, stop_token_ids=None, generator: torch.Generator | None = None,
                return_stats: bool = False, runtime: str = "auto"):
    """Plain autoregressive decoding through the same loop, cache and sampling code as `spec_generate`."""
    out = run(stream_generate(target, None, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
                               generator=generator, runtime=runtime))
    return out if return_stats else out.sequences
