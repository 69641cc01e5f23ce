"""The prepacked oneDNN linear: bitwise what F.linear gives, refreshed when the weight changes, and out of the
way of training (grad enabled) and of fp32."""

import fcntl
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash import kernels, machine
from dflash.errors import DFlashConfigError
from dflash.kernels import Linear, linear
from cpu_features import needs_attention_kernel, needs_bf16_packing, needs_int4_kernel



def test_where_the_cpu_cannot_pack_few_rows_take_f_linear_and_more_multiply_in_fp32(monkeypatch):
    # an AVX2-only CPU: oneDNN refuses to pack bf16; under WIDEN_ROWS rows `linear` is F.linear, from there on
    # the product runs in fp32 by a widened copy of the weight, remade when the weight changes
    monkeypatch.setattr(kernels, "_cpu_packs", lambda dtype: False)
    w, b = torch.randn(16, 8).bfloat16(), torch.randn(16).bfloat16()
    few, many = torch.randn(kernels.WIDEN_ROWS - 1, 8).bfloat16(), torch.randn(2, kernels.WIDEN_ROWS, 8).bfloat16()
    with torch.no_grad():
        assert not kernels.packable(w) and kernels.widens(w)
        assert torch.equal(linear(few, w, b), F.linear(few, w, b)) and w not in kernels._packed
        assert w not in kernels._widened
        for _ in range(2):  # the second time after an in-place update
            wide = F.linear(many.float(), w.float(), b.float()).bfloat16()
            assert torch.equal(linear(many, w, b), wide) and w in kernels._widened
            assert torch.allclose(wide.float(), F.linear(many, w, b).float(), atol=0.1, rtol=0.02)
            w.mul_(2)


@needs_int4_kernel
def test_where_the_cpu_cannot_pack_a_weight_that_fits_q8_0_multiplies_on_dflashs_q8_kernel(monkeypatch):
    # the drafts' products on an AVX2-only CPU: Q8_0 on dflash's kernel for any number of rows (re-quantised when
    # the weight changes); where that kernel does not run, the fp32 product of the test above
    monkeypatch.setattr(kernels, "_cpu_packs", lambda dtype: False)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(16, 64, generator=g).bfloat16(), torch.randn(16, generator=g).bfloat16()
    with torch.no_grad():
        for x in (torch.randn(1, 64, generator=g).bfloat16(), torch.randn(2, 5, 64, generator=g).bfloat16()):
            for _ in range(2):  # the second time after an in-place update
                got = linear(x, w, b)
                assert torch.equal(got, kernels.Q8Weight(w).linear(x, b)) and w in kernels._eight_bit
                exact = F.linear(x.float(), w.float(), b.float())
                assert torch.allclose(got.float(), exact, atol=0.05 * exact.abs().max().item())
                w.mul_(2)
        monkeypatch.setattr(kernels, "int4_kernel", lambda: False)
        many = torch.randn(kernels.WIDEN_ROWS, 64, generator=g).bfloat16()
        assert torch.equal(linear(many, w, b), F.linear(many.float(), w.float(), b.float()).bfloat16())


