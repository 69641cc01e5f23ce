"""Adaptive verify width: the choice follows measured acceptance and cost, and any width stays exact."""

import random

import pytest
import torch

from dflash import DFlashDraftModel, ar_generate, spec_generate
from dflash.adaptive import WidthController
from oracle import OracleDraft
from tiny import ragged_batch, tiny_target


def feed(ctrl, rows, accept, seconds, steps=40, cap=None):
    """Runs the controller's loop against a synthetic draft (accept(width) -> accepted drafts per row) and a
    synthetic step cost (seconds(tokens)); returns the widths it chose."""
    chosen = []
    for _ in range(steps):
        w = ctrl.choose(rows, cap)
        chosen.append(w)
        ctrl.observe([accept(w) for _ in range(rows)], w, rows * w, seconds(rows * w))
    return chosen


def test_a_draft_that_is_always_right_gets_whole_blocks():
    ctrl = WidthController(8)
    chosen = feed(ctrl, 1, lambda w: w - 1, lambda t: 0.040 + 0.001 * t)
    assert chosen[-20:] == [8] * 20
    assert ctrl.expected_tokens()[-1] > 6  # near 8, held back a little by the prior


def test_a_draft_that_is_never_right_falls_back_to_plain_steps_and_probes():
    ctrl = WidthController(8, probe_every=16)
    chosen = feed(ctrl, 4, lambda w: 0, lambda t: 0.040 + 0.002 * t, steps=64)
    late = chosen[20:]
    assert late.count(1) >= len(late) - len(late) // 16 - 1  # plain decoding steps...
    # ...and now and then twice that width (not the whole block: slot 2 and beyond matter only once slot 1
    # pays), to see whether the draft got better,
    assert 2 in late and max(late) == 2
    assert ctrl.probe_every > 16  # less often while it does not
    # the draft turns good (the text became easy): the probes see it and whole blocks come back
    chosen = feed(ctrl, 4, lambda w: w - 1, lambda t: 0.040 + 0.002 * t, steps=400)
    assert chosen[-20:] == [8] * 20 and ctrl.probe_every == 16


def test_a_middling_draft_under_load_gets_a_middle_width_within_the_cap():
    # slot k accepted with chance 0.8 after a hit: worth a few tokens, not sixteen, when 8 rows share a step
    rng = random.Random(0)

    def accept(w):
        a = 0
        while a < w - 1 and rng.random() < 0.8:
            a += 1
        return a

    ctrl = WidthController(16)
    chosen = feed(ctrl, 8, accept, lambda t: 0.040 + 0.004 * t, steps=200, cap=6)
    typical = max(set(chosen[100:]), key=chosen[100:].count)
    assert 2 <= typical < 6 and max(chosen) <= 6
    # a free verify (a GPU far from its compute limit) makes the widest block the best
    ctrl = WidthController(16)
    assert feed(ctrl, 8, accept, lambda t: 0.040, steps=100)[-10:].count(16) >= 9


def test_the_cost_model_prices_the_drafts_own_forward():
    # every step with drafts also runs the draft (8 ms here); a line through plain steps (22.4 ms) and whole
    # blocks (33.2 ms) alone would price width 2 at ~24 ms and pick it for a 30% first-slot hit rate
    ctrl = WidthController(8)

    def known_rates():  # slot 1 right 30% of the time, the rest never
        ctrl.reached[:], ctrl.hit[:] = [1000.0] * 8, [0.0] * 8
        ctrl.hit[1] = 300.0

    for _ in range(10):
        ctrl.observe([0], 1, 1, 0.0224)
        ctrl.observe([0], 8, 8, 0.0332)
    assert ctrl.step_seconds()[2] == 0  # two shapes: no telling the draft's cost from the verify's
    known_rates()
    assert ctrl.choose(1) == 2
    ctrl.observe([1], 2, 2, 0.0308)  # measured once: width 2 costs 8.4 ms more than a plain step
    a, b, c = ctrl.step_seconds()
    assert c == pytest.approx(0.008, abs=1e-3) and a + b * 3 + c == pytest.approx(0.0312, abs=1e-3)
    known_rates()
    assert ctrl.choose(1) == 1  # and so do 3, 4, ... (priced, not measured)
    assert ctrl._measured(1, 2) == pytest.approx(0.0308) and ctrl._measured(1, 3) is None
    for _ in range(80):  # unmeasured for long, a shape gives way to the fit
        ctrl.observe([0], 1, 1, 0.0224)
    assert ctrl._measured(1, 2) is None and ctrl._measured(1, 1) is not None


