"""Continuous batching: sequences join and leave between steps, and every step is one batched DFlash step.

schedule -> run -> postprocess, as in nano-vllm: the `Scheduler` knows sequences (waiting, prefilling,
running), the `ModelRunner` knows tensors (one `SpecBatch` for all running rows, one for the prompts being
prefilled), and `LLMEngine.step` ties them together. HTTP lives in `server.py` only.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from array import array
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum

import torch

from .adaptive import TREE, TreeBudgetController, WidthController, trims_pay
from .batch import SpecBatch, step_args
from .ngram import NgramDraft
from .compiled import built_graphs_only
from .errors import DFlashInputError
from .generate import default_stop_token_ids
from .kernels import argmax
from .machine import available_memory
from .model import DFlashDraftModel
from .sampling import SamplingParams, choose_tokens

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue; the client should retry later (HTTP 429)."""


@dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences decoding together
    max_queue: int = 64  # sequences waiting for a batch slot before new requests are refused
    block_size: int | None = None  # None: the draft's own
    max_model_len: int | None = None  # None: the target's context length
    # prompt tokens prefilled per step while other sequences decode; also the size of the chunks a long prompt is
    # read in (counted from its start, whatever else is prefilled beside it)
    prefill_tokens: int = 512
    runtime: str = "auto"  # the target's forward: auto | fast | hf (see dflash.fast)
    # tokens verified per step over the whole batch: with many sequences running, blocks narrow (down to plain
    # decoding) so that checking drafts that will mostly be rejected does not cost more than it gains
    max_verify_tokens: int = 64
    # within that cap, verify only as many drafted tokens per row as the measured acceptance pays for (see
    # dflash.adaptive); off, every step verifies whole blocks up to the cap
    adaptive_width: bool = True
    # bytes the KV caches (target and draft) may take; None: 90% of the GPU's free memory, half the CPU's
    # available memory. Sequences wait for room rather than run the machine out of memory
    kv_cache_memory: int | None = None
    # candidate trees (dflash.tree) for steps whose rows all decode greedily: draft nodes per row, or "auto" (as
    # many as pay, step by step); None: blocks
    tree_budget: int | str | None = None
    tree_topk: int = 4
    # where a row's text repeats (its last 3, else 2 tokens occurred before), what followed them there fills the
    # first slots of its block ahead of the draft's own proposals (see dflash.generate's prompt_lookup)
    prompt_lookup: bool = False


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class TextStream:
    """Committed token ids -> text deltas: holds back incomplete UTF-8 and anything that may start a stop
    string, and cuts the text where a stop string appears."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string was found; text ends before it

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def push(self, ids: list[int], final: bool = False) -> str:
        """Adds ids; returns the text that is now safe to show."""
        if not self.stopped:
            self.ids += ids
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
        end = len(self.text)
        if not (final or self.stopped):
            if self.text.endswith("\ufffd"):
                end = len(self.text.rstrip("\ufffd"))
            end = min(end, len(self.text) - self._partial_stop())
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:end], end
        return delta


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request: its prompt, sampling settings, the tokens committed so far and why it stopped."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] = field(default_factory=list)
    text: TextStream | None = None  # detokenizes and watches stop strings when set
    generator: torch.Generator | None = None
    on_update: object = None  # called as on_update(seq, text_delta) from the engine thread after each step
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None  # the stop token that ended it (not in output_ids)
    acceptance_lengths: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    aborted: bool = False  # set from any thread; the engine drops the sequence at its next step
    # sampled with the client's seed: its draws must repeat, so the steps it is in keep a width that does not
    # depend on timing
    seeded: bool = False
    # prompt and output as one array, extended as tokens commit: what a step's n-gram lookups search
    token_ids: array = field(init=False, repr=False)

    def __post_init__(self):
        self.token_ids = array("i", self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def append(self, tokens: list[int]) -> str:
        """Commits tokens up to the first stop token or max_tokens; returns the new text."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        room = self.max_tokens - len(self.output_ids)  # a stop token takes its place among them
        tokens = tokens[:room]
        for i, t in enumerate(tokens):
            if t in self.stop_token_ids:
                tokens, self.finish_reason, self.stop_token_id = tokens[:i], "stop", t
                break
        else:
            if len(tokens) == room:
                self.finish_reason = "length"
        self.output_ids += tokens
        self.token_ids.extend(tokens)
        if self.text is None:
            return ""
        delta = self.text.push(tokens, final=self.finish_reason is not None)
        if self.text.stopped:
            self.finish_reason = "stop"
            delta += self.text.push([], final=True)
        return delta


