"""The lean forward (runtime 'fast') against the HF forward: logits and taps within fp32 tolerance on every
family it covers, exact greedy generation, and the fallback for families it does not cover."""

import pytest
import torch

from dflash import DFlashDraftModel, ar_generate, fast, kernels, spec_generate
from dflash.errors import DFlashConfigError
from dflash.fast import FastTargetAdapter, Int4Weight, fast_unsupported, make_adapter
from dflash.prompts import left_pad
from dflash.target import TargetAdapter
from cpu_features import needs_attention_kernel, needs_bf16_packing, needs_int4_kernel
from tiny import VOCAB, ragged_batch, tiny_target

FAST = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("arch", FAST)
def test_fast_forward_matches_hf_forward_through_writes_and_rewinds(arch):
    target = tiny_target(arch, seed=1)
    ids, mask = ragged_batch([5, 9, 3], seed=0)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    m = mask.bool()
    results = []
    for cls in (TargetAdapter, FastTargetAdapter):
        a = cls(target, [0, 2, 3])
        a.reset(3, 16)
        steps = [a.forward(ids, pos, capture=True, slot_valid=m)]
        block = torch.tensor([[5, 6, 7, 8]] * 3)
        steps.append(a.forward(block, pos[:, -1:] + 1 + torch.arange(4), capture=True))
        a.rewind(3)  # keep one of the four: the next block overwrites the other slots
        a.valid[:, a.pointer:] = False
        steps.append(a.forward(block.flip(1), pos[:, -1:] + 2 + torch.arange(4), capture=True))
        a.grow(32)
        steps.append(a.forward(block[:, :1], pos[:, -1:] + 6, capture=True))
        results.append(steps)
    for k, ((l_hf, f_hf), (l_fast, f_fast)) in enumerate(zip(*results)):
        sel = m if k == 0 else slice(None)
        assert torch.allclose(l_hf[sel], l_fast[sel], atol=1e-4), (arch, k)
        assert torch.allclose(f_hf[sel], f_fast[sel], atol=1e-4), (arch, k)