def middling(rate: float, seed: int):
    """accept(width) for a draft whose slot k is right with chance `rate` after a hit"""
    rng = random.Random(seed)

    def accept(w):
        a = 0
        while a < w - 1 and rng.random() < rate:
            a += 1
        return a
    return accept


def cpu_step(t):
    """A CPU's step (the default draft on an AVX-512 Xeon, roughly): 4.2 ms, 0.7 ms a verified token, 2.6 ms of
    draft forward"""
    return 0.0042 + 0.0007 * t + (0.0026 if t > 1 else 0.0)


def test_a_first_slot_that_barely_pays_at_width_two_still_finds_the_wider_width_that_does():
    # slot k right 70% of the time after a hit: width 2 commits 1.7 tokens in 8.2 ms, hardly faster than plain
    # decoding (1 in 4.9), but width 5 commits 2.77 in 10.3. Two measured shapes (1 and 2) cannot tell the draft's
    # cost from the verify's, so the first steps measure a third, and probes from plain decoding verify the width
    # drafting would take (over an answer's worth of steps, 256, 16 seeds: the controller without these two made
    # 0.76x the best fixed width's tokens per second, mostly staying plain)
    best = max(sum(0.7 ** k for k in range(w)) / cpu_step(w) for w in range(1, 9))  # tokens per second
    speeds = []
    for seed in range(16):
        ctrl = WidthController(8)
        accept = middling(0.7, seed)
        tokens, seconds = 0, 0.0
        for _ in range(256):
            w = ctrl.choose(1)
            a = accept(w)
            ctrl.observe([a], w, w, cpu_step(w))
            tokens, seconds = tokens + a + 1, seconds + cpu_step(w)
        assert ctrl.width_counts[2] >= 1 and ctrl.width_counts[4] >= 1  # the first three steps: 2, 1, 4
        speeds.append(tokens / seconds / best)
    assert sorted(speeds)[8] > 0.93 and sorted(speeds)[4] > 0.85
    a, b, c = ctrl.step_seconds()
    assert c == pytest.approx(0.0026, rel=0.1) and b == pytest.approx(0.0007, rel=0.1)


def test_one_slow_step_does_not_keep_the_best_width_out_of_use():
    ctrl = WidthController(8)
    chosen = feed(ctrl, 1, middling(0.7, 3), cpu_step, steps=200)
    best = max(set(chosen[100:]), key=chosen[100:].count)
    assert best > 1
    ctrl.observe([1], best, best, 0.050)  # one step took 50 ms (a collection, the OS)
    assert ctrl._measured(1, best) < 1.1 * cpu_step(best)  # an average without damping: 2x
    chosen = feed(ctrl, 1, middling(0.7, 4), cpu_step, steps=20)
    assert min(chosen) >= best - 1