def _assert_same_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise, except on a CPU with AMX: there oneDNN runs the packed weight (a blocked layout) and F.linear's
    plain one through AMX kernels that sum in different orders, so a result may differ by one bf16 rounding."""
    if not machine.cpu_has("amx_bf16"):
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got.float(), want.float(), rtol=0, atol=want.float().abs().max().item() * 2 ** -7)


@needs_bf16_packing
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48), (64, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear_in_bf16(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 48, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(*shape, generator=g).bfloat16()
    with torch.inference_mode():
        out = linear(x, w, b)
        assert w in kernels._packed  # it took the packed path
        _assert_same_product(out, F.linear(x, w, b))
        strided = torch.randn(shape[-1], *shape[:-1], generator=g).bfloat16().movedim(0, -1)
        # (F.linear itself rounds differently for a strided 3-D input with bias: it adds the bias after the
        # product is rounded to bf16; the packed path matches its contiguous, fused-bias result)
        _assert_same_product(linear(strided, w, b), F.linear(strided.contiguous(), w, b))


@needs_bf16_packing
def test_packed_weight_follows_in_place_updates_and_replacement():
    layer = Linear(32, 16).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # an optimizer step: same storage, new version
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert not torch.equal(layer(x), before)
        layer.weight.data = torch.randn(16, 32).bfloat16()  # new storage
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16_packing
def test_packs_weights_made_under_inference_mode():
    with torch.inference_mode():
        w = torch.cat([torch.randn(8, 32), torch.randn(8, 32)]).bfloat16()  # e.g. a fused q/k/v weight
        x = torch.randn(2, 32).bfloat16()
        assert torch.equal(linear(x, w), F.linear(x, w))


def test_training_and_fp32_take_f_linear():
    layer = Linear(32, 16).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    out = layer(x)  # grad enabled: differentiable, nothing packed
    out.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight not in kernels._packed
    w32 = torch.randn(16, 32)
    with torch.inference_mode():
        x32 = torch.randn(3, 32)
        assert torch.equal(linear(x32, w32), F.linear(x32, w32))
    assert w32 not in kernels._packed


@needs_bf16_packing
def test_bf16_generation_is_the_same_with_and_without_packing(monkeypatch):
    from dflash import DFlashDraftModel, ar_generate, spec_generate
    from dflash.fast import fast_forward
    from tiny import ragged_batch, tiny_target

    target = tiny_target("llama", seed=4).bfloat16()
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    ids, mask = ragged_batch([4, 9], seed=5)

    def both():
        kw = dict(max_new_tokens=12, stop_token_ids=[], runtime="fast")
        return ar_generate(target, ids, mask, **kw), spec_generate(target, draft, ids, mask, **kw)

    packed = both()
    assert isinstance(fast_forward(target).layers[0].wqkv, kernels.PackedWeight)
    monkeypatch.setattr(kernels, "_ONEDNN", False)
    target.__dict__.pop("_dflash_fast_forward")  # rebuild the target's fast forward, now unpacked
    plain = both()
    assert isinstance(fast_forward(target).layers[0].wqkv, torch.Tensor)
    assert all(torch.equal(p, q) for p, q in zip(packed, plain))


@pytest.mark.parametrize("ours", [True, False])
@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 96, 3))])  # tiny vocabularies have 96 tokens
def test_where_the_cpu_cannot_pack_drafts_propose_through_an_int8_head_and_stay_exact(monkeypatch, draft_vocab, ours):
    from dflash import DFlashDraftModel, ar_generate, spec_generate
    from tiny import ragged_batch, tiny_target

    if ours and not kernels.int4_kernel():
        pytest.skip("the Q8_0 head runs on dflash's kernels: an x86 CPU with AVX2, FMA and F16C and a C++ compiler")
    if not ours:  # PyTorch's int8 kernel, per row
        monkeypatch.setenv("DFLASH_INT4_KERNEL", "torch")
    monkeypatch.setattr(kernels, "_cpu_packs", lambda dtype: False)
    target = tiny_target("llama", seed=6).bfloat16()
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    draft.set_draft_vocab(draft_vocab)
    ids, mask = ragged_batch([4, 9], seed=7)
    kw = dict(max_new_tokens=12, stop_token_ids=[], runtime="fast")
    spec = spec_generate(target, draft, ids, mask, **kw)
    assert isinstance(draft._proposal_head()[0], kernels.Q8Weight if ours else kernels.Int8Weight)
    assert torch.equal(spec, ar_generate(target, ids, mask, **kw))




def _rounded_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as dflash's kernels see it: bf16, then rounded to int8 steps of max|x| / 127 per group of 32."""
    groups = x.bfloat16().float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127) / amax  # IEEE division, as the kernel's (`127 / amax` is not, by an ulp)
    return ((groups * torch.where(amax > 0, inv, 0)).round() * (amax / 127)).view(x.shape)


def _int4_reference(x: torch.Tensor, w: kernels.Int4Weight) -> torch.Tensor:
    """What dflash's int4 kernel computes, in fp32 from its own layout: Q4_1 weights times the inputs rounded to
    int8 per group of 32 (in steps of max|x| / 127)."""
    tiles, octets, _ = w.qweight.shape
    nib = torch.stack([w.qweight & 15, w.qweight >> 4], -1).view(tiles, octets, 16, 4, 2).float()
    q = nib.permute(0, 2, 1, 4, 3).reshape(tiles * 16, octets * 8)  # [out, in]
    sl = w.scales.float().permute(2, 0, 3, 1).reshape(2, tiles * 16, -1).repeat_interleave(32, -1)
    return _rounded_inputs(x) @ (q * sl[0] + sl[1]).T


@needs_int4_kernel
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (160, 96)])
def test_int4_kernel_matches_its_arithmetic_and_a_row_does_not_depend_on_the_batch(out_features, in_features):
    g = torch.Generator().manual_seed(1)
    w = kernels.Int4Weight(torch.randn(out_features, in_features, generator=g))
    assert w.ours
    for rows in (*range(1, 9), 13, 17):  # every row-count template, several passes of 8 rows, tails of tiles
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        x[0, :32] = 0  # an all-zero group has no int8 step
        y = w.linear(x, None)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        ref = _int4_reference(x, w)
        assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max()), rows
        # bitwise the same when each row is multiplied alone: verifying a block is decoding token by token
        alone = torch.cat([w.linear(x[i:i + 1].clone(), None) for i in range(rows)])
        assert torch.equal(alone, y), rows