class Scheduler:
    """Decides, before every step, which sequences are prefilled and which decode. Thread-safe `add`."""

    def __init__(self, config: EngineConfig, kv_budget_tokens: int | None = None, block_size: int = 1):
        self.config = config
        # cache slots the running rows may take in all: rows x the longest row, twice over for the storage's
        # growth by doubling and the holes rejected drafts leave until a compaction
        self.kv_budget_tokens = kv_budget_tokens
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        with self.lock:
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFullError(f"the queue is full ({self.config.max_queue} requests waiting); retry later")
            self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def drop_aborted(self) -> tuple[list[Sequence], list[Sequence]]:
        """Takes aborted sequences out of the queue and the running batch; returns (all dropped, those that
        held batch rows). One being prefilled finishes its prefill first and leaves at the next step."""
        with self.lock:
            queued = [s for s in self.waiting if s.aborted]
            for s in queued:
                self.waiting.remove(s)
        held = [s for s in self.running if s.aborted]
        self.running = [s for s in self.running if not s.aborted]
        for s in queued + held:
            s.status, s.finish_reason = Status.FINISHED, "abort"
        return queued + held, held

    def admit(self) -> list[Sequence]:
        """Waiting sequences to start prefilling now: as many as fit the free rows and the prefill budget
        (always at least one when a row is free, however long its prompt: it is then prefilled in chunks)."""
        if self.prefilling:
            return []
        free = self.config.max_batch_size - len(self.running)
        picked, tokens = [], 0
        longest = max((self.final_length(s) for s in self.running), default=0)
        with self.lock:
            while self.waiting and len(picked) < free:
                n = self.waiting[0].num_prompt_tokens
                if picked and tokens + n > self.config.prefill_tokens:
                    break
                longest = max(longest, self.final_length(self.waiting[0]))
                if not self.fits(len(self.running) + len(picked) + 1, longest):
                    break  # it waits until finished sequences make room
                picked.append(self.waiting.popleft())
                tokens += n
        for s in picked:
            s.status = Status.PREFILLING
        self.prefilling = picked
        return picked

    def final_length(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens + seq.max_tokens + self.block_size

    def fits(self, rows: int, longest: int) -> bool:
        return self.kv_budget_tokens is None or 2 * rows * longest <= self.kv_budget_tokens

    def prefilled(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.status = Status.RUNNING
        self.running += seqs
        self.prefilling = [s for s in self.prefilling if s.status is Status.PREFILLING]

    def finish(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.status = Status.FINISHED
        self.running = [s for s in self.running if s.status is not Status.FINISHED]


def _choose_per_row(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each row's own sampling settings: logits [L, ..., V] -> choices [L, ...]."""
    choice = argmax(logits)
    for r, s in enumerate(seqs):
        if s is not None and not s.sampling.greedy:
            choice[r] = choose_tokens(logits[r], s.sampling, s.generator)
    return choice


@dataclass(eq=False)
class _PrefillJob:
    seq: Sequence
    job: SpecBatch  # its own one-row batch, merged into the running one when the prompt is read
    ids: torch.Tensor  # [1, P]
    done: int = 0  # prompt tokens read so far


class ModelRunner:
    """The tensors: one SpecBatch holding every running row, and one per prompt being prefilled."""

    def __init__(self, target, draft: DFlashDraftModel | None, block_size: int, max_model_len: int,
                 runtime: str = "auto", max_verify_tokens: int = 64, adaptive_width: bool = True,
                 prefill_chunk: int = 512, tree_budget: int | str | None = None, tree_topk: int = 4,
                 prompt_lookup: bool = False):
        self.target, self.draft = target, draft
        self.B = block_size if draft is not None else 1
        self.widths = self.width_controller() if adaptive_width and draft is not None else None
        self.tree_budget = tree_budget if draft is not None and draft.config.draft_method == "dflash" else None
        self.tree_topk = tree_topk
        self.budgets = TreeBudgetController(self.B) if self.tree_budget == "auto" else None
        most = (self.budgets.largest_tree if self.budgets else self.tree_budget) if self.tree_budget else 0
        # a tree's nodes at the end, and the spare slot of SpecBatch.make_room
        self.max_capacity = max_model_len + self.B + (most + self.B if most else 0) + 1
        self.lookup = NgramDraft(num_tokens=self.B - 1, max_ngram=TreeBudgetController.MATCH_BUCKETS[-1]) \
            if self.tree_budget is not None else None
        self.prompt_lookup = NgramDraft.repeats(self.B - 1) if prompt_lookup and draft is not None else None
        self.device = next(target.parameters()).device
        self.runtime = runtime
        self.max_verify_tokens = max_verify_tokens
        # running sequences, in batch-row order; None: a finished sequence's row, kept for a joining one to take
        # (one row's copy) rather than copying every other row twice, out of the batch and back into it
        self.rows: list[Sequence | None] = []
        self.batch = SpecBatch(target, draft, self.B, self.max_capacity, runtime)
        with torch.inference_mode():  # see LLMEngine.step
            self.anchor = torch.zeros(0, dtype=torch.long, device=self.device)  # [L] last committed token
            self.anchor_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [L] its position
        self.width_plan: deque[int] = deque()  # widths of the next decode steps, ahead of the controller
        self.last_width = self.B  # of the last decode step: its rows each verified last_width - 1 drafts
        self._prefill: list[_PrefillJob] = []  # admitted sequences whose prompts are being read
        self.prefill_chunk_size = prefill_chunk

    def start_prefill(self, seqs: list[Sequence]) -> None:
        """One prefill job per sequence: alone in its batch, unpadded, it is computed the same whatever else
        joins with it (with the batch-invariant runtimes, a request's answer does not depend on who else is
        being served)."""
        for s in seqs:
            ids = torch.tensor([s.prompt_ids], dtype=torch.long, device=self.device)
            job = SpecBatch(self.target, self.draft, self.B, self.max_capacity, self.runtime)
            job.start(1, ids.shape[1] + self.B)
            self._prefill.append(_PrefillJob(s, job, ids))

    def prefill_chunk(self, budget: int) -> list[tuple[Sequence, int]]:
        """Prefills up to `budget` prompt tokens, job by job in admission order, each in chunks of the fixed size
        `prefill_chunk` counted from its prompt's start (so a prompt's chunks, and their arithmetic, never depend
        on the other jobs). A job whose prompt is done chooses its first token and its row joins the running
        batch. Returns (sequence, first token) for those."""
        done = []
        while self._prefill and budget > 0:
            p = self._prefill[0]
            P = p.ids.shape[1]
            end = min(P, p.done + self.prefill_chunk_size)
            pos = torch.arange(p.done, end, device=self.device)[None]
            logits = p.job.extend(p.ids[:, p.done:end], pos, torch.ones_like(pos, dtype=torch.bool))
            budget -= end - p.done
            p.done = end
            if end < P:
                continue
            self._prefill.pop(0)
            first = _choose_per_row(logits, [p.seq])
            free = next((r for r, s in enumerate(self.rows) if s is None), None)
            if free is not None and self.batch.put_row(free, p.job):
                self.rows[free] = p.seq
                self.anchor[free], self.anchor_pos[free] = first[0], pos[0, -1] + 1
            else:  # no free row, or a prompt longer than the batch so far: it joins as a new row (in place of one)
                if free is not None:
                    self._keep_rows([r for r in range(len(self.rows)) if r != free])
                self.batch.merge(p.job)
                self.rows.append(p.seq)
                self.anchor = torch.cat([self.anchor, first])
                self.anchor_pos = torch.cat([self.anchor_pos, pos[:, -1] + 1])
            done.append((p.seq, int(first[0])))
        return done

    def width_controller(self) -> WidthController:
        widths = WidthController(self.B)
        # a DFlash draft's block is trimmed to what its probabilities say pays (a chain drafter's length is set
        # before it drafts)
        device = next(self.target.parameters()).device
        widths.trims = self.draft.config.draft_method == "dflash" and trims_pay(device)
        return widths

    def decode(self) -> tuple[list[list[int]], list[int]]:
        """One DFlash step over every running row. Returns the tokens each row commits and its acceptance
        length (the cache keeps them all; a row that stops early is removed before the next step)."""
        t0 = time.perf_counter()
        live = [s for s in self.rows if s is not None]
        j = torch.arange(self.B, device=self.device)
        width = max(1, min(self.B, self.max_verify_tokens // len(self.rows)))
        adaptive = self.widths is not None and not any(s.seeded for s in live) and not self.width_plan
        if self.width_plan:
            width = min(width, self.width_plan.popleft())
        elif adaptive:
            width = self.widths.choose(len(self.rows), width)
        self.last_width = width
        spec, option, found, proposals = None, None, None, None
        greedy = all(s.sampling.greedy for s in live)
        if self.tree_budget is not None and not self.width_plan and greedy:
            found = [(0, []) if s is None else self.lookup.match(s.token_ids) for s in self.rows]
            option = (self.budgets.choose(len(self.rows), [n for n, _ in found]) if self.budgets is not None
                      else (TREE, self.tree_budget))
            spec, proposals, width = step_args(option, found, self.tree_topk, self.B)
            adaptive = False
        prefix = None
        if self.prompt_lookup is not None and spec is None and proposals is None and width > 1:
            prefix = [[] if s is None else self.prompt_lookup.propose(s.token_ids, width - 1)
                      for s in self.rows]
        trim = self.widths.trim if adaptive and self.widths.trimming else None  # one row: see WidthController
        choice, accepted = self.batch.step(self.anchor, self.anchor_pos[:, None] + j,
                                           None if greedy else lambda logits: _choose_per_row(logits, self.rows),
                                           width=width, tree=spec, proposals=proposals, prefix=prefix, trim=trim)
        n_keep = accepted + 1
        self.anchor = choice.gather(1, accepted[:, None])[:, 0]
        self.anchor_pos = self.anchor_pos + n_keep
        L, q = choice.shape
        if trim is not None:
            self.last_width = q
        host = torch.cat([n_keep, choice.reshape(-1)]).tolist()  # the step's one read back to the host
        n_list, tokens = host[:L], host[L:]
        self.batch.commit(n_keep, max(n_list))
        accepted_live = [n - 1 for s, n in zip(self.rows, n_list) if s is not None]
        seconds = time.perf_counter() - t0 - self.batch.flush_seconds  # see SpecBatch.flush_seconds
        if adaptive:  # at the width verified, which a trim may have narrowed
            self.widths.observe(accepted_live, q, L * q, seconds, drafted=width > 1)
        if self.budgets is not None and option is not None:
            self.budgets.observe(accepted_live, option, seconds,
                                 [m for (m, _), s in zip(found, self.rows) if s is not None], q)
        return [tokens[i * q:i * q + n] for i, n in enumerate(n_list)], n_list

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.rows if s is not None]

    def remove(self, seqs: list[Sequence]) -> None:
        """Frees the rows of these sequences: a prefilled sequence takes such a row in place (see `rows`); the
        next decode step drops those that no prefill waits for. A free row's slots are masked and its position
        reset, so that the steps it rides along in until then stay within the cache and the model's positions.
        `drop_free_rows` next."""
        gone = {id(s) for s in seqs}
        free = [r for r, s in enumerate(self.rows) if s is not None and id(s) in gone]
        if not free:
            return
        for r in free:
            self.rows[r] = None
        index = torch.tensor(free, dtype=torch.long, device=self.device)
        self.batch.mask_rows(index)
        self.anchor[index], self.anchor_pos[index] = 0, 0

    def drop_free_rows(self, keep: int) -> None:
        """Keeps `keep` free rows (as many as sequences will soon join); the others leave the batch (one copy of
        the caches)."""
        free = [r for r, s in enumerate(self.rows) if s is None]
        if len(free) <= keep:
            return
        gone = set(free[keep:])
        self._keep_rows([r for r in range(len(self.rows)) if r not in gone])

    def _keep_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.batch.select_rows(index)
        self.anchor, self.anchor_pos = self.anchor[index], self.anchor_pos[index]
        self.rows = [self.rows[r] for r in keep]


def kv_bytes_per_token(target, draft: DFlashDraftModel | None, runtime: str) -> int:
    """Bytes one cache slot of one row takes: the target's keys and values in every layer (fp32 on a CPU whose
    fast runtime attends by SDPA, see dflash.fast), and the draft's."""
    from .fast import make_adapter

    tc = target.config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    adapter = make_adapter(target, None, runtime)
    dtype = getattr(getattr(adapter, "fast", None), "attn_dtype", next(target.parameters()).dtype)
    total = tc.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize
    if draft is not None:
        c = draft.config
        total += c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * draft.fc.weight.dtype.itemsize
    return total


class LLMEngine:
    """Accepts requests from any thread; `step()` (one thread) advances every sequence by one DFlash step."""

    def __init__(self, target, tokenizer, draft: DFlashDraftModel | None = None, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        B = 1
        if draft is not None:
            if draft.config.draft_method != "dflash":
                raise DFlashInputError(f"the serving engine runs DFlash drafts; this is a {draft.config.draft_method} "
                                       "draft (use it with `dflash generate` or `dflash bench`)")
            B = config.block_size or draft.config.block_size
            if not draft.is_bound_to(target):
                draft.bind(target)
        if min(config.max_batch_size, config.prefill_tokens, config.max_verify_tokens) < 1 or config.max_queue < 0:
            raise DFlashInputError("max_batch_size, prefill_tokens and max_verify_tokens must be >= 1, "
                                   "max_queue >= 0")
        limit = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.block_size = B
        self.stop_token_ids = default_stop_token_ids(target)
        self.kv_bytes_per_token = kv_bytes_per_token(target, draft, config.runtime)
        budget = config.kv_cache_memory
        if budget is None:
            device = next(target.parameters()).device
            free = available_memory(device)
            budget = None if free is None else int(free * (0.9 if device.type == "cuda" else 0.5))
        self.kv_cache_memory = budget
        self.scheduler = Scheduler(config, None if budget is None else budget // self.kv_bytes_per_token, B)
        self.runner = ModelRunner(target, draft, B, self.max_model_len, config.runtime, config.max_verify_tokens,
                                  config.adaptive_width, config.prefill_tokens, config.tree_budget,
                                  config.tree_topk, config.prompt_lookup)
        self.wakeup = threading.Event()
        self.metrics = None  # a .metrics.EngineMetrics when served
        self.device = self.runner.device
        self.graphs_built = False  # set by warm_up: from then on no step compiles

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], *, max_tokens: int | None = None,
                    sampling: SamplingParams | None = None, stop: list[str] | None = None, seed: int | None = None,
                    on_update=None) -> Sequence:
        """Queues a request; raises DFlashInputError for a prompt that does not fit, QueueFullError when full."""
        n = len(prompt_ids)
        if n == 0:
            raise DFlashInputError("the prompt is empty")
        if n >= self.max_model_len:
            raise DFlashInputError(f"the prompt has {n} tokens; this model's maximum context length is "
                                   f"{self.max_model_len} tokens")
        room = self.max_model_len - n
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise DFlashInputError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                   f"has {n} and max_tokens asks for {max_tokens} more")
        if not self.scheduler.fits(1, n + max_tokens + self.block_size):
            need = 2 * (n + max_tokens + self.block_size) * self.kv_bytes_per_token
            raise DFlashInputError(f"this request ({n} prompt tokens + max_tokens={max_tokens}) needs about "
                                   f"{need / 2**20:.0f} MiB of KV cache alone; the server's budget "
                                   f"(--kv-cache-memory) is {self.kv_cache_memory / 2**20:.0f} MiB")
        vocab = self.target.get_input_embeddings().weight.shape[0]
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise DFlashInputError(f"prompt token ids must be in [0, {vocab})")
        generator = None
        if sampling is not None and not sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        seq = Sequence(list(prompt_ids), max_tokens, sampling or SamplingParams(), self.stop_token_ids,
                       TextStream(self.tokenizer, stop) if self.tokenizer is not None else None, generator,
                       on_update)
        seq.seeded = generator is not None and seed is not None
        if max_tokens == 0:
            seq.status, seq.finish_reason = Status.FINISHED, "length"
            return seq
        self.scheduler.add(seq)
        self.wakeup.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        seq.aborted = True
        self.wakeup.set()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """schedule -> run -> postprocess. Returns the sequences that finished in this step.

        Every tensor the engine keeps is made in inference mode: torch.compile guards on it, so a cache made
        outside it (or rows selected outside it) would make each compiled graph compile again mid-run.
        After `warm_up`, compiled steps only run graphs already built: a step of a shape no graph covers runs
        eagerly rather than stalling every user for a compile."""
        with torch.inference_mode(), built_graphs_only() if self.graphs_built else nullcontext():
            return self._step()

    def _step(self) -> list[Sequence]:
        t0 = time.perf_counter()
        sched, runner = self.scheduler, self.runner
        # schedule
        dropped, held = sched.drop_aborted()
        runner.remove(held)
        admitted = sched.admit()
        if admitted:
            runner.start_prefill(admitted)
        updates: list[tuple[Sequence, list[int], int | None]] = []
        # run: one decode step for the running rows, then a chunk of prefill for the joining ones
        if runner.live:
            tokens, accepted = runner.decode()
            updates += [(s, t, a) for s, t, a in zip(runner.rows, tokens, accepted) if s is not None]
        if sched.prefilling:
            joined = runner.prefill_chunk(self.config.prefill_tokens)
            updates += [(s, [t], None) for s, t in joined]
            sched.prefilled([s for s, _ in joined])
        # postprocess
        finished = []
        for seq, toks, acc in updates:
            if acc is not None:
                seq.acceptance_lengths.append(acc)
            delta = seq.append(toks)
            if seq.finish_reason is not None:
                finished.append(seq)
            if seq.on_update is not None:
                seq.on_update(seq, delta)
        sched.finish(finished)
        runner.remove(finished)
        runner.drop_free_rows(keep=sched.num_waiting + len(sched.prefilling))
        for seq in dropped:
            if seq.on_update is not None:
                seq.on_update(seq, "")
        if self.metrics is not None:
            self.metrics.observe_step(self, updates, finished + dropped, time.perf_counter() - t0)
        return finished

    def run_forever(self, stop: threading.Event) -> None:
        """The engine thread: steps while there is work, sleeps until a request arrives, exits on `stop`."""
        while not stop.is_set():
            if not self.has_work():
                self.wakeup.wait(0.5)
                self.wakeup.clear()
                continue
            self.step()

    def warm_up(self, prompt_ids: list[int] | None = None) -> None:
        """Builds the compiled step graphs of a '*-compile' runtime before a user waits for them, by serving
        throw-away requests: one alone, then two together. torch.compile specialises sizes of 1, so one row and
        several, one token and several are graphs of their own: each round runs plain (one-token) steps and
        whole blocks, and a block after plain steps (the draft's context then takes several pending slots).
        The adaptive controller learns nothing from these steps (they are mostly compile time)."""
        t = time.perf_counter()
        ids = prompt_ids or self.tokenizer.encode("Count from one to twenty.")
        B = self.block_size
        plan = [1, B, 1, 1, B] * 2
        for n in (1, 2):
            self.runner.width_plan.extend(plan)
            seqs = [self.add_request(ids, max_tokens=sum(plan)) for _ in range(n)]
            for seq in seqs:
                seq.stop_token_ids = []  # the plan runs to its end
            while self.has_work():
                self.step()
            self.runner.width_plan.clear()
        if self.runner.widths is not None:
            self.runner.widths = self.runner.width_controller()
        self.graphs_built = True
        log.info("warm-up: the step graphs took %.1f s to build", time.perf_counter() - t)

    def generate(self, prompts: list[list[int]], **kwargs) -> list[Sequence]:
        """Offline use and tests: runs the given prompts to completion through the continuous-batching loop."""
        seqs = [self.add_request(p, **kwargs) for p in prompts]
        while self.has_work():
            self.step()
        return seqs