def test_the_controller_prices_a_step_without_the_context_that_earlier_steps_left_pending(monkeypatch):
    # a drafted step first writes the draft context the prompt or a run of plain steps left pending; that write
    # is made of those steps' tokens, so it is not a cost of the drafted step's width
    import time

    from dflash.model import DFlashDraftModel as Draft

    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([5, 8], seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    write = Draft.write_context
    # the write takes 1000 s of a clock that runs with the real one: a step measured with it cannot pass for
    # one measured without it, however slow a loaded machine makes the steps themselves
    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    def slow_write(self, feats, *a, **k):
        skipped[0] += 1000.0
        return write(self, feats, *a, **k)

    monkeypatch.setattr(Draft, "write_context", slow_write)
    seen = []
    observe = WidthController.observe
    monkeypatch.setattr(WidthController, "observe",
                        lambda self, acc, w, tokens, seconds, *a, **kw: (seen.append(seconds),
                                                                         observe(self, acc, w, tokens, seconds, *a,
                                                                                 **kw))[1])
    out = spec_generate(target, draft, ids, mask, max_new_tokens=12, stop_token_ids=[], adaptive_width=True,
                        return_stats=True)
    assert out.width_counts[1] < out.num_steps  # drafted steps, each after a write
    assert len(seen) == out.num_steps and max(seen) < 500


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_any_width_sequence_reproduces_greedy_decoding(arch, monkeypatch):
    """Widths picked at random every step (1 = a plain step) change nothing in the output, with drafts that
    are random or right 80% of the time, over a ragged batch."""
    target = tiny_target(arch, seed=1)
    ids, mask = ragged_batch([3, 11, 6, 9], seed=4)
    ar = ar_generate(target, ids, mask, max_new_tokens=24, stop_token_ids=[])
    rng = random.Random(0)

    def any_width(self, rows, cap=None):
        w = 1 if sum(self.width_counts) % 5 == 0 else rng.randint(2, self.B)  # plain steps in between
        self.width_counts[w] += 1
        return w

    monkeypatch.setattr(WidthController, "choose", any_width)
    futures = [ids[i][mask[i].bool()].tolist() + ar[i, ids.shape[1]:].tolist() for i in range(4)]
    for B in (4, 8):
        base = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        for draft in (base, OracleDraft(base, futures, corrupt=0.2, seed=B)):
            out = spec_generate(target, draft, ids, mask, max_new_tokens=24, stop_token_ids=[], return_stats=True,
                                adaptive_width=True)
            assert torch.equal(out.sequences, ar), (arch, B)
            assert sum(out.width_counts) == out.num_steps and out.width_counts[1] > 0


def test_adaptive_generation_measures_and_chooses():
    """Unpatched: the controller sees every step and the output is still exact."""
    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([5, 8], seed=2)
    ar = ar_generate(target, ids, mask, max_new_tokens=32, stop_token_ids=[])
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=8)
    out = spec_generate(target, draft, ids, mask, max_new_tokens=32, stop_token_ids=[], return_stats=True,
                        adaptive_width=True)
    assert torch.equal(out.sequences, ar)
    assert sum(out.width_counts) == out.num_steps and len(out.width_counts) == 9
    fixed = spec_generate(target, draft, ids, mask, max_new_tokens=32, stop_token_ids=[], return_stats=True)
    assert fixed.width_counts is None


def test_engine_adapts_its_widths_except_around_seeded_samples():
    from dflash.engine import EngineConfig, LLMEngine
    from dflash.sampling import SamplingParams

    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ids, mask = ragged_batch([4, 9, 6], seed=5)
    ar = ar_generate(target, ids, mask, max_new_tokens=16, stop_token_ids=[])
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=4))
    engine.stop_token_ids = []
    seqs = [engine.add_request(ids[i][mask[i].bool()].tolist(), max_tokens=16) for i in range(3)]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == [ar[i, ids.shape[1]:].tolist() for i in range(3)]
    assert sum(engine.runner.widths.width_counts) > 0
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=4))
    engine.add_request([5, 6, 7], max_tokens=8, sampling=SamplingParams(temperature=1.0), seed=1)
    engine.add_request([5, 6, 7], max_tokens=8)
    while engine.has_work():
        engine.step()
    assert sum(engine.runner.widths.width_counts) == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_plain_steps_keep_the_draft_context_whole(arch, monkeypatch):
    """After any mix of plain (width 1) and wider steps, every proposal equals the draft's proposal from a
    context written afresh from the committed text: no target features are lost in a plain step."""
    from dflash.model import DraftKVCache
    from dflash.train import target_features

    target = tiny_target(arch, seed=1)
    ids, mask = ragged_batch([4, 10], seed=6)
    ar = ar_generate(target, ids, mask, max_new_tokens=24, stop_token_ids=[])
    texts = [ids[i][mask[i].bool()].tolist() + ar[i, ids.shape[1]:].tolist() for i in range(2)]
    base = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 2])
    checked = []

    class Checked(DFlashDraftModel):
        def propose(self, block_ids, block_pos, cache, ctx_valid):
            got = super().propose(block_ids, block_pos, cache, ctx_valid)
            for r in range(block_ids.shape[0]):
                a = int(block_pos[r, 0])  # the anchor's position: the context is the committed text before it
                text = torch.tensor(texts[r][:a])
                fresh = DraftKVCache(self.config, 1, a + 8, "cpu", torch.float32)
                fresh.positions[0, :a] = torch.arange(a)
                self.write_context(target_features(target, [0, 2], text)[None], fresh, 0)
                ref = super().propose(block_ids[r:r + 1], block_pos[r:r + 1], fresh, torch.ones(1, a, dtype=torch.bool))
                checked.append(torch.equal(got[r], ref[0]))
            return got

    draft = Checked(base.config)
    draft.load_state_dict(base.state_dict())
    draft._target_modules = base._target_modules
    widths = iter([4, 1, 1, 4, 1, 3, 1, 1, 1, 4] * 10)

    def scripted(self, rows, cap=None):
        w = next(widths)
        self.width_counts[w] += 1
        return w

    monkeypatch.setattr(WidthController, "choose", scripted)
    out = spec_generate(target, draft, ids, mask, max_new_tokens=24, stop_token_ids=[], adaptive_width=True)
    assert torch.equal(out, ar)
    assert len(checked) > 6 and all(checked)


