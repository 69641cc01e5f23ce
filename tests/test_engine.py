"""Continuous batching: sequences that join, leave and prefill in chunks get exactly the target's greedy
tokens, with a random draft, an oracle draft and no draft; sampling settings and stops are per request."""

import pytest
import torch

from dflash import DFlashDraftModel
from dflash.engine import EngineConfig, LLMEngine, QueueFullError, TextStream
from dflash.errors import DFlashInputError
from dflash.sampling import SamplingParams
from oracle import OracleDraft
from cpu_features import needs_attention_kernel, needs_int4_kernel
from tiny import reference_greedy, tiny_target

EOS = 2


def prompts(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def expected(target, prompt, max_tokens):
    new, _ = reference_greedy(target, torch.tensor(prompt), max_tokens, (EOS,))
    return new[:-1] if new and new[-1] == EOS else new  # the engine does not return the stop token


@pytest.mark.parametrize("arch,verify", [("llama", 64), ("qwen3", 64), ("llama", 5)])
@pytest.mark.parametrize("draft_kind", ["none", "random", "oracle"])
def test_staggered_arrivals_match_target_greedy(arch, verify, draft_kind, monkeypatch):
    from dflash.batch import SpecBatch

    put = SpecBatch.put_row
    taken = []  # joining sequences that took a finished one's row in place
    monkeypatch.setattr(SpecBatch, "put_row", lambda self, row, other: taken.append(row) or put(self, row, other))
    target = tiny_target(arch, seed=3)
    ps = prompts([5, 17, 3, 26, 9, 12, 4], seed=1)
    max_tokens = [20, 7, 30, 12, 25, 1, 18]
    refs = [expected(target, p, n) for p, n in zip(ps, max_tokens)]
    draft = None
    if draft_kind != "none":
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
        if draft_kind == "oracle" and verify == 64:
            draft = OracleDraft(draft, [p + r for p, r in zip(ps, refs)])
    # 3 rows at most and 8 prompt tokens per step: queueing, chunked prefill and rows joining mid-decode
    # verify=5: blocks of 4, 2 and 1 (plain steps) as 1, 2 and 3 rows run; fixed widths, so that the oracle's
    # acceptance does not depend on the timing the adaptive width measures (tests/test_adaptive.py covers it)
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=3, prefill_tokens=8, max_verify_tokens=verify,
                                                         adaptive_width=False))
    seqs = [engine.add_request(p, max_tokens=n) for p, n in zip(ps[:4], max_tokens[:4])]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(p, max_tokens=n) for p, n in zip(ps[4:], max_tokens[4:])]
    while engine.has_work():
        engine.step()
        assert len(engine.runner.rows) <= 3
    for s, ref, n in zip(seqs, refs, max_tokens):
        assert s.output_ids == ref, (arch, draft_kind, s.id)
        assert s.finish_reason == ("length" if len(ref) == n else "stop")
    if draft_kind == "oracle" and verify == 64:
        taus = [sum(s.acceptance_lengths) / len(s.acceptance_lengths) for s in seqs if s.acceptance_lengths]
        assert max(taus) > 2  # the acceptance path really ran
    assert engine.runner.rows == [] and engine.runner.batch.num_rows == 0
    assert taken  # rows were reused, not only appended


def test_a_step_never_commits_past_max_tokens():
    # a verified block can run past max_tokens, a stop token included: the answer ends at max_tokens ("length"),
    # a stop inside the room ends it there ("stop", the stop token kept aside)
    from dflash.engine import Sequence

    s = Sequence([5], max_tokens=3, stop_token_ids=[EOS])
    s.append([7, 8, 9, EOS])
    assert s.output_ids == [7, 8, 9] and s.finish_reason == "length" and s.stop_token_id is None
    s = Sequence([5], max_tokens=3, stop_token_ids=[EOS])
    s.append([7])
    s.append([8, EOS, 9])
    assert s.output_ids == [7, 8] and s.finish_reason == "stop" and s.stop_token_id == EOS


def test_abort_frees_the_row_and_others_continue():
    target = tiny_target("llama", seed=3)
    ps = prompts([6, 8], seed=2)
    ref = expected(target, ps[1], 15)
    engine = LLMEngine(target, None, DFlashDraftModel.from_target(target, num_layers=1, block_size=4),
                       EngineConfig(max_batch_size=2))
    a = engine.add_request(ps[0], max_tokens=40)
    b = engine.add_request(ps[1], max_tokens=15)
    engine.step()
    engine.step()
    engine.abort(a)
    engine.step()
    assert a.finish_reason == "abort" and engine.runner.rows == [b]
    while engine.has_work():
        engine.step()
    assert b.output_ids == ref