def _int4_builds_here() -> list[str]:
    flags = machine.cpu_flags() or set()
    return [b for b, (needs, _) in kernels.INT4_BUILDS.items() if needs <= flags and kernels._int4_build(b) is None]


def _skip_unless_built(build: str) -> None:
    if build not in _int4_builds_here():
        pytest.skip(f"the {build} build of dflash's int4/Q8_0 kernels needs {sorted(kernels.INT4_BUILDS[build][0])} "
                    "and a C++ compiler")


@pytest.mark.parametrize("build", list(kernels.INT4_BUILDS))
def test_each_int4_build_does_the_reference_arithmetic_and_all_agree_bitwise(build):
    # the AVX2 build (vpmaddubsw + vpmaddwd) makes the very sums the AVX-512 VNNI build (vpdpbusd) makes, and the
    # AMX build's tile products (from 10 rows on) too, with the same float operations lane by lane: the same bits,
    # whatever the CPU, and a row alone as in a batch
    _skip_unless_built(build)
    g = torch.Generator().manual_seed(3)
    w = kernels.Int4Weight(torch.randn(160, 96, generator=g), ours=True)
    for rows in (1, 2, 3, 4, 5, 7, 9, 10, 12, 16, 17, 27):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        y = kernels.int4_op(build)(x, w.qweight, w.scales)
        ref = _int4_reference(x, w)
        assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max()), rows
        assert torch.equal(torch.cat([kernels.int4_op(build)(x[i:i + 1].clone(), w.qweight, w.scales)
                                      for i in range(rows)]), y), rows
        for other in _int4_builds_here():
            assert torch.equal(kernels.int4_op(other)(x, w.qweight, w.scales), y), (build, other, rows)


def test_the_avx_vnni_code_gives_the_avx2_bits_with_vpdpbusd_emulated():
    # where the CPU lacks AVX-VNNI, its build's code (vpdpbusd in place of each vpmaddubsw + vpmaddwd pair) runs
    # with that one instruction emulated exactly by AVX2 ones: the layout, the sums and the epilogue are checked
    # here on every AVX2 CPU, and the instruction itself where a CPU has it (the avx_vnni build above)
    _skip_unless_built("avx2")
    assert kernels._int4_build("avx_vnni_emulated") is None
    g = torch.Generator().manual_seed(5)
    w4 = kernels.Int4Weight(torch.randn(160, 96, generator=g), ours=True)
    w8 = kernels.Q8Weight(torch.randn(200, 96, generator=g))
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        x[0, 32:64] = 0
        for name, w in (("int4_linear", w4), ("q8_linear", w8)):
            y = kernels.int4_op("avx_vnni_emulated", name)(x, w.qweight, w.scales)
            assert torch.equal(y, kernels.int4_op("avx2", name)(x, w.qweight, w.scales)), (name, rows)


@needs_int4_kernel
def test_int4_kernel_inside_torch_compile_and_on_bad_input(monkeypatch):
    w = kernels.Int4Weight(torch.randn(32, 64))
    b = torch.randn(32)
    x = torch.randn(2, 3, 64)
    compiled = torch.compile(lambda x: w.linear(x, b), fullgraph=True)
    assert torch.equal(compiled(x), w.linear(x, b))
    with pytest.raises(RuntimeError, match="x must be a 2-D bf16"):
        kernels.int4_op()(x.view(6, 64), w.qweight, w.scales)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        kernels.int4_op()(torch.randn(2, 32).bfloat16(), w.qweight, w.scales)
    with pytest.raises(RuntimeError, match="scales must be a contiguous fp16"):
        kernels.int4_op()(x.view(6, 64).bfloat16(), w.qweight, w.scales.float())
    monkeypatch.setenv("DFLASH_INT4_KERNEL", "fastest")
    with pytest.raises(DFlashConfigError, match="DFLASH_INT4_KERNEL='fastest': expected one of auto, dflash, torch"):
        kernels.int4_kernel_choice()
    with pytest.raises(DFlashConfigError, match="needs a multiple of 16"):
        kernels.Int4Weight(torch.randn(40, 64), ours=True)


def _q8_reference(x: torch.Tensor, w: kernels.Q8Weight) -> torch.Tensor:
    """What the kernel's q8_linear computes, in fp32 from its layout: Q8_0 weights times int8-rounded inputs."""
    tiles, quads, _ = w.qweight.shape
    q = w.qweight.view(tiles, quads, 8, 4).permute(0, 2, 1, 3).reshape(tiles * 8, quads * 4).float()
    scale = w.scales.float().permute(0, 2, 1).reshape(tiles * 8, -1).repeat_interleave(32, -1)
    return _rounded_inputs(x) @ (q * scale).T


