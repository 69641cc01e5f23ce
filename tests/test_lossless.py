"""Greedy losslessness: every row equals the target's own greedy decoding of that prompt alone."""

import random
from array import array

import pytest
import torch

from dflash import DFlashDraftModel, ar_generate, spec_generate
from oracle import OracleDraft
from tiny import ARCHS, ragged_batch, reference_greedy, tiny_target

MAX_NEW = 24
MIN_GAP = 1e-3  # fp32 noise is ~1e-5; a smaller top-1/top-2 gap could flip an argmax between code paths


def references(target, ids, mask, max_new, stop=()):
    refs = []
    for i in range(ids.shape[0]):
        prompt = ids[i][mask[i].bool()]
        new, gap = reference_greedy(target, prompt, max_new, stop)
        assert gap > MIN_GAP, f"logits too close to call (gap {gap}); pick another seed"
        refs.append(new)
    return refs


def new_tokens(out, ids, n_new):
    return [out.sequences[i, ids.shape[1]:ids.shape[1] + n_new[i]].tolist() for i in range(ids.shape[0])]


def futures_for(ids, mask, refs):
    """Per row: the full token sequence by absolute position (prompt then greedy continuation)."""
    return [ids[i][mask[i].bool()].tolist() + refs[i] for i in range(ids.shape[0])]


@pytest.fixture(scope="module", params=ARCHS)
def arch_target(request):
    return request.param, tiny_target(request.param, seed=1)


@pytest.mark.parametrize("lengths", [[7], [3, 11, 6, 9]], ids=["batch1", "batch4-ragged"])
def test_random_and_oracle_drafts_match_target_greedy(arch_target, lengths):
    arch, target = arch_target
    ids, mask = ragged_batch(lengths, seed=len(lengths))
    refs = references(target, ids, mask, MAX_NEW)
    ar = ar_generate(target, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[], return_stats=True)
    assert new_tokens(ar, ids, ar.num_new_tokens) == refs
    for B in (2, 4, 8, 16):
        base = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        futures = futures_for(ids, mask, refs)
        for draft, name in ((base, "random"), (OracleDraft(base, futures), "oracle"),
                            (OracleDraft(base, futures, corrupt=0.25, seed=B), "noisy-oracle")):
            out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                return_stats=True)
            assert out.num_new_tokens == [MAX_NEW] * len(lengths), (arch, B, name)
            assert new_tokens(out, ids, out.num_new_tokens) == refs, (arch, B, name)
            # left-padded input is returned as given
            assert torch.equal(out.sequences[:, :ids.shape[1]], ids)
            if name == "oracle":
                assert out.tau > min(B, 4) * 0.7, (arch, B, out.tau)  # the acceptance path really ran


def test_stop_tokens_per_row_and_right_padding():
    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([5, 10, 7], seed=3)
    refs = references(target, ids, mask, MAX_NEW)
    stop = refs[0][4]  # a token row 0 emits at step 5; other rows may or may not hit it
    stopped = references(target, ids, mask, MAX_NEW, stop=(stop,))
    assert len(stopped[0]) == 5
    mask_id = next(t for t in range(95, 2, -1) if t not in sum(stopped, []))  # a row the target never emits
    base = DFlashDraftModel.from_target(target, block_size=8, mask_token_id=mask_id)
    for draft in (base, OracleDraft(base, futures_for(ids, mask, refs))):
        out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[stop],
                            return_stats=True)
        assert out.num_new_tokens == [len(s) for s in stopped]
        assert new_tokens(out, ids, out.num_new_tokens) == stopped
        # nothing after a stop token: rows that stopped early are right-padded with the pad id
        width = out.sequences.shape[1] - ids.shape[1]
        assert width == max(len(s) for s in stopped)
        for i, s in enumerate(stopped):
            assert out.sequences[i, ids.shape[1] + len(s):].eq(0).all()
        assert mask_id not in out.sequences[:, ids.shape[1]:].flatten().tolist()


def test_holes_are_compacted_when_rows_accept_very_differently():
    """One row accepts whole blocks, another almost nothing: the shared cache pointer runs ahead of the
    slow row until the cache must squeeze out the holes. Output must stay exact through compaction."""
    target = tiny_target("qwen3", seed=1)
    ids, mask = ragged_batch([4, 9, 6], seed=5)
    max_new = 60
    refs = references(target, ids, mask, max_new)
    base = DFlashDraftModel.from_target(target, block_size=16)
    draft = OracleDraft(base, futures_for(ids, mask, refs), corrupt=[0.0, 1.0, 0.5])
    out = spec_generate(target, draft, ids, mask, max_new_tokens=max_new, stop_token_ids=[], return_stats=True)
    assert out.compactions > 0
    assert new_tokens(out, ids, out.num_new_tokens) == refs