def test_queue_limit_and_bad_requests():
    target = tiny_target("llama", seed=3)
    engine = LLMEngine(target, None, None, EngineConfig(max_batch_size=1, max_queue=2))
    engine.add_request([5, 6], max_tokens=3)
    engine.add_request([5, 6], max_tokens=3)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.add_request([5, 6], max_tokens=3)
    with pytest.raises(DFlashInputError, match="maximum context length is 512"):
        engine.add_request([5] * 512)
    with pytest.raises(DFlashInputError, match="max_tokens asks for 500"):
        engine.add_request([5] * 20, max_tokens=500)
    with pytest.raises(DFlashInputError, match=r"in \[0, 96\)"):
        engine.add_request([5, 96])


def test_per_request_sampling_is_seeded_and_greedy_rows_stay_exact():
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    p = prompts([7], seed=4)[0]
    ref = expected(target, p, 12)
    hot = SamplingParams(temperature=1.5)

    def run():
        engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=4))
        s1 = engine.add_request(p, max_tokens=12, sampling=hot, seed=7)
        g = engine.add_request(p, max_tokens=12)
        s2 = engine.add_request(p, max_tokens=12, sampling=hot, seed=8)
        while engine.has_work():
            engine.step()
        return s1.output_ids, g.output_ids, s2.output_ids

    first, second = run(), run()
    assert first == second  # a seed fixes a request's sample whatever else is in the batch
    assert first[1] == ref
    assert first[0] != first[2]


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_text_stream_cuts_at_stop_strings_and_holds_back_their_starts():
    ts = TextStream(CharTokenizer(), stop=["cde"])
    assert ts.push([3, 4]) == "de"
    assert ts.push([2]) == ""  # "dec": the "c" may start "cde"
    assert ts.push([5]) == "cf"  # "decf": it did not
    assert ts.push([2, 3]) == ""  # "decfcd" may go on to "cde"
    assert ts.push([4, 0]) == ""  # "decfcdea": stop found, the text ends before it
    assert ts.stopped and ts.text == "decf"


def test_warm_up_builds_every_graph_that_serving_runs():
    # on the real model a graph compiled mid-run stalls every user for tens of seconds: after warm_up, one to
    # three rows, rows joining mid-decode, prompts of other lengths and every verify width compile nothing more
    from torch._dynamo.utils import counters

    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ps = prompts([5, 17, 3, 26, 9], seed=4)
    max_tokens = [20, 9, 30, 14, 11]
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=3, prefill_tokens=8, runtime="fast-compile"))
    engine.warm_up(prompts([7], seed=5)[0])
    assert engine.graphs_built and not engine.runner.width_plan
    built = counters["stats"]["unique_graphs"]
    engine.graphs_built = False  # a graph the warm-up missed would now be compiled, and counted
    engine.runner.width_plan.extend([2, 3, 1, 4, 1, 1, 3, 2] * 4)  # what the controller may choose, each width
    seqs = [engine.add_request(p, max_tokens=n) for p, n in zip(ps[:3], max_tokens[:3])]
    for _ in range(4):
        engine.step()
    seqs += [engine.add_request(p, max_tokens=n) for p, n in zip(ps[3:], max_tokens[3:])]
    while engine.has_work():
        engine.step()
    assert counters["stats"]["unique_graphs"] == built
    for s, p, n in zip(seqs, ps, max_tokens):
        assert s.output_ids == expected(target, p, n)


def test_metrics_count_the_drafts_each_step_verified():
    # an adaptive step verifies fewer drafts than a block (none in a plain step): the acceptance rate is over
    # the drafts verified
    from dflash.metrics import EngineMetrics

    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=2))
    engine.metrics = m = EngineMetrics(engine.block_size)
    plan = [1, 4, 2, 1, 3]
    engine.runner.width_plan.extend(plan)
    seqs = [engine.add_request(p, max_tokens=40) for p in prompts([6, 9], seed=6)]
    for _ in range(1 + len(plan)):  # the prompts' step, then one step per planned width
        engine.step()
    value = m.registry.get_sample_value
    assert value("dflash_draft_tokens_proposed_total") == 2 * sum(w - 1 for w in plan)
    accepted = sum(a - 1 for s in seqs for a in s.acceptance_lengths)
    assert value("dflash_draft_tokens_accepted_total") == accepted
    assert value("dflash_draft_acceptance_rate") == pytest.approx(accepted / (2 * sum(w - 1 for w in plan)))