@pytest.mark.parametrize("build", list(kernels.INT4_BUILDS))
def test_q8_head_kernel_does_the_reference_arithmetic_alone_as_in_a_batch_in_every_build(build):
    _skip_unless_built(build)
    g = torch.Generator().manual_seed(4)
    w = kernels.Q8Weight(torch.randn(200, 96, generator=g))  # 25 tiles of 8: every tile grouping and a tail
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):  # every row template, passes of 4 rows and their tails
        x = torch.randn(rows, 96, generator=g).bfloat16()
        x[0, 32:64] = 0  # an all-zero group has no int8 step
        y = kernels.int4_op(build, "q8_linear")(x, w.qweight, w.scales)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
        ref = _q8_reference(x, w)
        assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max()), rows
        assert torch.equal(torch.cat([kernels.int4_op(build, "q8_linear")(x[i:i + 1].clone(), w.qweight, w.scales)
                                      for i in range(rows)]), y), rows
        for other in _int4_builds_here():
            assert torch.equal(kernels.int4_op(other, "q8_linear")(x, w.qweight, w.scales), y), (build, other, rows)
    # Q8_0 keeps the weight to within half a step of its group
    ref_w = torch.randn(16, 64, generator=g)
    back = _q8_reference(torch.eye(64), kernels.Q8Weight(ref_w)).T
    assert (back - ref_w).abs().max() <= ref_w.abs().max() / 127


@needs_int4_kernel
def test_q8_kernel_inside_torch_compile_and_on_bad_input():
    w = kernels.Q8Weight(torch.randn(24, 64))
    x = torch.randn(2, 3, 64)
    compiled = torch.compile(lambda x: w.linear(x, None), fullgraph=True)
    assert torch.equal(compiled(x), w.linear(x, None))
    with pytest.raises(RuntimeError, match="q8_linear: x has 32 inputs, the weight 64"):
        kernels.int4_op(name="q8_linear")(torch.randn(2, 32).bfloat16(), w.qweight, w.scales)
    with pytest.raises(RuntimeError, match="q8_linear: qweight must be a contiguous int8"):
        kernels.int4_op(name="q8_linear")(x.view(6, 64).bfloat16(), w.qweight.view(torch.uint8), w.scales)
    with pytest.raises(DFlashConfigError, match="outputs a multiple of 8"):
        kernels.Q8Weight(torch.randn(12, 64))


def _attention_case(b, heads, kv_heads, nq, T, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, nq, d, generator=g)
    k = torch.randn(b, kv_heads, T + 5, d, generator=g).to(dtype)[:, :, :T]  # a slice of a longer cache
    v = torch.randn(b, kv_heads, T + 5, d, generator=g).to(dtype)[:, :, :T]
    visible = torch.rand(b, nq, T, generator=g) > 0.3
    visible[:, torch.arange(nq), T - nq + torch.arange(nq)] = True  # each query sees its own slot
    return q, k, v, visible


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 32])
def test_cache_attention_matches_sdpa(dtype, d):
    q, k, v, visible = _attention_case(3, 6, 2, 5, 70, d, dtype)
    got = torch.ops.dflash_attn.cache_attention(q, k, v, visible, d ** -0.5)
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None]
    want = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    # bf16 queries: widened exactly inside, the output rounded to bf16 as the caller would round it
    qb = q.bfloat16()
    assert torch.equal(torch.ops.dflash_attn.cache_attention(qb, k, v, visible, d ** -0.5),
                       torch.ops.dflash_attn.cache_attention(qb.float(), k, v, visible, d ** -0.5).bfloat16())