def test_long_answers_grow_the_cache_and_stay_exact():
    """Storage starts at 256 new tokens and doubles when answers run longer; with uneven acceptance the
    holes are squeezed out too."""
    target = tiny_target("qwen3", seed=1)
    ids, mask = ragged_batch([5, 12], seed=9)
    max_new = 400
    refs = references(target, ids, mask, max_new)
    base = DFlashDraftModel.from_target(target, block_size=8)
    for draft in (OracleDraft(base, futures_for(ids, mask, refs), corrupt=[0.0, 0.9]), None):
        if draft is None:
            out = ar_generate(target, ids, mask, max_new_tokens=max_new, stop_token_ids=[], return_stats=True)
        else:
            out = spec_generate(target, draft, ids, mask, max_new_tokens=max_new, stop_token_ids=[],
                                return_stats=True)
            assert out.compactions > 0
        assert out.cache_growths == 1
        assert new_tokens(out, ids, out.num_new_tokens) == refs


def test_published_example_call_runs_as_written():
    target = tiny_target("qwen3", seed=1)
    draft_model = DFlashDraftModel.from_target(target, num_layers=2, block_size=16)
    input_ids = ragged_batch([6], seed=7)[0]
    out = spec_generate(target, draft_model, input_ids, num_speculative_tokens=16, temperature=0.0,
                        max_new_tokens=512 - 6 - 16)
    ref = ar_generate(target, input_ids, max_new_tokens=512 - 6 - 16)
    assert torch.equal(out, ref)


def test_stats_are_consistent():
    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([6, 8], seed=2)
    refs = references(target, ids, mask, MAX_NEW)
    draft = OracleDraft(DFlashDraftModel.from_target(target, block_size=4), futures_for(ids, mask, refs),
                        corrupt=0.3, seed=1)
    out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[], return_stats=True)
    hist = out.acceptance_histogram
    assert len(hist) == 4 and sum(hist) == len(out.acceptance_lengths)
    assert all(1 <= a <= 4 for a in out.acceptance_lengths)
    # every token after the prefill's first one was committed by some step (the last step may be cut short)
    assert sum(out.acceptance_lengths) >= sum(n - 1 for n in out.num_new_tokens)
    assert 1.0 <= out.tau <= 4.0 and out.num_steps >= MAX_NEW // 4
    assert out.time_to_first_token > 0 and out.total_time >= out.time_to_first_token
    ar = ar_generate(target, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[], return_stats=True)
    assert ar.tau == 1.0 and ar.acceptance_histogram == [ar.num_steps * 2]


@pytest.mark.parametrize("runtime", ["hf", "fast"])
def test_caches_are_preallocated_and_never_reallocated(monkeypatch, runtime):
    """Per-step cost must not grow with length: steps write into the same cache storage. Storage changes only
    when finished rows leave the batch (at most once per row), never per step."""
    from dflash.fast import FastTargetAdapter
    from dflash.target import TargetAdapter

    cls = {"hf": TargetAdapter, "fast": FastTargetAdapter}[runtime]
    ptrs = []
    real = cls.forward

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        ptrs.append((self.cache.layers[0].keys.data_ptr(), self.cache.layers[-1].values.data_ptr(),
                     self.valid.data_ptr()))
        return out

    monkeypatch.setattr(cls, "forward", spy)
    target = tiny_target("llama", seed=1)
    draft = DFlashDraftModel.from_target(target, block_size=4)
    for generate in (lambda *a, **k: spec_generate(target, draft, *a, runtime=runtime, **k),
                     lambda *a, **k: ar_generate(target, *a, runtime=runtime, **k)):
        ptrs.clear()
        generate(ragged_batch([5], seed=1)[0], max_new_tokens=40, stop_token_ids=[])
        assert len(ptrs) >= 10 and len(set(ptrs)) == 1
        ptrs.clear()
        ids, mask = ragged_batch([5, 8, 6], seed=1)
        generate(ids, mask, max_new_tokens=40, stop_token_ids=[])
        assert len(ptrs) >= 10 and len(set(ptrs)) <= 3


