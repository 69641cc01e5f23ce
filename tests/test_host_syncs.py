"""Reads back to the host per decoding step: on a GPU each is a synchronisation that idles the device, so a step
makes exactly one (the tokens it commits). A test that fails when another is added."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash import DFlashDraftModel, generate, stream_generate
from dflash import engine as engine_mod
from dflash.engine import EngineConfig, LLMEngine
from dflash.fast import FastTargetAdapter
from tiny import ragged_batch, tiny_target

# ops whose result a GPU must finish computing and copy to the host before Python can go on
SYNCING_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
               torch.ops.aten._unique2.default, torch.ops.aten.is_nonzero.default}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(monkeypatch):
    # the path a GPU runs: on a CPU, greedy verification reads back which rows' logits it needs (free there)
    monkeypatch.setattr(FastTargetAdapter, "lazy_head", property(lambda self: False))
    counter = SyncCounter()
    real = torch.Tensor.tolist

    def tolist(t):
        counter.count += 1
        return real(t)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with counter:
        yield counter


@pytest.mark.parametrize("trims", [False, True])
def test_a_generate_step_reads_back_once(monkeypatch, trims):
    """Once per step where the adaptive width does not trim drafted steps (off the CPU); where it does (one row),
    a drafted step reads the draft's probabilities too."""
    monkeypatch.setattr(generate, "trims_pay", lambda device: trims)
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ids, mask = ragged_batch([6, 9, 4], seed=2)
    if trims:
        ids, mask = ids[1:2], mask[1:2]
    stream = stream_generate(target, draft, ids, mask, max_new_tokens=40, stop_token_ids=[], adaptive_width=True)
    next(stream)  # the prompt pass
    per_step = []
    with counting(monkeypatch) as counter:
        for _ in stream:
            per_step.append(counter.count)
            counter.count = 0
    if trims:
        assert len(per_step) > 5 and max(per_step) <= 3 and 2 in per_step, per_step
        return
    assert len(per_step) > 5 and per_step.count(1) >= len(per_step) - 2, per_step  # a compaction may read one more
    assert max(per_step) <= 2, per_step


@pytest.mark.parametrize("with_draft", [False, True])
def test_an_engine_decode_step_reads_back_once(monkeypatch, with_draft):
    monkeypatch.setattr(engine_mod, "trims_pay", lambda device: False)  # as off the CPU (see the test above)
    target = tiny_target("qwen3", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4) if with_draft else None
    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=4))
    seqs = [engine.add_request(list(range(5, 5 + n)), max_tokens=60) for n in (7, 4, 9)]
    for _ in range(3):  # admission and prompt passes
        engine.step()
    assert all(s.output_ids for s in seqs) and not engine.scheduler.prefilling
    batch = engine.runner.batch
    steps = []
    with counting(monkeypatch) as counter:
        for _ in range(8):
            before = batch.compactions + batch.growths
            engine.step()
            if batch.compactions + batch.growths == before:
                steps.append(counter.count)
            counter.count = 0
    assert steps and all(n == 1 for n in steps), steps