@pytest.mark.parametrize("arch", FAST)
def test_fast_runtime_generation_equals_hf_runtime(arch):
    target = tiny_target(arch, seed=2)
    ids, mask = ragged_batch([4, 10, 7], seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    outs = {rt: ar_generate(target, ids, mask, max_new_tokens=20, stop_token_ids=[], runtime=rt)
            for rt in ("hf", "fast")}
    assert torch.equal(outs["hf"], outs["fast"])
    spec = spec_generate(target, draft, ids, mask, max_new_tokens=20, stop_token_ids=[], runtime="fast")
    assert torch.equal(spec, outs["fast"])


def test_runtime_choice():
    llama, gemma = tiny_target("llama"), tiny_target("gemma3")
    assert isinstance(make_adapter(llama, None, "auto"), FastTargetAdapter)
    assert type(make_adapter(llama, None, "hf")) is TargetAdapter
    assert "gemma3" in fast_unsupported(gemma)
    assert type(make_adapter(gemma, None, "auto")) is TargetAdapter
    with pytest.raises(DFlashConfigError, match="fast runtime does not support"):
        make_adapter(gemma, None, "fast")
    with pytest.raises(DFlashConfigError, match="unknown runtime"):
        make_adapter(llama, None, "turbo")


@pytest.mark.parametrize("quantized", ["fast-int8", "fast-int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_runtime_is_lossless_against_its_own_plain_decoding(arch, quantized):
    target = tiny_target(arch, seed=4)
    ids, mask = ragged_batch([6, 11], seed=5)
    ar = ar_generate(target, ids, mask, max_new_tokens=24, stop_token_ids=[], runtime=quantized)
    for B in (2, 8):
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        spec = spec_generate(target, draft, ids, mask, max_new_tokens=24, stop_token_ids=[], runtime=quantized)
        assert torch.equal(spec, ar), B
    # a quantised target is a different target, but a close one
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    logits = {}
    for rt in ("fast", quantized):
        a = make_adapter(target, None, rt)
        a.reset(2, 16)
        logits[rt] = a.forward(ids, pos, capture=False, slot_valid=mask.bool())[0][mask.bool()]
    err = (logits["fast"] - logits[quantized]).abs().max() / logits["fast"].abs().max()
    # applied, and not garbage: tiny random weights quantise coarsely, 4 bits more so (the kernel's arithmetic
    # is checked on its own in test_int4_recovers_weights_stored_on_a_4_bit_grid)
    assert 0 < err < {"fast-int8": 0.25, "fast-int4": 1.0}[quantized]


@pytest.mark.parametrize("kernel", ["torch", pytest.param("dflash", marks=needs_int4_kernel)])
def test_int4_recovers_weights_stored_on_a_4_bit_grid(kernel, monkeypatch):
    monkeypatch.setattr(kernels, "int4_kernel", lambda: kernel == "dflash")
    # a weight as GGUF Q4_1 stores it, de-quantised: per group of 32, offset + scale * (0..15), both fp16
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 64), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15  # each group spans its whole range, as Q4_1's quantiser makes it
    scale = (torch.rand(48, 2, generator=g) / 8).half().float().repeat_interleave(32, 1)
    offset = torch.randn(48, 2, generator=g).half().float().repeat_interleave(32, 1)
    w = offset + scale * q
    if kernel == "torch":
        x = torch.randn(5, 64, generator=g)
        assert torch.allclose(Int4Weight(w).linear(x, None), x @ w.T, atol=1e-3)
    else:
        # dflash's kernel rounds each group of 32 inputs to int8 steps of max|x| / 127 and its output to bf16:
        # inputs already on such a grid go through exactly, up to that last rounding
        x = torch.randint(-127, 128, (5, 64), generator=g).float()
        x[:, ::32] = 127
        w4 = Int4Weight(w)
        assert w4.ours and torch.allclose(w4.linear(x, None), x @ w.T, rtol=2 ** -8, atol=1e-2)
    with pytest.raises(DFlashConfigError, match="multiple of 32"):
        Int4Weight(torch.randn(8, 40))


@pytest.mark.parametrize("arch,runtime,packs", [
    ("llama", "fast", False), ("qwen3", "fast", False), ("qwen3", "fast-int8", False), ("llama", "fast-int4", False),
    pytest.param("llama", "fast-int4", True, marks=needs_bf16_packing)])
def test_a_long_prompt_pass_multiplies_by_the_models_own_weights_or_on_dflashs_int4_kernel(arch, runtime, packs, monkeypatch):
    # where the CPU has no bf16 kernels (AVX2-only), or the runtime's kernels are quantised, a long prompt pass
    # multiplies by the HF layers' weights (in fp32 without bf16 kernels); every later step keeps the runtime's.
    # Except an int4 target on dflash's int4 kernel without bf16 kernels: that kernel reads the prompt too.
    # A CPU cannot be made to pack when it cannot; one that can is made to behave as one that cannot
    from dflash import fast, kernels

    monkeypatch.setattr(kernels, "_cpu_packs", lambda dtype: packs)
    target = tiny_target(arch, seed=6).bfloat16()
    quantize = None if runtime == "fast" else runtime.removeprefix("fast-")
    ff = fast.fast_forward(target, quantize)
    own = runtime == "fast-int4" and not packs and kernels.int4_kernel()
    assert ff.dense_rows == (None if own else fast.PROMPT_DENSE_ROWS) and ff.upcast == (not packs)
    assert fast.fast_forward(tiny_target(arch, seed=6)).dense_rows is None  # fp32 has nothing to widen
    calls = []
    dense, plain = fast._dense_linear, fast._linear
    monkeypatch.setattr(fast, "_dense_linear", lambda x, parts, upcast: (
        calls.append((x.shape[-2], "dense", upcast)), dense(x, parts, upcast))[1])
    monkeypatch.setattr(fast, "_linear", lambda x, w, b=None: (
        calls.append((x.shape[-2], type(w).__name__, None)), plain(x, w, b))[1])
    ids, mask = ragged_batch([20, 13], seed=7)  # padded to 20 tokens: one prompt pass of 20 rows per sequence
    ar = ar_generate(target, ids, mask, max_new_tokens=12, stop_token_ids=[], runtime=runtime)
    prompt_pass = {(kind, upcast) for rows, kind, upcast in calls if rows == 20}
    later = {kind for rows, kind, _ in calls if rows != 20}
    # (the LM head of the prompt pass keeps one row)
    assert prompt_pass == ({("Int4Weight", None)} if own else {("dense", not packs)})
    # (the int4 runtime keeps its output layer at 8 bits: Q8_0 on dflash's kernel where it runs; its layers'
    # int4 products run inside decoder_layers where that runs)
    head8 = "Q8Weight" if kernels.int4_kernel() else "Int8Weight"
    int4 = {head8} if ff.layer_weights is not None else {"Int4Weight", head8}
    assert later == {None: {"Tensor"}, "int8": {"Int8Weight"}, "int4": int4}[quantize]
    for B in (2, 8):  # plain and speculative decoding share that prompt pass: still exact against each other
        draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=B)
        spec = spec_generate(target, draft, ids, mask, max_new_tokens=12, stop_token_ids=[], runtime=runtime)
        assert torch.equal(spec, ar), B
    if own:
        return
    # and the dense pass computes the hidden states that the unquantised runtime's kernels would, up to their
    # rounding (its one-row LM head is the runtime's own)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    fast.fast_forward(target).dense_rows = 10 ** 6
    out = {}
    for rt in (runtime, "fast"):
        a = make_adapter(target, [1, 3], rt)
        a.reset(2, 32)
        out[rt] = a.forward(ids, pos, capture=True, slot_valid=mask.bool(), logits_to_keep=1)[1].float()
    assert torch.allclose(out[runtime], out["fast"], atol=0.1, rtol=0.05)


def test_compiled_runtime_decodes_as_the_eager_one():
    target = tiny_target("qwen3", seed=4)  # q/k norms: the family with the most to trace
    ids, mask = ragged_batch([4, 10, 7], seed=5)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    eager = ar_generate(target, ids, mask, runtime="fast", **kw)
    compiled = ar_generate(target, ids, mask, runtime="fast-compile", **kw)
    assert torch.equal(compiled, eager)
    assert torch.equal(spec_generate(target, draft, ids, mask, runtime="fast-compile", **kw), eager)
    # the decode and the verify steps were compiled (each timed once); the prompt pass was not
    assert set(make_adapter(target, None, "fast-compile").fast.compile_seconds) == {"n rows x 1 token",
                                                                                  "n rows x n tokens, tapped"}


def test_each_runtime_of_a_model_runs_its_own_compiled_graphs():
    # the compiled steps do not guard on the forward's own weights (FastForward._compiled_step), so a graph built
    # for one FastForward must never run for another: here the plain, int8 and int4 forwards of one model (int4
    # through dflash's kernel where the CPU has it: an operator among the traced forward's state)
    target = tiny_target("llama", seed=6)
    ids, mask = ragged_batch([5, 8], seed=3)
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    for runtime in ("fast", "fast-int8", "fast-int4"):
        compiled = ar_generate(target, ids, mask, runtime=f"{runtime}-compile", **kw)
        assert torch.equal(compiled, ar_generate(target, ids, mask, runtime=runtime, **kw)), runtime
    assert all(make_adapter(target, None, f"{r}-compile").fast.compile_seconds for r in ("fast", "fast-int8", "fast-int4"))


def test_compiled_draft_proposes_and_writes_context_as_the_eager_one():
    from dflash.model import DraftKVCache

    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4)
    torch.manual_seed(0)
    feats = torch.randn(2, 9, draft.config.num_context_features * draft.config.hidden_size)
    block = torch.tensor([[5, 3, 3, 3], [7, 3, 3, 3]])
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :2] = False
    out = {}
    with torch.inference_mode():
        for compile in (False, True):
            cache = DraftKVCache(draft.config, 2, 16, "cpu", torch.float32)
            cache.positions[:, :13] = torch.arange(13)
            draft.write_context(feats, cache, 0, compile=compile)
            proposal = draft.propose(block, torch.arange(9, 13).expand(2, 4), cache, valid, compile=compile)
            out[compile] = (cache.keys, proposal)
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5) and torch.equal(out[True][1], out[False][1])
    # the graphs skip the guards on the draft's weights, so a replaced weight gets new graphs
    graphs = draft.compiled()
    assert draft.compiled() == graphs
    draft.fc.weight = torch.nn.Parameter(draft.fc.weight.detach().clone())
    assert all(new is not old for new, old in zip(draft.compiled(), graphs))