@needs_attention_kernel
def test_cache_attention_of_a_query_does_not_depend_on_anything_it_does_not_see():
    # the same query against the same visible keys, bit for bit: alone or among other queries, other batch rows,
    # with masked keys after it (a verify block) and masked holes before it (rejected or padded slots)
    d, T = 64, 50
    q, k, v, visible = _attention_case(1, 4, 2, 1, T, d, torch.bfloat16, seed=1)
    alone = torch.ops.dflash_attn.cache_attention(q, k, v, visible, 0.125)
    g = torch.Generator().manual_seed(2)
    hole, tail = 7, 9
    k2 = torch.cat([torch.randn(1, 2, hole, d, generator=g).bfloat16(), k,
                    torch.randn(1, 2, tail, d, generator=g).bfloat16()], 2)
    v2 = torch.cat([torch.randn(1, 2, hole, d, generator=g).bfloat16(), v,
                    torch.randn(1, 2, tail, d, generator=g).bfloat16()], 2)
    others = torch.randn(1, 4, 3, d, generator=g)
    q2 = torch.cat([others[:, :, :2], q, others[:, :, 2:]], 2)  # our query third of four
    vis2 = torch.rand(1, 4, hole + T + tail, generator=g) > 0.5
    vis2[:, 2] = False
    vis2[:, 2, hole:hole + T] = visible[:, 0]
    batch_q = torch.cat([torch.randn(1, 4, 4, d, generator=g), q2])  # and a second batch row before it
    batch_k, batch_v = torch.cat([k2.flip(2), k2]), torch.cat([v2.flip(2), v2])
    batch_vis = torch.cat([torch.rand(1, 4, hole + T + tail, generator=g) > 0.5, vis2])
    among = torch.ops.dflash_attn.cache_attention(batch_q, batch_k, batch_v, batch_vis, 0.125)
    assert torch.equal(among[1, :, 2], alone[0, :, 0])
    # a row that sees none of its first 37 slots (it joined a batch whose other rows are longer): the kernel
    # starts where the row's keys start, with the same bits as if those slots were not there
    # (shifted by 1 to 16 slots and by 37), and with slots after its last that hold anything, NaN included (a
    # cache's room past a row's end)
    room = torch.full((1, 2, 3, d), float("nan")).bfloat16()
    for lead in (37, *range(1, 17)):
        k3 = torch.cat([torch.randn(1, 2, lead, d, generator=g).bfloat16(), k, room], 2)
        v3 = torch.cat([torch.randn(1, 2, lead, d, generator=g).bfloat16(), v, room], 2)
        vis3 = torch.cat([torch.zeros(1, 1, lead, dtype=torch.bool), visible, torch.zeros(1, 1, 3, dtype=torch.bool)],
                         2)
        assert torch.equal(torch.ops.dflash_attn.cache_attention(q, k3, v3, vis3, 0.125), alone), lead
    # unseen slots between a query's keys (a candidate tree: a node sees its ancestors, not their siblings, which
    # lie between them) change nothing: its keys spread out with 1-3 unseen slots after each, 20 ways (a sum that
    # took each slot in a lane by its place, slot % 16, differs in about a third of them)
    seen = visible[0, 0].nonzero()[:, 0]
    for _ in range(20):
        places = torch.cumsum(torch.randint(2, 5, (len(seen),), generator=g), 0) - 1
        ks = torch.full((1, 2, int(places[-1]) + 1, d), float("nan"))
        vs = ks.clone()
        ks[:, :, places], vs[:, :, places] = k[:, :, seen].float(), v[:, :, seen].float()
        vis4 = torch.zeros(1, 1, ks.shape[2], dtype=torch.bool)
        vis4[0, 0, places] = True
        assert torch.equal(torch.ops.dflash_attn.cache_attention(q, ks.bfloat16(), vs.bfloat16(), vis4, 0.125), alone)


@needs_attention_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads,nq", [(8, 6), (6, 1), (6, 2)])
def test_cache_attention_of_many_queries_is_each_query_alone(d, heads, nq):
    # a verify block's queries over a long cache that they all see (the kernel then weighs each value row into
    # two to four rows at once: a key/value head's query heads times the queries, split between the threads) give
    # each query's attention computed alone, bit for bit; one query skips a key
    g = torch.Generator().manual_seed(3)
    kv_heads, T = 2, 90
    q = torch.randn(1, heads, nq, d, generator=g)
    k, v = (torch.randn(1, kv_heads, T, d, generator=g).bfloat16() for _ in range(2))
    visible = torch.ones(1, nq, T, dtype=torch.bool)
    visible[0, torch.arange(nq)[:, None], T - nq + torch.arange(nq)] = torch.ones(nq, nq).tril().bool()
    visible[0, min(4, nq - 1), 33] = False
    out = torch.ops.dflash_attn.cache_attention(q, k, v, visible, d ** -0.5)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        for i in range(nq):
            alone = torch.ops.dflash_attn.cache_attention(q[:, h:h + 1, i:i + 1], k[:, kv:kv + 1], v[:, kv:kv + 1],
                                                          visible[:, i:i + 1], d ** -0.5)
            assert torch.equal(out[:, h:h + 1, i:i + 1], alone), (h, i)