@needs_attention_kernel
@needs_int4_kernel
@pytest.mark.parametrize("with_draft", [False, True])
def test_a_greedy_answer_does_not_depend_on_who_else_is_served(with_draft):
    # the int4 runtime's steps are batch-invariant and every prompt is prefilled alone in fixed chunks: a
    # request's answer is bit for bit the same alone and beside others that join, leave and verify blocks
    target = tiny_target("llama", seed=4).bfloat16()
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4) if with_draft else None
    cfg = EngineConfig(max_batch_size=4, prefill_tokens=8, runtime="fast-int4")
    mine, *others = prompts([13, 5, 21, 9, 30], seed=6)
    alone = LLMEngine(target, None, draft, cfg).generate([mine], max_tokens=20)[0].output_ids
    engine = LLMEngine(target, None, draft, cfg)
    crowd = [engine.add_request(p, max_tokens=m) for p, m in zip(others[:2], (6, 25))]
    engine.step()  # the others are under way when ours arrives
    seq = engine.add_request(mine, max_tokens=20)
    crowd += [engine.add_request(p, max_tokens=12) for p in others[2:]]
    while engine.has_work():
        engine.step()
    assert seq.output_ids == alone and all(s.output_ids for s in crowd)


def test_a_kv_cache_budget_queues_sequences_and_refuses_one_that_can_never_fit():
    target = tiny_target("qwen3", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ps = prompts([6, 9, 4, 7, 5], seed=3)
    free = LLMEngine(target, None, draft, EngineConfig(max_batch_size=8))
    want = [s.output_ids for s in free.generate(ps, max_tokens=10)]
    per_token = free.kv_bytes_per_token
    # room for two sequences of at most 9 + 10 + 4 slots each (twice over, for growth and holes)
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=8, kv_cache_memory=2 * 2 * 23 * per_token))
    seqs = [engine.add_request(p, max_tokens=10) for p in ps]
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, len(engine.scheduler.running) + len(engine.scheduler.prefilling))
    assert most == 2 and [s.output_ids for s in seqs] == want
    with pytest.raises(DFlashInputError, match=r"needs about .* MiB of KV cache alone; the server's budget"):
        engine.add_request(list(range(3, 40)), max_tokens=30)


@pytest.mark.parametrize("budget", [10, "auto"])
def test_trees_in_the_engine_match_target_greedy_and_yield_to_sampling_rows(budget):
    from oracle import SecondChoiceOracle

    target = tiny_target("qwen3", seed=3)
    ps = prompts([5, 17, 3, 26, 9], seed=1)
    max_tokens = [20, 7, 30, 12, 25]
    refs = [expected(target, p, n) for p, n in zip(ps, max_tokens)]
    base = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    draft = SecondChoiceOracle(base, [p + r for p, r in zip(ps, refs)], seed=3)
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=3, prefill_tokens=8, tree_budget=budget,
                                                         tree_topk=2))
    seqs = [engine.add_request(p, max_tokens=n) for p, n in zip(ps[:3], max_tokens[:3])]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(p, max_tokens=n) for p, n in zip(ps[3:], max_tokens[3:])]
    # a sampling request in the mix: steps with it verify chains, as before
    sampled = engine.add_request(ps[0], max_tokens=10, sampling=SamplingParams(temperature=0.9), seed=1)
    while engine.has_work():
        engine.step()
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref, s.id
    assert len(sampled.output_ids) == 10
    if budget == 10:
        taus = [sum(s.acceptance_lengths) / len(s.acceptance_lengths) for s in seqs if s.acceptance_lengths]
        assert max(taus) > 2


@pytest.mark.parametrize("arch,seed", [("llama", 3), ("qwen3", 3)])
def test_prompt_lookup_in_the_engine_matches_target_greedy(arch, seed):
    target = tiny_target(arch, seed=seed)  # seeds whose greedy answers to the first prompt repeat themselves
    ps = [[1, 2, 9, 10, 11, 9, 10, 11, 9, 10]] + prompts([17, 3, 26], seed=1)
    max_tokens = [30, 12, 20, 9]
    refs = [expected(target, p, n) for p, n in zip(ps, max_tokens)]
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    taus = {}
    for lookup in (False, True):
        engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=3, prefill_tokens=8, adaptive_width=False,
                                                             prompt_lookup=lookup))
        seqs = [engine.add_request(p, max_tokens=n) for p, n in zip(ps[:2], max_tokens[:2])]
        engine.step()  # the others join mid-decode, one of them in a finished row's place
        seqs += [engine.add_request(p, max_tokens=n) for p, n in zip(ps[2:], max_tokens[2:])]
        while engine.has_work():
            engine.step()
        assert [s.output_ids for s in seqs] == refs, (arch, lookup)
        taus[lookup] = sum(seqs[0].acceptance_lengths) / len(seqs[0].acceptance_lengths)
    # a random draft is almost never right; the text's own continuation is, where the answer repeats
    assert taus[True] > taus[False] + 0.05, taus