@needs_bf16_packing
def test_compiled_runtime_multiplies_by_the_packed_bf16_weights():
    # packed weights have oneDNN's own layout, which torch.compile can only call through dflash::packed_linear
    ids, mask = ragged_batch([6], seed=9)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    bf16 = tiny_target("llama", seed=8).bfloat16()
    logits = {}
    for name, target, runtime in (("fp32", tiny_target("llama", seed=8), "fast"), ("eager", bf16, "fast"),
                                  ("compiled", bf16, "fast-compile")):
        a = make_adapter(target, None, runtime)
        assert isinstance(a.fast.layers[0].wqkv, kernels.PackedWeight) == (target is bf16)
        a.reset(1, 16)
        a.forward(ids, pos, capture=False, slot_valid=mask.bool(), logits_to_keep=1)  # the prompt, eager
        logits[name] = a.forward(ids[:, -1:], pos[:, -1:] + 1, capture=False)[0].float()  # a decode step
    assert make_adapter(bf16, None, "fast-compile").fast.compile_seconds.keys() == {"1 row x 1 token"}
    # inductor fuses the elementwise ops around the products, so its bf16 roundings differ from eager's: both
    # stay as close to the fp32 model
    err = {k: (logits[k] - logits["fp32"]).abs().max().item() for k in ("eager", "compiled")}
    assert 0 < err["compiled"] < 2 * err["eager"] + 0.05, err