@needs_attention_kernel
def test_cache_attention_refuses_what_it_cannot_take():
    q, k, v, visible = _attention_case(1, 4, 2, 2, 10, 64, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.dflash_attn.cache_attention(q[..., :40], k[..., :40], v[..., :40], visible, 0.1)
    with pytest.raises(RuntimeError, match="must both be fp32 or both bf16"):
        torch.ops.dflash_attn.cache_attention(q, k.half(), v.half(), visible, 0.1)


@needs_attention_kernel
def test_rms_norm_kernel_is_hfs_norm_and_a_row_does_not_depend_on_the_batch():
    from dflash.fast import _norm

    g = torch.Generator().manual_seed(5)
    module = torch.nn.Module()
    module.weight, module.eps = torch.nn.Parameter((1 + torch.randn(96, generator=g) / 4).bfloat16()), 1e-5
    x = (torch.randn(7, 96, generator=g) * 3).bfloat16()
    y = torch.ops.dflash_attn.rms_norm(x, module.weight, module.eps)
    ref = _norm(module, x)  # HF's arithmetic through PyTorch's ops
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=0)
    assert (y == ref).float().mean() > 0.95  # at most an fp32 ulp before the rounding to bf16 differs
    assert torch.equal(torch.cat([torch.ops.dflash_attn.rms_norm(x[i:i + 1].clone(), module.weight, 1e-5)
                                  for i in range(7)]), y)
    assert torch.equal(torch.ops.dflash_attn.rms_norm(x.t().contiguous().t(), module.weight, 1e-5), y)  # strided
    with pytest.raises(RuntimeError, match="rms_norm: x must be a bf16 CPU tensor"):
        torch.ops.dflash_attn.rms_norm(x.float(), module.weight, 1e-5)


@needs_attention_kernel
def test_silu_mul_kernel_is_pytorchs_and_a_row_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(6)
    gu = (torch.randn(9, 2, 400, generator=g) * 4).bfloat16()  # gate then up, over every range SiLU has
    gu[0, 0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated both ways, and zeros
    y = torch.ops.dflash_attn.silu_mul(gu.view(9, 800))
    gate, up = gu.unbind(1)
    ref = F.silu(gate) * up  # PyTorch's two bf16 ops
    assert y.shape == (9, 400) and torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-30)
    assert (y == ref).float().mean() > 0.99  # only an fp32 ulp of the exponential apart before the rounding
    assert torch.equal(torch.cat([torch.ops.dflash_attn.silu_mul(gu[i].view(1, 800)) for i in range(9)]), y)
    with pytest.raises(RuntimeError, match="silu_mul: expected a bf16 CPU tensor"):
        torch.ops.dflash_attn.silu_mul(gu.float().view(9, 800))


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=needs_attention_kernel), "torch"])
def test_argmax_answers_what_torch_argmax_answers(kernel, monkeypatch):
    # ties (the first wins), -0 beside +0, NaN (above everything, the first one), rows of -inf, lengths that are
    # not a multiple of 8 lanes, 1-D and 3-D inputs; with DFLASH_ATTENTION_KERNEL=torch, PyTorch's own argmax
    monkeypatch.setenv("DFLASH_ATTENTION_KERNEL", kernel)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for V in (1, 7, 8, 9, 17, 1000):
            for case in range(5):
                x = torch.randn(6, V, generator=g).to(dtype)
                if case == 1:
                    x = x.round()
                elif case == 2:
                    x[:, ::3], x[:, 1::3] = -0.0, 0.0
                    x = -x.abs()
                elif case == 3:
                    x[1, V // 2], x[2, -1], x[2, 0], x[3] = float("nan"), float("nan"), float("nan"), float("-inf")
                elif case == 4:
                    x[0], x[1, 0], x[1, -1] = float("-inf"), float("inf"), float("inf")
                assert torch.equal(kernels.argmax(x), x.argmax(-1)), (dtype, V, case)
    x = torch.randn(2, 3, 50, generator=g).bfloat16()
    assert torch.equal(kernels.argmax(x), x.argmax(-1)) and torch.equal(kernels.argmax(x[0, 0]), x[0, 0].argmax(-1))
    assert torch.equal(kernels.argmax(x[..., ::2]), x[..., ::2].argmax(-1))  # a strided view
    assert torch.equal(kernels.argmax(torch.arange(5)), torch.tensor(4))  # integers: PyTorch's


@needs_int4_kernel
@needs_attention_kernel
@pytest.mark.parametrize("packs", [True, False])
def test_a_bf16_draft_proposes_on_q8_0_whether_or_not_the_cpu_packs_bf16(monkeypatch, packs):
    # at a step's few rows the 8-bit weights stream half the bytes of oneDNN's packed bf16 ones: the one-call
    # layers and the proposal head take Q8_0 on either kind of CPU
    from dflash import DFlashDraftModel
    from tiny import tiny_target

    monkeypatch.setattr(kernels, "packable", lambda w: packs)
    draft = DFlashDraftModel.from_target(tiny_target("qwen3", seed=2).bfloat16(), num_layers=1, block_size=4)
    assert isinstance(draft._proposal_head()[0], kernels.Q8Weight)
    with torch.no_grad():
        assert draft._layer_stack() is not None
    draft.float()  # an fp32 draft keeps its Python layers
    with torch.no_grad():
        assert draft._layer_stack() is None


@needs_int4_kernel
def test_the_draft_builds_its_layer_stack_again_whenever_a_weight_changes():
    # the one-call paths multiply by quantised copies: a weight written in place, a parameter or a module put in
    # another's place, and added layers must each give a new stack, and nothing else may
    from dflash import DFlashDraftModel
    from tiny import tiny_target

    draft = DFlashDraftModel.from_target(tiny_target("qwen3", seed=2).bfloat16(), num_layers=1, block_size=4)
    mlp, attn = draft.layers[0].mlp, draft.layers[0].self_attn
    changes = [lambda: mlp.down_proj.weight.mul_(2),
               lambda: setattr(attn.o_proj, "weight", torch.nn.Parameter(attn.o_proj.weight.detach().clone())),
               lambda: setattr(mlp, "up_proj", torch.nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features,
                                                               bias=False, dtype=torch.bfloat16)),
               lambda: draft.grow_layers(2)]
    with torch.no_grad():
        stack = draft._layer_stack()
        assert stack is not None and draft._layer_stack() is stack
        for change in changes:
            change()
            new = draft._layer_stack()
            assert new is not stack and draft._layer_stack() is new
            stack = new
    assert len(stack[1]) == 2 * 16  # the grown draft's two layers, 16 weights each