def test_a_run_of_plain_steps_writes_the_draft_context_once(monkeypatch):
    from dflash.model import DFlashDraftModel as Draft

    target = tiny_target("llama", seed=1)
    ids, mask = ragged_batch([4, 7], seed=2)
    ar = ar_generate(target, ids, mask, max_new_tokens=30, stop_token_ids=[])
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    calls = {"write": 0, "propose": 0}
    for name, key in (("write_context", "write"), ("propose", "propose")):
        def counted(self, *a, _fn=getattr(Draft, name), _key=key, **k):
            calls[_key] += 1
            return _fn(self, *a, **k)
        monkeypatch.setattr(Draft, name, counted)
    widths = iter([4, 1, 1, 1, 1] * 20)

    def scripted(self, rows, cap=None):
        w = next(widths)
        self.width_counts[w] += 1
        return w

    monkeypatch.setattr(WidthController, "choose", scripted)
    out = spec_generate(target, draft, ids, mask, max_new_tokens=30, stop_token_ids=[], adaptive_width=True,
                        return_stats=True)
    assert torch.equal(out.sequences, ar)
    # one write per draft forward (the prompt's, then each run of plain steps'), not one per step
    assert calls["write"] <= calls["propose"] + 1 < out.num_steps


def step_cost(width, drafted):
    """cpu_step's costs, with the draft's forward wherever it ran (a trimmed step may verify only its anchor)"""
    return 0.0042 + 0.0007 * width + (0.0026 if drafted else 0.0)


def warmed(trims: bool) -> WidthController:
    """A controller past its first steps, with every width's cost measured"""
    ctrl = WidthController(8)
    for w in range(1, 9):
        for _ in range(3):
            ctrl.observe([0], w, w, step_cost(w, w > 1))
    ctrl.cold_start, ctrl.trims = [], trims
    return ctrl


def test_a_drafted_step_verifies_as_far_as_the_drafts_probabilities_say_pays():
    ctrl = warmed(trims=True)
    ctrl.hit[1:], ctrl.reached[1:] = [90.0] * 7, [100.0] * 7  # drafting pays: the step proposes a whole block

    def step(probs):
        assert ctrl.choose(len(probs)) == 8
        return ctrl.trim(probs, 8)

    assert step([[0.95] * 7]) == 8
    assert step([[0.02] * 7]) == 1  # sure of nothing: the step verifies its anchor alone
    assert step([[0.95, 0.95, 0.02, 0.95, 0.95, 0.95, 0.95]]) == 3  # not past the slot it doubts
    assert ctrl.width_counts[8] == 1 and ctrl.width_counts[1] == 1 and ctrl.width_counts[3] == 1
    # several rows: the slot rates choose the width, untrimmed (the draft's forward grows with the block there)
    w = ctrl.choose(2)
    assert not ctrl.trimming and ctrl.trim([[0.95] * (w - 1), [0.02] * (w - 1)], w) == w
    # the cold start's shapes are measured as chosen
    cold = WidthController(8)
    cold.trims = True
    assert cold.choose(1) == 2 and not cold.trimming and cold.trim([[0.01]], 2) == 2


def test_trimmed_slots_count_as_reached_with_the_drafts_probabilities():
    ctrl = warmed(trims=True)

    def drafting():  # a choice that drafts (and so trims), then the counts from zero
        ctrl.hit[1:], ctrl.reached[1:] = [90.0] * 7, [100.0] * 7
        assert ctrl.choose(1) == 8 and ctrl.trimming
        ctrl.hit[:], ctrl.reached[:] = [0.0] * 8, [0.0] * 8

    drafting()
    v = ctrl.trim([[0.9, 0.05, 0.5, 0.5, 0.5, 0.5, 0.5]], 8)
    assert v == 2
    ctrl.observe([1], v, v, step_cost(v, True), drafted=True)  # slot 1 verified and accepted
    assert ctrl.reached[1] == pytest.approx(1.0) and ctrl.hit[1] == pytest.approx(1.0)
    # slot 2 would have been verified and accepted with the draft's 0.05; slot 3 reached that often, and so on
    assert ctrl.reached[2] == pytest.approx(1.0) and ctrl.hit[2] == pytest.approx(0.05)
    assert ctrl.reached[3] == pytest.approx(0.05) and ctrl.hit[3] == pytest.approx(0.025)
    # a row rejected inside what it verified reaches nothing past it
    drafting()
    v = ctrl.trim([[0.9, 0.05, 0.5, 0.5, 0.5, 0.5, 0.5]], 8)
    ctrl.observe([0], v, v, step_cost(v, True), drafted=True)
    assert ctrl.reached[2] == 0 and ctrl.hit[1] == 0