def test_quantised_runtimes_refuse_a_model_off_the_cpu():
    target = tiny_target("llama", seed=1).to("meta")  # stands for a CUDA model: any device but the CPU
    for runtime in ("fast-int4", "fast-int8-compile"):
        with pytest.raises(DFlashConfigError, match="is CPU-only.*use runtime 'fast' or 'hf'"):
            make_adapter(target, None, runtime)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: fused biases too
def test_the_fast_path_holds_no_second_copy_of_the_weights(arch):
    target = tiny_target(arch, seed=2)
    params = sum(p.numel() * p.element_size() for p in target.parameters())
    ids, mask = ragged_batch([5, 8], seed=1)
    ref = ar_generate(target, ids, mask, max_new_tokens=6, stop_token_ids=[], runtime="hf")
    out = ar_generate(target, ids, mask, max_new_tokens=6, stop_token_ids=[], runtime="fast")
    ff = fast.fast_forward(target)
    storages = {}
    for t in [*target.parameters(), *(w for L in ff.layers for w in (L.wqkv, L.wgu))]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) <= params * 1.001  # the fused weights are the model's own, not copies
    layer = target.model.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == ff.layers[0].wqkv.untyped_storage().data_ptr()
    assert torch.equal(out, ref)  # and both forwards still compute the same
    assert torch.equal(ar_generate(target, ids, mask, max_new_tokens=6, stop_token_ids=[], runtime="hf"), ref)


def _steps(target, runtime, prompts: list[list[int]], block: list[list[int]]):
    """Logits of a verify step over `block` after the prompts, and of the same tokens one step at a time."""
    ids, mask = left_pad(prompts, 0)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    a = make_adapter(target, None, runtime)
    a.reset(len(prompts), ids.shape[1] + 16)
    block = torch.tensor(block)
    k = block.shape[1]
    bpos = pos[:, -1:] + 1 + torch.arange(k)
    with torch.inference_mode():
        a.forward(ids, pos, capture=False, slot_valid=mask.bool(), logits_to_keep=1)
        verify = a.forward(block, bpos, capture=False)[0].float()
        a.rewind(k)
        a.valid[:, a.pointer:] = False
        single = torch.cat([a.forward(block[:, t:t + 1], bpos[:, t:t + 1], capture=False)[0].float()
                            for t in range(k)], 1)
    return verify, single


@needs_attention_kernel
@needs_int4_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int4_verify_steps_are_bitwise_single_steps_and_rows_do_not_see_each_other(arch):
    # every product (dflash's int4 kernel), the attention (dflash's cache kernel), norms and RoPE compute a row
    # and a query the same way whatever else is in the step: verifying k tokens gives the logits of k single
    # steps bit for bit, and a row's logits do not depend on the other rows
    target = tiny_target(arch, seed=3).bfloat16()
    prompts, block = [[5, 9, 11, 3, 7, 20, 8], [4, 6, 2]], [[12, 30, 41, 7, 9], [50, 8, 8, 13, 2]]
    verify, single = _steps(target, "fast-int4", prompts, block)
    assert torch.equal(verify, single)
    alone, _ = _steps(target, "fast-int4", prompts[1:], block[1:])
    assert torch.equal(alone[0], verify[1])


def _biased_llama():
    from transformers import AutoModelForCausalLM
    from tiny import tiny_config

    cfg = tiny_config("llama")
    cfg.attention_bias = cfg.mlp_bias = True
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)  # HF starts biases at 0: they would add nothing
    return model