@needs_int4_kernel
@needs_attention_kernel
def test_a_draft_beside_a_4bit_target_multiplies_at_4_bits_built_before_the_first_step():
    # built when the batch is made, not inside the first timed step: tens of ms there priced drafting several
    # times too dear for the adaptive width (SpecBatch)
    from dflash.batch import SpecBatch
    from dflash.model import DFlashDraftModel
    from tiny import tiny_target

    target = tiny_target("llama", seed=4).bfloat16()
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    for runtime, bits in (("fast-int4", 4), ("fast", 8), ("fast-int4-compile", 4), ("fast-int8", 8)):
        draft._stack = draft._proposal_cache = None
        SpecBatch(target, draft, 4, 32, runtime)
        assert draft.inference_bits == bits, runtime
        assert draft._stack is not None and draft._stack[0][0] == bits and draft._proposal_cache is not None
        with torch.inference_mode():
            assert draft._layer_stack() is draft._stack, runtime  # the step finds it built


def _q8_draft_products(monkeypatch):
    """A bf16 draft's Python layers' products on the Q8_0 kernel, as on a CPU without bf16 packing, also on one
    where oneDNN packs bf16 (their `linear` would take the packed weight there; the one-call paths take Q8_0 on
    both)."""
    monkeypatch.setattr(kernels, "widens", lambda w: w.device.type == "cpu")
    monkeypatch.setattr(kernels, "packable", lambda w: False)


class _Q4Products(kernels.Int4Weight):
    """Int4Weight where the Python layers' products would take Q8Weight: a draft's products at 4 bits."""

    fits = staticmethod(kernels.Int4Weight.fits)

    def __init__(self, w):
        super().__init__(w, ours=True)


@needs_int4_kernel
@needs_attention_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_drafts_layers_in_one_call_compute_what_its_python_layers_do(monkeypatch, bits):
    # a bf16 draft whose products run on the Q8_0 kernel (or its Q4_1 one, beside a 4-bit target) runs its layers
    # at inference in one decoder_layers call and writes its context in one context_kv call
    # (DFlashDraftModel._layer_stack): bit for bit its Python layers with the attention in fp32 (PyTorch's bf16
    # SDPA rounds the softmax weights to bf16; the kernel keeps them in fp32), ragged rows and all
    from dflash.model import DFlashDraftModel, DraftKVCache
    from tiny import tiny_target

    _q8_draft_products(monkeypatch)
    if bits == 4:
        monkeypatch.setattr(kernels, "Q8Weight", _Q4Products)
    target = tiny_target("qwen3", seed=4).to(torch.bfloat16)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4).to(torch.bfloat16)
    draft.inference_bits = bits
    g = torch.Generator().manual_seed(5)
    T, B = 20, 4
    feats = torch.randn(2, T, draft.fc.weight.shape[1], generator=g).bfloat16()
    cache = DraftKVCache(draft.config, 2, 40, "cpu", torch.bfloat16)
    cache.positions[:, :T] = torch.arange(T)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :6] = False  # a shorter row, left-padded
    block = torch.tensor([[7] + [draft.config.mask_token_id] * (B - 1), [9] + [draft.config.mask_token_id] * (B - 1)])
    pos = T + torch.arange(B).expand(2, B)
    stack, sdpa = DFlashDraftModel._layer_stack, F.scaled_dot_product_attention

    def python_layers():
        with monkeypatch.context() as m:
            m.setattr(DFlashDraftModel, "_layer_stack", lambda self: None)
            m.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: sdpa(q.float(), k.float(), v.float(),
                                                                                    **kw).to(q.dtype))
            return draft(block, pos, cache, valid)
    with torch.inference_mode():
        # the context write in one call (context_kv) fills the cache with the Python path's bits, written in two
        # parts at rows whose positions differ
        cache.positions[1, :T] += 3
        python_cache = DraftKVCache(draft.config, 2, 40, "cpu", torch.bfloat16)
        python_cache.positions[:] = cache.positions
        for part in (slice(0, 7), slice(7, T)):
            draft.write_context(feats[:, part], cache, part.start)
            with monkeypatch.context() as m:
                m.setattr(DFlashDraftModel, "_layer_stack", lambda self: None)
                draft.write_context(feats[:, part], python_cache, part.start)
        assert draft._stack is not None and cache.keys[:, :, :, :T].abs().sum() > 0
        assert draft._stack[2].endswith({8: "q8_linear", 4: "int4_linear"}[bits])
        assert torch.equal(cache.keys, python_cache.keys) and torch.equal(cache.values, python_cache.values)
        fused = draft(block, pos, cache, valid)
        assert torch.equal(fused, python_layers())
        cache.keys[:, 1, :, :6], cache.values[:, 1, :, :6] = 100.0, -100.0  # the short row's unseen slots
        assert torch.equal(draft(block, pos, cache, valid), fused)
        draft.layers[1].mlp.down_proj.weight.mul_(-1.5)  # a weight changed in place: the stack is rebuilt
        changed = draft(block, pos, cache, valid)
        assert not torch.equal(changed, fused) and torch.equal(changed, python_layers())
    assert stack is DFlashDraftModel._layer_stack
    draft(block, pos, cache, valid).sum().backward()  # training: the Python layers, with gradients
    assert draft.layers[0].mlp.down_proj.weight.grad is not None