def test_trimming_by_calibrated_probabilities_beats_the_slot_rates_alone():
    # a draft that is sure and right (60% of its slots), or unsure and mostly wrong, its probabilities calibrated:
    # the rates alone see a middling draft and verify about the same width every step; trimmed, a step verifies as
    # far as this block's probabilities say, and the controller commits more tokens per second
    def run(trims, seed):
        rng = random.Random(seed)
        ctrl = WidthController(8)
        ctrl.trims = trims
        tokens, seconds = 0, 0.0
        for _ in range(256):
            w = ctrl.choose(1)
            probs = [0.97 if rng.random() < 0.6 else 0.1 for _ in range(w - 1)]
            v = ctrl.trim([probs], w) if trims else w
            a = 0
            while a < v - 1 and rng.random() < probs[a]:
                a += 1
            cost = step_cost(v, w > 1)
            ctrl.observe([a], v, v, cost, drafted=w > 1)
            tokens, seconds = tokens + a + 1, seconds + cost
        return tokens / seconds

    gains = sorted(run(True, seed) / run(False, seed) for seed in range(16))
    # (an unlucky start, its first trimmed steps all unsure, can leave a seed plain for a while)
    assert gains[8] > 1.15 and gains[4] > 1.1 and gains[0] > 0.8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_any_trim_reproduces_greedy_decoding(arch, monkeypatch):
    """Drafted steps cut to random widths (1 = the anchor alone, after the draft ran) change nothing in the
    output, in generate and in the engine (one row: several are not trimmed), for prompts of several lengths."""
    from dflash.engine import EngineConfig, LLMEngine

    target = tiny_target(arch, seed=2)
    ids, mask = ragged_batch([5, 10, 3], seed=6)
    ar = ar_generate(target, ids, mask, max_new_tokens=20, stop_token_ids=[])
    rng = random.Random(1)
    seen = []

    def any_trim(self, probs, width):
        assert len(probs[0]) == width - 1 and all(0.0 <= p <= 1.0 for row in probs for p in row)
        seen.append(width)
        v = rng.randint(1, width)
        self.width_counts[width] -= 1
        self.width_counts[v] += 1
        return v

    monkeypatch.setattr(WidthController, "trim", any_trim)
    monkeypatch.setenv("DFLASH_TRIM", "1")  # trimming is opt-in (dflash.adaptive.trims_pay)
    futures = [ids[i][mask[i].bool()].tolist() + ar[i, ids.shape[1]:].tolist() for i in range(3)]
    for B in (4, 8):
        base = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        draft = OracleDraft(base, futures, corrupt=0.2, seed=B)
        engine = LLMEngine(target, None, base, EngineConfig(max_batch_size=1, block_size=B))
        engine.stop_token_ids = []
        for i in range(3):
            prompt = ids[i][mask[i].bool()][None]
            out = spec_generate(target, draft, prompt, max_new_tokens=20, stop_token_ids=[], return_stats=True,
                                adaptive_width=True)
            assert out.sequences[0, prompt.shape[1]:].tolist() == ar[i, ids.shape[1]:].tolist(), (arch, B, i)
            assert sum(out.width_counts) == out.num_steps
            seq = engine.add_request(prompt[0].tolist(), max_tokens=20)
            while engine.has_work():
                engine.step()
            assert seq.output_ids == ar[i, ids.shape[1]:].tolist(), (arch, B, i)
    assert seen  # the trims ran


def test_trimming_is_opt_in_and_cpu_only(monkeypatch):
    from dflash.adaptive import trims_pay
    monkeypatch.delenv("DFLASH_TRIM", raising=False)
    assert not trims_pay("cpu")
    monkeypatch.setenv("DFLASH_TRIM", "1")
    assert trims_pay("cpu") and not trims_pay("cuda")