def test_finished_rows_leave_the_batch_and_outputs_stay_exact():
    """Rows that stop early are retired from the batch; the rest continue exactly."""
    target = tiny_target("qwen2", seed=1)
    ids, mask = ragged_batch([4, 9, 6, 5, 7, 3, 8, 10], seed=9)
    refs = references(target, ids, mask, MAX_NEW)
    stops = {r[3] for r in refs[:4]}  # rows 0..3 stop within 4 tokens, the others when they meet one
    stopped = references(target, ids, mask, MAX_NEW, stop=tuple(stops))
    assert min(len(s) for s in stopped) <= 4 and max(len(s) for s in stopped) > 8
    base = DFlashDraftModel.from_target(target, block_size=4)
    for draft in (base, OracleDraft(base, futures_for(ids, mask, refs), corrupt=0.3)):
        out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=list(stops),
                            return_stats=True)
        assert new_tokens(out, ids, out.num_new_tokens) == stopped
    ar = ar_generate(target, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=list(stops), return_stats=True)
    assert new_tokens(ar, ids, ar.num_new_tokens) == stopped


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_ngram_draft_matches_target_greedy(arch):
    from dflash.ngram import NgramDraft

    target = tiny_target(arch, seed=1)
    # repetitive prompts, so lookups find something and the acceptance path runs
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 9, 10, 11, 9, 10, 11, 9, 10]])
    mask = torch.tensor([[1] * 10, [0, 0] + [1] * 8])
    refs = references(target, ids, mask, MAX_NEW)
    for k in (1, 4, 10):
        out = spec_generate(target, NgramDraft(num_tokens=k), ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[],
                            return_stats=True)
        assert new_tokens(out, ids, out.num_new_tokens) == refs, (arch, k)
        assert out.block_size == k + 1 and max(out.acceptance_lengths) <= k + 1


def test_ngram_lookup():
    from dflash.ngram import NgramDraft

    d = NgramDraft(num_tokens=3, max_ngram=2)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2]) == [3, 7, 1]  # the latest earlier "1 2"
    assert d.propose([5, 6, 7]) == []
    assert d.propose([4, 8, 1, 4]) == [8, 1, 4]  # falls back to one-token matches
    assert d.propose([1, 2, 1, 2], k=1) == [1]
    # match also says how long the match was: the longest, and its latest place among equally long ones
    assert d.match([1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2]) == (2, [3, 7, 1])
    assert NgramDraft(num_tokens=2, max_ngram=6).match([5, 1, 2, 3, 8, 0, 2, 3, 9, 1, 2, 3]) == (3, [8, 0])
    assert d.match([4, 8, 1, 4]) == (1, [8, 1, 4]) and d.match([5, 6, 7]) == (0, [])


def _match_by_scan(history, num_tokens, max_ngram, min_ngram):
    """The lookup's definition, token by token: at every earlier place the length of the suffix it shares with
    the history's end (at most max_ngram), the longest kept, the latest among equals."""
    end, best_n, best_at = len(history) - 1, 0, -1
    for at in range(end - 1, -1, -1):
        n = 0
        while n < min(max_ngram, end) and n <= at and history[at - n] == history[end - n]:
            n += 1
        if n > best_n:
            best_n, best_at = n, at
    return (0, []) if best_n < min_ngram else (best_n, history[best_at + 1:best_at + 1 + num_tokens])


def test_ngram_lookup_equals_its_definition_on_random_texts():
    # the C-speed search (4-byte words, rfind) against the definition; large ids whose bytes repeat inside
    # other ids would match across word boundaries if alignment were not checked
    from dflash.ngram import NgramDraft

    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([[0, 1], [1, 2, 3], [7, 256, 65536 + 7, 7 * 256 ** 3], list(range(6))])
        history = [rng.choice(vocab) for _ in range(rng.randrange(0, 40))]
        max_ngram = rng.randrange(1, 5)
        d = NgramDraft(num_tokens=rng.randrange(1, 6), max_ngram=max_ngram, min_ngram=rng.randrange(1, max_ngram + 1))
        expected = _match_by_scan(history, d.num_tokens, d.max_ngram, d.min_ngram)
        assert d.match(history) == d.match(array("i", history)) == expected, (history, d)  # a list or an array


@pytest.mark.parametrize("arch,seed", [("llama", 3), ("qwen3", 1)])
def test_prompt_lookup_ahead_of_the_draft_matches_target_greedy(arch, seed):
    target = tiny_target(arch, seed=seed)  # seeds whose greedy answers to this prompt repeat themselves
    repeats = [9, 10, 11, 9, 10, 11, 9, 10]
    ids = torch.tensor([[1, 2] + repeats, [0, 0] + repeats])  # the second row left-padded
    mask = torch.tensor([[1] * 10, [0, 0] + [1] * 8])
    refs = references(target, ids, mask, MAX_NEW)
    for B in (4, 8):
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        taus = {}
        for lookup in (False, True):
            for adaptive in (False, True):
                out = spec_generate(target, draft, ids, mask, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                    return_stats=True, adaptive_width=adaptive, prompt_lookup=lookup)
                assert new_tokens(out, ids, out.num_new_tokens) == refs, (arch, B, lookup, adaptive)
                taus[lookup, adaptive] = out.tau
        # a random draft is almost never right; the text's own continuation is, where the answer repeats
        assert taus[True, False] > taus[False, False] + 0.1, (arch, B, taus)