@needs_int4_kernel
@needs_attention_kernel
def test_a_drafts_context_write_in_one_call_adds_its_biases(monkeypatch):
    # a draft with attention biases (a config may ask for them): context_kv adds the k/v biases as the Python
    # path's products do
    import copy

    from dflash.model import DFlashDraftModel, DraftKVCache
    from tiny import tiny_target

    _q8_draft_products(monkeypatch)
    target = tiny_target("qwen3", seed=4).to(torch.bfloat16)
    config = copy.deepcopy(DFlashDraftModel.from_target(target, num_layers=2, block_size=4).config)
    config.attention_bias = True
    torch.manual_seed(0)
    draft = DFlashDraftModel(config)
    draft.bind(target)
    for name, p in draft.named_parameters():
        if name.endswith("bias"):
            p.data.normal_()
    draft.to(torch.bfloat16)
    feats = torch.randn(2, 9, draft.fc.weight.shape[1], generator=torch.Generator().manual_seed(5)).bfloat16()
    caches = [DraftKVCache(draft.config, 2, 16, "cpu", torch.bfloat16) for _ in range(2)]
    for cache in caches:
        cache.positions[:, :9] = torch.arange(9)
    with torch.inference_mode():
        draft.write_context(feats, caches[0], 0)
        assert draft._stack is not None
        monkeypatch.setattr(DFlashDraftModel, "_layer_stack", lambda self: None)
        draft.write_context(feats, caches[1], 0)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


HOLD = """
import sys, time
from pathlib import Path
from dflash.kernels import _build_lock
folder = Path(sys.argv[1])
with _build_lock(folder):
    (folder / "lock").touch()  # PyTorch's lock file, as a build it runs makes
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_kernel_build_killed_midway_does_not_hold_up_the_next(tmp_path):
    # PyTorch's build lock is a file: a build killed midway (Ctrl-C in a first run) leaves it, and every later
    # process waited on it forever. dflash's lock is an flock, let go when its holder dies.
    folder = tmp_path / "kernels"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with open(folder / "dflash-build.lock", "a") as f:  # held: nobody else builds meanwhile
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        child.kill()
        child.wait()
    assert (folder / "lock").exists()  # what the killed build left behind
    with kernels._build_lock(folder):
        assert not (folder / "lock").exists()


@pytest.mark.parametrize("kind", ["Int8Weight", "Int4Weight", pytest.param("Q8Weight", marks=needs_int4_kernel)])
def test_quantising_a_block_of_rows_at_a_time_gives_the_weights_of_one_piece(kind, monkeypatch):
    cls = getattr(kernels, kind)
    w = torch.randn(2064, 64, generator=torch.Generator().manual_seed(5)).bfloat16()  # two blocks of 1024 and a tail
    blocks = vars(cls(w))
    by_rows = kernels.by_rows
    monkeypatch.setattr(kernels, "by_rows", lambda w, group, quantize: by_rows(w, group, quantize, rows=w.shape[0]))
    whole = vars(cls(w))
    tensors = [k for k, v in whole.items() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.equal(blocks[k], whole[k]) for k in tensors)