@needs_attention_kernel
@needs_int4_kernel
@pytest.mark.parametrize("arch", FAST + ["llama with biases"])
def test_a_steps_layers_in_one_cpp_call_compute_what_the_python_layers_do(arch):
    # an int4 bf16 model's eager steps run their layers in decoder_layers (csrc/cache_attention.cpp), which does
    # op for op what _forward's Python does: logits and tapped states bitwise equal, for a ragged prompt pass and
    # verify and decode steps after it (qwen2: q/k/v biases; qwen3: q/k norms; llama with biases: all of them)
    target = (_biased_llama() if arch == "llama with biases" else tiny_target(arch, seed=4)).bfloat16()
    ff = fast.fast_forward(target, "int4")
    assert ff.layer_weights is not None
    ids, mask = ragged_batch([6, 3, 9], seed=1)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    out = {}
    for fused in (True, False):
        weights, ff.layer_weights = ff.layer_weights, (ff.layer_weights if fused else None)
        try:
            a = make_adapter(target, [0, 2, 3], "fast-int4")
            a.reset(3, 24)
            steps = [a.forward(ids, pos, capture=True, slot_valid=mask.bool())]
            last = pos[:, -1:]
            for k in (5, 1, 3):
                block = torch.randint(3, VOCAB, (3, k), generator=torch.Generator().manual_seed(k))
                steps.append(a.forward(block, last + 1 + torch.arange(k), capture=True))
                last = last + k
            out[fused] = steps
        finally:
            ff.layer_weights = weights
    for k, ((l1, f1), (l0, f0)) in enumerate(zip(out[True], out[False])):
        assert torch.equal(l1, l0) and torch.equal(f1, f0), (arch, k)


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=needs_attention_kernel), "torch"])
def test_attention_with_and_without_dflashs_kernel(kernel, monkeypatch):
    # without the kernel (DFLASH_ATTENTION_KERNEL=torch, or no compiler) the CPU cache holds fp32 and SDPA
    # attends; either way plain and speculative decoding agree and the fp32 model matches HF's forward
    monkeypatch.setenv("DFLASH_ATTENTION_KERNEL", kernel)
    ids, mask = ragged_batch([5, 11], seed=3)
    fp32 = tiny_target("qwen3", seed=7)
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    assert torch.equal(ar_generate(fp32, ids, mask, runtime="fast", **kw), ar_generate(fp32, ids, mask, runtime="hf", **kw))
    bf16 = tiny_target("qwen3", seed=7).bfloat16()
    ff = fast.fast_forward(bf16)
    assert ff.cache_kernel == (kernel == "auto")
    assert ff.attn_dtype == (torch.bfloat16 if kernel == "auto" else torch.float32)
    draft = DFlashDraftModel.from_target(bf16, num_layers=1, block_size=4)
    assert torch.equal(spec_generate(bf16, draft, ids, mask, runtime="fast", **kw),
                       ar_generate(bf16, ids, mask, runtime="fast", **kw))


def test_the_gpu_attention_path_expanding_key_value_heads_computes_the_same():
    # on a GPU the fast forward expands the key/value heads for SDPA (its fused kernels take an explicit mask only
    # without enable_gqa); the same forward on the CPU gives the same tokens and logits within fp32 rounding
    ids, mask = ragged_batch([7, 12], seed=2)
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    for expand in (False, True):
        target = tiny_target("qwen2", seed=9)
        ff = fast.fast_forward(target)
        ff.expand_kv, ff.cache_kernel = expand, False  # SDPA for every step, as on a GPU
        out = ar_generate(target, ids, mask, runtime="fast", **kw)
        assert torch.equal(out, ar_generate(target, ids, mask, runtime="hf", **kw)), expand


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=needs_attention_kernel), "torch"])
def test_the_cuda_graph_step_form_computes_what_the_step_does(kernel, monkeypatch):
    # on a GPU, compiled steps run as CUDA graphs, whose shapes must not move with the pointer: new keys go to
    # the slots of a tensor and attention reads the whole storage. On the CPU that form gives the same logits
    monkeypatch.setenv("DFLASH_ATTENTION_KERNEL", kernel)
    target = tiny_target("qwen3", seed=5)
    ids, mask = ragged_batch([6, 3], seed=4)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    block = torch.tensor([[7, 8, 9], [10, 11, 12]])
    out = []
    for graph_form in (False, True):
        a = make_adapter(target, [0, 2], "fast")
        a.reset(2, 24)
        with torch.inference_mode():
            a.forward(ids, pos, capture=False, slot_valid=mask.bool(), logits_to_keep=1)
            p = a.pointer
            a.valid[:, p:p + 3] = True
            args = (block, pos[:, -1:] + 1 + torch.arange(3), a.cache, a.valid, p, [0, 2], 0)
            if graph_form:
                logits, taps = a.fast._forward(*args[:4], 0, *args[5:], p + torch.arange(3))
            else:
                logits, taps = a.fast._forward(*args)
        out.append((logits, taps[2], a.cache.layers[1].keys.clone()))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5) and torch.allclose(out[0][1], out[1][1], atol=1e-5)
    assert torch.allclose(out[0][2], out[1][2], atol=1e-5)  # the same cache writes
