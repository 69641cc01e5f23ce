"""Training: the recipe's pieces, end-to-end learning, exact resume, features cache, two processes, bad data."""

import json
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import DFlashDraftModel, spec_generate
from dflash.errors import DFlashConfigError, DFlashError
from dflash.loading import load_draft
from dflash.model import DraftKVCache, layer_masks
from dflash.dataset import read_dataset
from dflash.regenerate import RegenerateConfig, regenerate
from dflash.train import (DFlashTrainStep, FeatureStore, TrainConfig, block_inputs, compute_features,
                          feature_runtime, loss_weights, sample_anchors, target_features, target_topk, train,
                          valid_anchors)
from structured import make_tokenizer, trained_target, write_prompts
from tiny import tiny_target

MASK = 38


@pytest.mark.parametrize("packs", [True, False])
def test_auto_precision_is_bf16_only_where_bf16_products_pay(packs, monkeypatch):
    # a CPU whose oneDNN packs bf16 weights (AVX-512) trains in bf16; an AVX2-only one in fp32, where PyTorch's
    # bf16 products are a slow generic loop. Asked precisions pass through; a GPU is always bf16-capable
    from dflash import kernels
    from dflash.train import precision

    monkeypatch.setattr(kernels, "_cpu_packs", lambda dtype: packs)
    monkeypatch.setattr(kernels, "_ONEDNN", True)
    assert precision("auto", "cpu") == ("bfloat16" if packs else "float32")
    assert precision("auto", "cuda:0") == "bfloat16"
    assert precision("float32", "cuda:0") == "float32" and precision(None, "cpu") is None


def test_loss_weights_decay_from_one():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert torch.allclose(w, torch.exp(-torch.arange(15) / 7.0))
    assert (w[1:] < w[:-1]).all()


def test_labels_align_with_block_slots():
    ids = torch.arange(100, 112)  # T = 12
    lm = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1])
    anchors = torch.tensor([4, 9])
    block_ids, pos, labels = block_inputs(ids, lm, anchors, 4, MASK)
    assert block_ids.tolist() == [104, MASK, MASK, MASK, 109, MASK, MASK, MASK]
    assert pos.tolist() == [4, 5, 6, 7, 9, 10, 11, 12]
    # slot k predicts x_{a+k}; unsupervised (position 10) and past-the-end (12) targets are ignored
    assert labels.tolist() == [[105, 106, 107], [-100, 111, -100]]


def test_mask_token_choice(lang):
    from dflash.model import choose_mask_token_id

    target, tok, _ = lang
    assert target.get_input_embeddings().weight.shape[0] == len(tok) + 1
    assert choose_mask_token_id(target, tok) == len(tok)  # the spare embedding row
    no_spare = tiny_target("llama", vocab=len(tok))
    assert choose_mask_token_id(no_spare, tok) == tok.convert_tokens_to_ids("<mask>")  # a reserved token


def test_frequent_tokens_count_answer_tokens_only():
    from dflash.train import frequent_tokens

    records = [{"input_ids": [9, 9, 9, 1, 2, 2], "loss_mask": [0, 0, 0, 1, 1, 1]},
               {"input_ids": [9, 3, 2, 1], "loss_mask": [0, 1, 1, 1]}]
    assert frequent_tokens(records, 2) == [2, 1]  # 9 is only in prompts; 1 and 3 tie-break by id
    assert frequent_tokens(records, 10) == [2, 1, 3]


def test_anchors_only_where_answer_continues():
    lm = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    assert valid_anchors(lm).tolist() == [2, 3, 6]
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(torch.ones(50, dtype=torch.long), 10, g)
    assert len(a) == 10 and a.tolist() == sorted(set(a.tolist())) and a.max() < 49


def dense_visibility(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """[n*B, T + n*B] bool: block i's queries see context positions < anchor_i and every slot of block i."""
    n = len(anchors)
    q_anchor = anchors.repeat_interleave(block_size)  # [n*B]
    ctx = torch.arange(T)[None, :] < q_anchor[:, None]
    blk_of_q = torch.arange(n).repeat_interleave(block_size)
    return torch.cat([ctx, blk_of_q[:, None] == blk_of_q[None, :]], 1)


def dense_block_hidden(draft, feats, ids, anchors):
    """The packed forward with one dense mask over [context; all blocks]: the reference for the block-sparse one."""
    B = draft.config.block_size
    block_ids, block_pos, _ = block_inputs(ids, torch.ones_like(ids), anchors, B, draft.config.mask_token_id)
    ctx_pos = torch.arange(len(ids))[None]
    masks = layer_masks(draft.config, dense_visibility(anchors, len(ids), B)[None], block_pos[None],
                        torch.cat([ctx_pos, block_pos[None]], 1))
    x = draft.embed_tokens(block_ids[None])
    return draft.run_layers(x, block_pos[None], draft.context_kv(feats[None], ctx_pos), masks).view(len(anchors), B, -1)


def test_dense_reference_mask_which_keys_each_block_query_sees():
    T, B = 10, 3
    anchors = torch.tensor([2, 6])
    vis = dense_visibility(anchors, T, B)
    assert vis.shape == (2 * B, T + 2 * B)
    for q in range(2 * B):
        blk = q // B
        a = anchors[blk].item()
        for k in range(T):  # context strictly before the anchor
            assert vis[q, k].item() == (k < a)
        for kb in range(2 * B):  # its own block, both ways; never the other block
            assert vis[q, T + kb].item() == (kb // B == blk)


@pytest.mark.parametrize("arch,sliding", [("qwen3", False), ("llama", True)])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_sparse_training_attention_equals_the_dense_mask(arch, sliding):
    # every answer position an anchor, blocks overlapping each other and running past the end; with sliding-window
    # layers (window shorter than the context) too. Values and gradients agree
    target = tiny_target(arch, seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 2])
    if sliding:
        draft.config.layer_types = ["sliding_attention", "full_attention"]
        draft.config.sliding_window = 6
        draft.layers[0].self_attn.sliding_window = 6
    ids = torch.randint(3, 96, (23,), generator=torch.Generator().manual_seed(4))
    feats = target_features(target, [0, 2], ids)
    anchors = torch.arange(1, 22)
    step = DFlashTrainStep(draft, 3.0)
    grads = []
    B = draft.config.block_size

    def flex_hidden():  # the GPU's path (flex attention), here in its unfused eager form
        block_ids, block_pos, _ = block_inputs(ids, torch.ones_like(ids), anchors, B, draft.config.mask_token_id)
        ctx_pos = torch.arange(len(ids))
        ctx_kv = [(k[0], v[0]) for k, v in draft.context_kv(feats[None], ctx_pos[None])]
        return draft.run_blocks(draft.embed_tokens(block_ids.view(-1, B)), block_pos.view(-1, B), ctx_kv, anchors,
                                ctx_pos, flex=True)
    for f in (lambda: step.block_hidden(feats, ids, anchors), lambda: dense_block_hidden(draft, feats, ids, anchors)):
        draft.zero_grad()
        h = f()
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        grads.append((h.detach(), [p.grad.clone() for p in draft.parameters()]))
    (sparse, g_sparse), (dense, g_dense) = grads
    assert torch.allclose(sparse, dense, atol=1e-5)
    for a, b in zip(g_sparse, g_dense):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with torch.no_grad():  # PyTorch's flex attention has no backward on the CPU; scripts/gpu_check.sh checks it
        assert torch.allclose(flex_hidden(), dense, atol=1e-5)


def test_packed_training_forward_equals_inference_forward():
    """The packed multi-anchor forward gives each block exactly what the generation-time draft computes."""
    target = tiny_target("qwen3", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 2])
    ids = torch.randint(3, 96, (14,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, [0, 2], ids)
    anchors = torch.tensor([3, 8, 12])
    with torch.no_grad():
        packed = DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors)
        for i, a in enumerate(anchors.tolist()):
            assert torch.allclose(packed[i], inference_block_hidden(draft, feats, ids, a), atol=1e-5), i


def inference_block_hidden(draft, feats, ids, a: int) -> torch.Tensor:
    """The generation-time draft's hidden states [B, H] for the block at anchor a, its context in a fresh cache."""
    B = draft.config.block_size
    cache = DraftKVCache(draft.config, 1, 32, "cpu", torch.float32)
    cache.positions[0, :a] = torch.arange(a)
    draft.write_context(feats[None, :a], cache, 0)
    block = torch.tensor([[ids[a].item()] + [draft.config.mask_token_id] * (B - 1)])
    return draft(block, torch.arange(a, a + B)[None], cache, torch.ones(1, a, dtype=torch.bool))[0]


def test_draft_vocabulary_loss():
    """With a draft vocabulary the loss is cross-entropy over its rows; labels outside it add no loss but
    still count as misses; the whole vocabulary as draft vocabulary changes nothing."""
    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    ids = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, [0, 2], ids)
    loss_mask, anchors = torch.ones(20, dtype=torch.long), torch.tensor([2, 7, 11])
    step = DFlashTrainStep(draft, 3.0)
    with torch.no_grad():
        full, (correct, counted) = step(feats, ids, loss_mask, anchors)
        draft.set_draft_vocab(torch.arange(96).flip(0))
        same, (correct2, counted2) = step(feats, ids, loss_mask, anchors)
        assert torch.allclose(full, same, atol=1e-5) and torch.equal(correct, correct2)
        subset = torch.arange(3, 60)
        draft.set_draft_vocab(subset)
        part, (_, counted3) = step(feats, ids, loss_mask, anchors)
        assert torch.equal(counted3, counted)  # every label still counted
        _, _, labels = block_inputs(ids, loss_mask, anchors, 4, draft.config.mask_token_id)
        hidden = step.block_hidden(feats, ids, anchors)[:, 1:]
        inside = (labels >= 3) & (labels < 60)
        logits = draft.lm_head(hidden[inside])[:, 3:60]
        ce = torch.nn.functional.cross_entropy(logits, labels[inside] - 3, reduction="none")
        w = step.weights.expand_as(labels)[inside]
        assert torch.allclose(part, (ce * w).sum() / w.sum(), atol=1e-5)


def test_distillation_learns_each_slot_from_the_targets_distribution_at_the_position_before_it():
    """Slot k of anchor a learns from the target's distribution at a+k-1, renormalised over the draft vocabulary:
    a target sure of each next token gives exactly the label loss, and a real one the mix written out by hand."""
    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    draft.set_draft_vocab(torch.arange(3, 60))
    ids = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(1))
    feats, logits = target_features(target, [0, 2], ids, with_logits=True)
    assert torch.equal(feats, target_features(target, [0, 2], ids)) and logits.shape == (20, 96)
    loss_mask, anchors = torch.ones(20, dtype=torch.long), torch.tensor([2, 7, 11, 17])
    with torch.no_grad():
        plain, (correct, _) = DFlashTrainStep(draft, 3.0)(feats, ids, loss_mask, anchors)
        sure = torch.full((20, 96), -1e4)
        sure[torch.arange(19), ids[1:]] = 1e4  # position t is sure of token t+1
        mixed, (correct2, _) = DFlashTrainStep(draft, 3.0, distill=1.0)(feats, ids, loss_mask, anchors, sure)
        assert torch.allclose(plain, mixed, atol=1e-5) and torch.equal(correct, correct2)
        step = DFlashTrainStep(draft, 3.0, distill=0.3)
        got, _ = step(feats, ids, loss_mask, anchors, logits)
        hidden = step.block_hidden(feats, ids, anchors)[:, 1:]  # [n, B-1, H]
        num = den = 0.0
        for i, a in enumerate(anchors.tolist()):
            for k in range(1, 4):
                if a + k >= 20 or not 3 <= ids[a + k] < 60:
                    continue  # past the end, or a label the draft vocabulary cannot propose
                logq = torch.log_softmax(draft.lm_head(hidden[i, k - 1])[3:60], -1)
                p = torch.softmax(logits[a + k - 1, 3:60], -1)
                w = math.exp(-(k - 1) / 3.0)
                num += w * (0.7 * -logq[ids[a + k] - 3] + 0.3 * -(p * logq).sum())
                den += w
        assert torch.allclose(got, num / den, atol=1e-5)
        # the target's top tokens (--distill-topk): all of them is the whole distribution; a few, the
        # distribution over those alone, renormalised within the draft vocabulary
        assert torch.allclose(step(feats, ids, loss_mask, anchors, target_topk(logits, 96))[0], got, atol=1e-5)
        top, logp = target_topk(logits, 4)
        kept = torch.full_like(logits, -float("inf")).scatter(1, top, logp)
        assert torch.allclose(step(feats, ids, loss_mask, anchors, (top, logp))[0],
                              step(feats, ids, loss_mask, anchors, kept.clamp(min=-1e30))[0], atol=1e-5)


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_a_large_head_loss_goes_in_chunks_with_the_same_value_and_gradient(monkeypatch, distill):
    # the logits of many rows over a large vocabulary are made a chunk at a time, again in backward
    from dflash import model as model_mod

    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1))
    feats, logits = target_features(target, [0, 2], ids, with_logits=True)
    step = DFlashTrainStep(draft, 3.0, distill)
    results = []
    for at_once in (model_mod.LOGITS_AT_ONCE, 96 * 7):  # all rows at once; 7 rows a chunk
        monkeypatch.setattr(model_mod, "LOGITS_AT_ONCE", at_once)
        draft.zero_grad()
        loss, (correct, counted) = step(feats, ids, torch.ones(40, dtype=torch.long), torch.arange(2, 38, 3),
                                        logits)
        loss.backward()
        results.append((loss.detach(), correct, [p.grad.clone() for p in draft.parameters()]))
    (a, ca, ga), (b, cb, gb) = results
    assert torch.allclose(a, b, atol=1e-6) and torch.equal(ca, cb)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))


@pytest.fixture(scope="module")
def lang(tmp_path_factory):
    """The structured tiny target, its tokenizer, and a regenerated dataset of its own answers."""
    root = tmp_path_factory.mktemp("lang")
    target, tok = trained_target(), make_tokenizer()
    prompts = write_prompts(root / "prompts.jsonl", 48)
    regenerate(RegenerateConfig(sources=[str(prompts)], output=str(root / "data"), model="structured",
                                max_new_tokens=40, batch_size=16), target=target, tokenizer=tok, progress=False)
    return target, tok, root


def cfg_for(root, out, **kw):
    base = dict(target="structured", data=[str(root / "data")], output=str(out), block_size=8, num_anchors=32,
                epochs=15, lr=3e-3, eval_samples=4, eval_interval=10_000, save_interval=10_000, log_interval=50,
                dtype="float32", mask_token_id=MASK)
    base.update(kw)
    return TrainConfig(**base)


def test_regenerated_dataset_is_the_targets_own_greedy_text(lang):
    target, tok, root = lang
    records = read_dataset([root / "data"])
    assert len(records) == 48
    for r in records:  # each answer is the one the target gives its prompt alone (rows join as others finish)
        n = r["num_prompt_tokens"]
        assert r["loss_mask"] == [0] * n + [1] * (len(r["input_ids"]) - n)
        ref = target.generate(torch.tensor([r["input_ids"][:n]]), max_new_tokens=40, do_sample=False)
        assert r["input_ids"] == ref[0].tolist()[:len(r["input_ids"])]
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]


def test_regenerate_with_a_draft_writes_the_same_greedy_data(lang, tmp_path):
    target, tok, root = lang
    draft = DFlashDraftModel.from_target(target, block_size=4, mask_token_id=MASK)
    cfg = dict(sources=[str(root / "prompts.jsonl")], model="structured", max_new_tokens=40, batch_size=16)
    regenerate(RegenerateConfig(output=str(tmp_path / "spec"), draft="given", **cfg), target=target, tokenizer=tok,
               draft=draft, progress=False)
    for shard in sorted((root / "data").glob("shard-*")):
        assert (tmp_path / "spec" / shard.name).read_text() == shard.read_text()


def answer_tau(target, root, n: int):
    """τ(draft) over the prompts of the first n regenerated records (32 new tokens each)."""
    records = read_dataset([root / "data"])
    prompts = [torch.tensor([r["input_ids"][:r["num_prompt_tokens"]]]) for r in records[:n]]

    def tau(draft):
        acc = []
        for p in prompts:
            acc += spec_generate(target, draft, p, max_new_tokens=32, return_stats=True).acceptance_lengths
        return sum(acc) / len(acc)
    return tau


def test_end_to_end_draft_learns(lang, tmp_path):
    target, tok, root = lang
    tau = answer_tau(target, root, 12)

    fresh = DFlashDraftModel.from_target(target, block_size=8, mask_token_id=MASK)
    assert tau(fresh) < 1.5
    result = train(cfg_for(root, tmp_path / "run"), target=target, tokenizer=tok, progress=False)
    draft = DFlashDraftModel.from_pretrained(tmp_path / "run" / "final", target=target)
    assert draft.config.mask_token_id == MASK and draft.config.block_size == 8
    trained = tau(draft)
    assert trained >= 3.0, trained
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert losses[-1] < 0.5 * losses[0]
    assert any("eval_tau" in e for e in log) and result["tau"] is not None
    assert (tmp_path / "run" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_draft_vocabulary_is_trained_saved_and_resumed(lang, tmp_path):
    target, tok, root = lang
    cfg = cfg_for(root, tmp_path / "run", draft_vocab_size=20, epochs=1, max_steps=6, save_interval=3)
    train(cfg, target=target, tokenizer=tok, progress=False)
    draft = DFlashDraftModel.from_pretrained(tmp_path / "run" / "final", target=target)
    assert draft.draft_vocab is not None and len(draft.draft_vocab) == 20
    assert set(spec_generate(target, draft, torch.tensor([[3, 5, 7]]), max_new_tokens=8)[0, 3:].tolist())
    cfg.max_steps, cfg.resume = 8, True
    train(cfg, target=target, tokenizer=tok, progress=False)  # picks up the checkpoint at step 6


def test_a_fresh_draft_takes_its_own_number_of_key_value_heads(lang, tmp_path):
    """--num-kv-heads widens what a draft layer reads from each context position; the draft saves, loads and
    decodes losslessly with more key/value heads than its target has."""
    target, tok, root = lang
    assert target.config.num_key_value_heads == 2
    train(cfg_for(root, tmp_path / "run", num_kv_heads=4, epochs=1, max_steps=3), target=target, tokenizer=tok,
          progress=False)
    draft = DFlashDraftModel.from_pretrained(tmp_path / "run" / "final", target=target)
    assert draft.config.num_key_value_heads == 4
    assert draft.layers[0].self_attn.k_proj.weight.shape[0] == 4 * draft.config.head_dim
    prompt = torch.tensor([[3, 5, 7, 9]])
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(spec_generate(target, draft, prompt, max_new_tokens=12, stop_token_ids=[]), ref)
    with pytest.raises(DFlashError, match="must be a multiple of num_key_value_heads \\(3\\)"):
        train(cfg_for(root, tmp_path / "bad", num_kv_heads=3), target=target, tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="cannot widen 4 key/value heads to 2"):
        train(cfg_for(root, tmp_path / "bad", num_kv_heads=2, init_draft=str(tmp_path / "run" / "final")),
              target=target, tokenizer=tok, progress=False)


def test_a_trained_draft_widens_its_key_value_heads_without_changing_a_proposal():
    """widen_kv_heads copies each grouped head for its query heads: the packed training forward and the
    generation-time forward (a cache with the new head count) give the hidden states of the draft before."""
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4)
    for p in draft.parameters():  # no parameter may stay at an init that hides a head copied out of order
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    ids = torch.randint(3, 96, (14,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, draft.config.target_layer_ids, ids)
    anchors = torch.tensor([3, 8, 12])
    with torch.no_grad():
        ref = DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors)
        draft.widen_kv_heads(4)
        assert draft.config.num_key_value_heads == 4
        assert draft.layers[1].self_attn.v_proj.out_features == 4 * draft.config.head_dim
        torch.testing.assert_close(DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors), ref,
                                   rtol=0, atol=1e-5)
        for i, a in enumerate(anchors.tolist()):
            torch.testing.assert_close(inference_block_hidden(draft, feats, ids, a), ref[i], rtol=0, atol=1e-5)
    with pytest.raises(DFlashConfigError, match="cannot widen 4 key/value heads to 3"):
        draft.widen_kv_heads(3)


def test_a_trained_draft_widens_its_mlps_without_changing_a_proposal(lang, tmp_path):
    """widen_mlp adds hidden units whose down projection starts at zero: the packed training forward and the
    generation-time forward give the hidden states of the draft before, and the new units learn."""
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4)
    ids = torch.randint(3, 96, (14,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, draft.config.target_layer_ids, ids)
    anchors = torch.tensor([3, 8, 12])
    with torch.no_grad():
        ref = DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors)
    assert draft.widen_mlp(192) == 64 and draft.config.intermediate_size == 192
    assert draft.layers[1].mlp.down_proj.in_features == 192 == draft.layers[0].mlp.gate_proj.out_features
    after = DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors)
    assert torch.equal(after, ref)
    with torch.no_grad():
        for i, a in enumerate(anchors.tolist()):
            torch.testing.assert_close(inference_block_hidden(draft, feats, ids, a), ref[i], rtol=0, atol=1e-5)
    after.square().sum().backward()
    assert draft.layers[0].mlp.down_proj.weight.grad[:, 128:].abs().sum() > 0
    with pytest.raises(DFlashConfigError, match="cannot widen the draft's MLP from 192 to 128 units"):
        draft.widen_mlp(128)

    # through `dflash train`: a fresh draft of its own width, and --init-draft widened, saved and loaded so
    root_target, tok, root = lang
    train(cfg_for(root, tmp_path / "one", max_steps=3, intermediate_size=96), target=root_target, tokenizer=tok,
          progress=False)
    one = DFlashDraftModel.from_pretrained(tmp_path / "one" / "final", target=root_target)
    assert one.config.intermediate_size == 96 == one.layers[0].mlp.up_proj.out_features
    train(cfg_for(root, tmp_path / "two", max_steps=3, init_draft=str(tmp_path / "one" / "final"),
                  intermediate_size=160), target=root_target, tokenizer=tok, progress=False)
    wide = DFlashDraftModel.from_pretrained(tmp_path / "two" / "final", target=root_target)
    assert wide.config.intermediate_size == 160 and wide.layers[0].mlp.down_proj.weight[:, 96:].abs().sum() > 0
    with pytest.raises(DFlashError, match="cannot widen the draft's MLP from 160 to 96"):
        train(cfg_for(root, tmp_path / "bad", max_steps=3, init_draft=str(tmp_path / "two" / "final"),
                      intermediate_size=96), target=root_target, tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="--intermediate-size 0"):
        train(cfg_for(root, tmp_path / "bad", intermediate_size=0), target=root_target, tokenizer=tok, progress=False)


def test_resume_is_exact_and_keeps_fp32_master_weights(lang, tmp_path):
    # exported drafts in bf16: the checkpoints still hold the fp32 weights, so a resumed run continues the very
    # same training (rounded weights would not)
    target, tok, root = lang
    kw = dict(epochs=2, save_interval=20, save_dtype="bfloat16")
    train(cfg_for(root, tmp_path / "straight", max_steps=40, **kw), target=target, tokenizer=tok, progress=False)
    # 20 steps, "killed", then resumed for 20 more
    train(cfg_for(root, tmp_path / "split", max_steps=20, **kw), target=target, tokenizer=tok, progress=False)
    ckpt = tmp_path / "split" / "checkpoint-0000020"
    assert (ckpt / "trainer_state.pt").is_file()
    assert all(v.dtype == torch.float32 for v in DFlashDraftModel.from_pretrained(ckpt).state_dict().values()
               if v.is_floating_point())
    train(cfg_for(root, tmp_path / "split", max_steps=40, resume=True, **kw), target=target, tokenizer=tok,
          progress=False)
    a = DFlashDraftModel.from_pretrained(tmp_path / "straight" / "final")
    b = DFlashDraftModel.from_pretrained(tmp_path / "split" / "final")
    assert a.fc.weight.dtype == torch.bfloat16
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    masters = [DFlashDraftModel.from_pretrained(tmp_path / run / "checkpoint-0000040") for run in ("straight", "split")]
    for k, v in masters[0].state_dict().items():
        assert torch.equal(v, masters[1].state_dict()[k]), k


def test_changing_the_schedule_on_resume_is_an_error(lang, tmp_path):
    target, tok, root = lang
    train(cfg_for(root, tmp_path / "run", epochs=2, max_steps=4, save_interval=4), target=target, tokenizer=tok,
          progress=False)
    for change in (dict(epochs=3), dict(lr=1e-3), dict(warmup=0.2)):
        with pytest.raises(DFlashError, match="keeps its schedule.*--init-draft"):
            train(cfg_for(root, tmp_path / "run", max_steps=8, resume=True, **{"epochs": 2, **change}),
                  target=target, tokenizer=tok, progress=False)
    # a cut (--max-steps) is not part of the schedule; the schedule is recorded in the checkpoint
    train(cfg_for(root, tmp_path / "run", epochs=2, max_steps=6, resume=True), target=target, tokenizer=tok,
          progress=False)
    state = torch.load(tmp_path / "run" / "checkpoint-0000006" / "trainer_state.pt", weights_only=False)
    assert state["schedule"]["kind"] == "cosine" and state["schedule"]["peak_lr"] == 3e-3


def test_cached_features_give_the_same_training(lang, tmp_path):
    target, tok, root = lang
    records = read_dataset([root / "data"])
    ids = DFlashDraftModel.from_target(target, mask_token_id=MASK).config.target_layer_ids
    compute_features(target, records, ids, tmp_path / "feats", max_length=3072, dtype="float32", chunk=10,
                     progress=False)
    kw = dict(epochs=1, max_steps=15)

    def live_and_cached(name, feats, **extra):  # the draft trained live and from the cache: the same weights
        train(cfg_for(root, tmp_path / name, **kw, **extra), target=target, tokenizer=tok, progress=False)
        train(cfg_for(root, tmp_path / f"{name}-cached", features=str(tmp_path / feats), **kw, **extra),
              target=target, tokenizer=tok, progress=False)
        live = DFlashDraftModel.from_pretrained(tmp_path / name / "final")
        cached = DFlashDraftModel.from_pretrained(tmp_path / f"{name}-cached" / "final")
        for k, v in live.state_dict().items():
            assert torch.allclose(v, cached.state_dict()[k], atol=1e-6), k
        return live
    a = live_and_cached("live", "feats")
    with pytest.raises(DFlashError, match="cached features \\(--features\\) do not hold"):
        train(cfg_for(root, tmp_path / "x", features=str(tmp_path / "feats"), distill=0.5, **kw), target=target,
              tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="hold the target's top 0 tokens, not the top 3"):
        train(cfg_for(root, tmp_path / "x", features=str(tmp_path / "feats"), distill=0.5, distill_topk=3, **kw),
              target=target, tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="tap layers"):
        train(cfg_for(root, tmp_path / "x", features=str(tmp_path / "feats"), target_layer_ids=[0], **kw),
              target=target, tokenizer=tok, progress=False)
    # distillation from the target's top tokens: cached beside the features, the same training as live
    compute_features(target, records, ids, tmp_path / "feats-top", max_length=3072, dtype="float32", chunk=10,
                     progress=False, distill_topk=3)
    c = live_and_cached("live-top", "feats-top", distill=0.5, distill_topk=3)
    assert not torch.allclose(c.fc.weight, a.fc.weight, atol=1e-4)  # the distilled run learnt otherwise


def test_features_from_a_lean_runtime_equal_the_models_own_and_a_folder_keeps_its_runtime(lang, tmp_path):
    target, tok, root = lang
    records = read_dataset([root / "data"])[:12]
    ids = DFlashDraftModel.from_target(target, mask_token_id=MASK).config.target_layer_ids
    kw = dict(max_length=3072, dtype="float32", chunk=5, progress=False, distill_topk=4)
    compute_features(target, records, ids, tmp_path / "hf", **kw)
    made = compute_features(target, records, ids, tmp_path / "fast", runtime="auto", **kw)
    assert made["runtime"] == "fast" and feature_runtime(tmp_path / "fast") == "fast"
    hf, fast = FeatureStore(tmp_path / "hf"), FeatureStore(tmp_path / "fast")
    for i in range(len(records)):
        a, b = hf.get(i), fast.get(i)
        assert a.shape == b.shape == (min(len(records[i]["input_ids"]), 3072), len(ids) * target.config.hidden_size)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), i

    def tensors(folder):
        from safetensors.torch import load_file

        return {k: v for f in sorted(folder.glob("features-*")) for k, v in load_file(f).items()}
    ta, tb = tensors(tmp_path / "hf"), tensors(tmp_path / "fast")
    assert ta.keys() == tb.keys() and any(k.endswith(".ids") for k in ta)
    for k in ta:
        if k.endswith(".logp"):
            assert torch.allclose(ta[k], tb[k], atol=1e-4), k
    # resuming keeps the folder's runtime: another one is an error that names both
    with pytest.raises(DFlashError, match="runtime 'fast' \\(asked: 'hf'\\)"):
        compute_features(target, records, ids, tmp_path / "fast", runtime="hf", **kw)
    # a folder from before manifests named the runtime was made by the model's own forward, and resumes with it
    m = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    del m["runtime"]
    (tmp_path / "hf" / "manifest.json").write_text(json.dumps(m))
    (tmp_path / "hf" / "features-0000010.safetensors").unlink()
    assert feature_runtime(tmp_path / "hf") == "hf" and feature_runtime(tmp_path / "none") is None
    compute_features(target, records, ids, tmp_path / "hf", runtime="hf", **kw)
    assert torch.equal(FeatureStore(tmp_path / "hf").get(11), hf.get(11))


def test_a_feature_folder_per_dataset_folder_trains_as_one_folder_for_all(lang, tmp_path):
    target, tok, root = lang
    records = read_dataset([root / "data"])
    parts, data = [records[:20], records[20:]], []
    for i, part in enumerate(parts):  # the same records as two dataset folders
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        data.append(str(tmp_path / f"d{i}"))
    ids = DFlashDraftModel.from_target(target, mask_token_id=MASK).config.target_layer_ids
    feats = dict(max_length=3072, chunk=8, progress=False)
    compute_features(target, records, ids, tmp_path / "all", dtype="float32", **feats)
    compute_features(target, records, ids, tmp_path / "all-bf16", dtype="bfloat16", **feats)
    for i, part in enumerate(parts):
        compute_features(target, part, ids, tmp_path / f"f{i}", dtype="float32", **feats)
    kw = dict(data=data, epochs=1, max_steps=8)
    drafts = {}
    for name, folders in (("one", ["all"]), ("each", ["f0", "f1"]), ("bf16", ["all-bf16"])):
        train(cfg_for(root, tmp_path / name, features=[str(tmp_path / f) for f in folders], **kw), target=target,
              tokenizer=tok, progress=False)
        drafts[name] = DFlashDraftModel.from_pretrained(tmp_path / name / "final").state_dict()
    for k, v in drafts["one"].items():
        assert torch.equal(v, drafts["each"][k]), k  # the same features, found through either layout
        # stored in bf16, read back as the fp32 target's: a rounding of the inputs, not another training
        assert (v - drafts["bf16"][k]).norm() <= 0.03 * v.norm(), k
    assert any(not torch.equal(v, drafts["bf16"][k]) for k, v in drafts["one"].items())
    assert sum(f.stat().st_size for f in (tmp_path / "all-bf16").glob("features-*")) < 0.6 * sum(
        f.stat().st_size for f in (tmp_path / "all").glob("features-*"))
    with pytest.raises(DFlashError, match="3 folders for 2 --data folders"):
        train(cfg_for(root, tmp_path / "x", features=[str(tmp_path / f) for f in ("f0", "f1", "all")], **kw),
              target=target, tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="f1 were computed for another dataset"):  # folders in the wrong order
        train(cfg_for(root, tmp_path / "x", features=[str(tmp_path / f) for f in ("f1", "f0")], **kw),
              target=target, tokenizer=tok, progress=False)


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_a_compiled_training_step_trains_as_the_eager_one(lang, tmp_path, method):
    target, tok, root = lang
    kw = dict(epochs=1, max_steps=4, log_interval=1, method=method)
    for name, compiled in (("eager", False), ("compiled", True)):  # sequences of several lengths (dynamic shapes)
        train(cfg_for(root, tmp_path / name, compile=compiled, **kw), target=target, tokenizer=tok, progress=False)
    eager, compiled = (load_draft(tmp_path / n / "final", target, dtype=torch.float32) for n in ("eager", "compiled"))
    for k, v in eager.state_dict().items():  # fused elementwise work rounds otherwise: close, not equal
        assert torch.allclose(v, compiled.state_dict()[k], atol=2e-4, rtol=1e-3), k
    logs = [[json.loads(line)["loss"] for line in (tmp_path / n / "log.jsonl").read_text().splitlines()
             if '"loss"' in line] for n in ("eager", "compiled")]
    assert len(logs[0]) == 4 and logs[0] == pytest.approx(logs[1], rel=1e-3)


DIST_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from structured import trained_target, make_tokenizer
from dflash.train import TrainConfig, train
torch.set_num_threads(1)
target, tok = trained_target(), make_tokenizer()
train(TrainConfig(target="structured", data=[{data!r}], output={out!r}, block_size=8, num_anchors=32, epochs=1,
                  max_steps=6, lr=3e-3, eval_samples=4, eval_interval=10_000, save_interval=10_000, log_interval=2,
                  dtype="float32", mask_token_id=38, batch_size={bs}), target=target, tokenizer=tok, progress=False)
import torch.distributed as dist
assert not dist.is_initialized()  # the group train() made is gone before the interpreter's exit tears it down
"""


def test_two_processes_match_one_with_the_same_global_batch(lang, tmp_path):
    """torchrun with 2 CPU processes (gloo) and batch 2 each == 1 process with batch 4."""
    _, _, root = lang
    tests = str(Path(__file__).parent)
    for name, nproc, bs in (("ddp", 2, 2), ("single", 1, 4)):
        script = tmp_path / f"{name}.py"
        script.write_text(DIST_SCRIPT.format(tests=tests, data=str(root / "data"), out=str(tmp_path / name), bs=bs))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(29500 + nproc), str(script)] if nproc > 1 else [sys.executable, str(script)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr[-3000:]
    a = DFlashDraftModel.from_pretrained(tmp_path / "ddp" / "final")
    b = DFlashDraftModel.from_pretrained(tmp_path / "single" / "final")
    for k, v in a.state_dict().items():
        assert torch.allclose(v, b.state_dict()[k], atol=1e-5), k
    cfg = json.loads((tmp_path / "ddp" / "train_config.json").read_text())
    assert cfg["world_size"] == 2


def test_training_buffers_live_with_the_draft_and_each_process_takes_its_gpu(monkeypatch):
    # DistributedDataParallel broadcasts buffers; NCCL fails on a CPU tensor beside a CUDA draft
    from dflash import train as train_mod

    draft = DFlashDraftModel.from_target(tiny_target("llama", seed=1), block_size=4).to("meta")
    assert {b.device.type for b in DFlashTrainStep(draft, 3.0).buffers()} == {"meta"}
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train_mod._dist() == (0, 1) and chosen == [3]


def test_regenerate_resumes_without_duplicates_or_losses(lang, tmp_path, monkeypatch):
    target, tok, root = lang
    prompts = str(root / "prompts.jsonl")
    cfg = dict(sources=[prompts], model="structured", max_new_tokens=12, batch_size=8, temperature=1.0, seed=3)
    regenerate(RegenerateConfig(output=str(tmp_path / "whole"), **cfg), target=target, tokenizer=tok, progress=False)
    # kill the run after its second shard
    from dflash import regenerate as reg_mod

    real = reg_mod.atomic_write_text
    count = {"n": 0}

    def dying_write(path, text):
        real(path, text)
        if Path(path).name.startswith("shard-"):
            count["n"] += 1
            if count["n"] == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(reg_mod, "atomic_write_text", dying_write)
    with pytest.raises(KeyboardInterrupt):
        regenerate(RegenerateConfig(output=str(tmp_path / "split"), **cfg), target=target, tokenizer=tok,
                   progress=False)
    monkeypatch.setattr(reg_mod, "atomic_write_text", real)
    assert len(list((tmp_path / "split").glob("shard-*"))) == 2
    summary = regenerate(RegenerateConfig(output=str(tmp_path / "split"), **cfg), target=target, tokenizer=tok,
                         progress=False)
    assert summary["written_now"] == 48 - 16
    whole = sorted(p.name for p in (tmp_path / "whole").glob("shard-*"))
    assert whole == sorted(p.name for p in (tmp_path / "split").glob("shard-*"))
    for name in whole:  # sampled data too: seeds depend on the shard, not on the run
        assert (tmp_path / "whole" / name).read_text() == (tmp_path / "split" / name).read_text()
    with pytest.raises(DFlashError, match="other settings"):
        regenerate(RegenerateConfig(output=str(tmp_path / "split"), **{**cfg, "max_new_tokens": 13}),
                   target=target, tokenizer=tok, progress=False)
    # runs/ gone (another machine), two chunks kept by `dflash pack`: only the other four are answered, as before
    from dflash.dataset import pack

    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / "split", kept)
    for f in sorted(kept.glob("shard-*"))[2:]:
        f.unlink()
    pack(kept, tmp_path / "packed")
    summary = regenerate(RegenerateConfig(output=str(tmp_path / "fresh"), packed=str(tmp_path / "packed"), **cfg),
                         target=target, tokenizer=tok, progress=False)
    assert summary["written_now"] == 48 - 16
    fresh = sorted(p.name for p in (tmp_path / "fresh").glob("shard-*"))
    assert fresh == whole[2:] and all((tmp_path / "fresh" / n).read_text() == (tmp_path / "whole" / n).read_text()
                                      for n in fresh)
    with pytest.raises(DFlashError, match="other settings"):
        regenerate(RegenerateConfig(output=str(tmp_path / "other"), packed=str(tmp_path / "packed"),
                                    **{**cfg, "seed": 4}), target=target, tokenizer=tok, progress=False)
    # the same prompt file read from another place (another machine's checkout, a relative path): the same run;
    # a file of another name is not
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(prompts, tmp_path / "elsewhere" / "prompts.jsonl")
    shutil.copy(prompts, tmp_path / "elsewhere" / "other.jsonl")
    moved = regenerate(RegenerateConfig(output=str(tmp_path / "moved"), packed=str(tmp_path / "packed"),
                                        **{**cfg, "sources": [str(tmp_path / "elsewhere" / "prompts.jsonl")]}),
                       target=target, tokenizer=tok, progress=False)
    assert moved["written_now"] == 48 - 16

    def ids(folder, name):
        return [json.loads(line)["input_ids"] for line in (tmp_path / folder / name).read_text().splitlines()]

    assert all(ids("moved", n) == ids("whole", n) for n in fresh)  # the same answers (records name their file)
    with pytest.raises(DFlashError, match="other settings"):
        regenerate(RegenerateConfig(output=str(tmp_path / "renamed"), packed=str(tmp_path / "packed"),
                                    **{**cfg, "sources": [str(tmp_path / "elsewhere" / "other.jsonl")]}),
                   target=target, tokenizer=tok, progress=False)


def test_the_target_writes_prompts_that_a_second_run_answers(lang, tmp_path):
    # a chat template whose user turn starts after "t1", and a second end-of-turn token (t0) that the
    # progressions reach, so sampled user turns end
    import copy

    _, tok, root = lang
    target = copy.deepcopy(lang[0])
    target.generation_config.eos_token_id = [37, 0]
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}t1 {{ m['content'] }} t0 {% endfor %}"
                         "{% if add_generation_prompt %}t2 {% endif %}")
    cfg = dict(model="structured", max_new_tokens=30, batch_size=8, temperature=1.0, seed=5)
    regenerate(RegenerateConfig(sources=["self:16"], output=str(tmp_path / "prompts"), **cfg), target=target,
               tokenizer=tok, progress=False)
    written = [json.loads(line) for f in sorted((tmp_path / "prompts").glob("shard-*")) for line in f.read_text().splitlines()
               if line.strip()]
    assert written and all(r["kind"] == "self-prompt" and r["finish_reason"] == "stop" for r in written)
    assert all(r["input_ids"][:1] == [1] and r["messages"][0]["content"].startswith("t") for r in written)
    assert {r["source"] for r in written} <= {f"self:{k}" for k in range(16)}
    assert read_dataset([tmp_path / "prompts"]) == []  # prompts to answer, not training data
    # prompts that begin with an opening: its tokens follow the template's, and the prompt's text starts with it
    regenerate(RegenerateConfig(sources=["self:8:t5 t6"], output=str(tmp_path / "opened"), **cfg), target=target,
               tokenizer=tok, progress=False)
    opened = [json.loads(line) for f in sorted((tmp_path / "opened").glob("shard-*"))
              for line in f.read_text().splitlines() if line.strip()]
    assert opened and all(r["input_ids"][:3] == [1, 5, 6] and r["messages"][0]["content"].startswith("t5 t6 ")
                          for r in opened)
    regenerate(RegenerateConfig(sources=[str(tmp_path / "prompts")], output=str(tmp_path / "answers"),
                                **{**cfg, "temperature": 0.0}), target=target, tokenizer=tok, progress=False)
    answers = read_dataset([tmp_path / "answers"])
    assert len(answers) == len(written)
    by_source = {r["source"]: r["messages"][0]["content"] for r in written}
    assert all(a["messages"][0]["content"] == by_source[a["source"]] for a in answers)
    from dflash.dataset import pack

    pack(tmp_path / "answers", tmp_path / "packed")  # the target's own prompts are kept as ids
    assert [r["input_ids"] for r in read_dataset([tmp_path / "packed"], tok)] == [a["input_ids"] for a in answers]
    with pytest.raises(DFlashError, match="--temperature > 0"):
        regenerate(RegenerateConfig(sources=["self:4"], output=str(tmp_path / "greedy"), **{**cfg, "temperature": 0.0}),
                   target=target, tokenizer=tok, progress=False)


def test_packed_answers_read_back_as_the_regenerated_records(lang, tmp_path):
    from dflash.dataset import pack

    target, tok, root = lang
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    # a record whose text holds a raw line separator (U+2028), as answers written with ensure_ascii=False do
    shard = sorted(data.glob("shard-*.jsonl"))[0]
    lines = shard.read_text(encoding="utf-8").split("\n")
    lines[0] = json.dumps({**json.loads(lines[0]), "note": "a\u2028b\x85c"}, ensure_ascii=False)
    shard.write_text("\n".join(lines), encoding="utf-8")
    made = pack(data, tmp_path / "packed")
    assert made["new_shards"] == 3 and made["new_records"] == 48
    assert pack(data, tmp_path / "packed")["new_shards"] == 0  # packed shards are never rewritten
    original, packed = read_dataset([data]), read_dataset([tmp_path / "packed"], tok)
    assert [(r["input_ids"], r["loss_mask"], r["source"]) for r in original] == \
        [(r["input_ids"], r["loss_mask"], r["source"]) for r in packed]
    sizes = sum(f.stat().st_size for f in (tmp_path / "packed").glob("packed-*"))
    assert sizes < sum(f.stat().st_size for f in data.glob("shard-*")) / 3
    with pytest.raises(DFlashError, match="needs the target's tokenizer"):
        read_dataset([tmp_path / "packed"])
    # a prompt that changed since: caught, not trained on
    prompts = root / "prompts.jsonl"
    saved = prompts.read_text()
    try:
        prompts.write_text(saved.replace('"t', '"t1 t', 1))
        with pytest.raises(DFlashError, match="1 packed records do not match their prompts"):
            read_dataset([tmp_path / "packed"], tok)
    finally:
        prompts.write_text(saved)


def test_bad_prompt_lines_are_reported_and_skipped(lang, tmp_path, capsys):
    target, tok, _ = lang
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"prompt": "t1 t2 t3"}\n{not json\n{"prompt": "   "}\n\n{"messages": [{"role": "user", '
                 '"content": "t4 t6"}]}\n{"turns": ["t5 t5"]}\n[1, 2]\n')
    summary = regenerate(RegenerateConfig(sources=[str(f)], output=str(tmp_path / "out"), model="structured",
                                          max_new_tokens=4, batch_size=8), target=target, tokenizer=tok,
                         progress=False)
    err = capsys.readouterr().err
    assert f"{f}:2: invalid JSON" in err and f"{f}:3: no prompt" in err and f"{f}:7: no prompt" in err
    assert summary["samples"] == 3 and summary["bad_lines"] == 3
    with pytest.raises(DFlashError, match="does not exist"):
        regenerate(RegenerateConfig(sources=[str(tmp_path / "nope.jsonl")], output=str(tmp_path / "o2"),
                                    model="structured"), target=target, tokenizer=tok, progress=False)


def test_bad_training_inputs(lang, tmp_path, capsys):
    target, tok, root = lang
    with pytest.raises(DFlashError, match="no training data"):
        train(TrainConfig(data=[], output=str(tmp_path / "o")), target=target, tokenizer=tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="no dataset shards"):
        train(cfg_for(root, tmp_path / "o", data=[str(tmp_path / "empty")]), target=target, tokenizer=tok)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "shard-000000-000002.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0]}\nnot json\n')
    assert read_dataset([broken]) == []
    assert "loss_mask does not fit" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="--distill 1.5: expected a weight in \\[0, 1\\]"):
        train(cfg_for(root, tmp_path / "o", distill=1.5), target=target, tokenizer=tok)
    yml = tmp_path / "c.yaml"
    yml.write_text("block_size: 8\nbogus_option: 1\n")
    with pytest.raises(DFlashError, match="unknown options \\['bogus_option'\\]"):
        TrainConfig.from_yaml(yml)


def test_train_cli_with_yaml_config(lang, tmp_path):
    """`dflash train --config` reads YAML; flags override it. The target comes from a local folder."""
    target, tok, root = lang
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tok.save_pretrained(folder)
    yml = tmp_path / "train.yaml"
    yml.write_text(f"target: {folder}\ndata: [{root / 'data'}]\nblock-size: 8\nnum_anchors: 16\nepochs: 1\n"
                   f"max_steps: 4\nmask_token_id: {MASK}\ndtype: float32\neval_samples: 2\nlog_interval: 2\n")
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "train", "--config", str(yml), "--output",
                        str(tmp_path / "run"), "--lr", "1e-3", "--threads", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert cfg["lr"] == 1e-3 and cfg["block_size"] == 8 and cfg["num_anchors"] == 16
    assert math.isclose(cfg["gamma"], 7 * 7 / 15)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # `dflash features` with the same YAML, then training from the cached features
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "features", "--config", str(yml), "--features",
                        str(tmp_path / "feats"), "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    made = json.loads(r.stdout.strip().splitlines()[-1])
    # a new folder: the default runtime (the lean path for this fp32 Llama), named in the output and manifest
    assert made["made"] == [{"features": str(tmp_path / "feats"), "records": 48, "runtime": "fast"}]
    assert made["target_layer_ids"] == cfg["target_layer_ids"]
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "train", "--config", str(yml), "--output",
                        str(tmp_path / "run2"), "--features", str(tmp_path / "feats"), "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "dflash.cli", "features", "--config", str(yml), "--features", "a",
                          "b"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "2 folders for 1 --data folders" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "dflash.cli", "train", "--config", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"dflash: error: config file does not exist: {tmp_path / 'missing.yaml'}"]


def test_draft_layers_can_start_from_the_targets_last_layers():
    target = tiny_target("llama", seed=3)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4)
    copied = draft.init_from_target_layers(target, [2, 3])
    src = target.model.layers[3].state_dict()
    assert "layers.1.self_attn.q_proj.weight" in copied and "layers.1.mlp.down_proj.weight" in copied
    assert torch.equal(draft.layers[1].self_attn.q_proj.weight, src["self_attn.q_proj.weight"])
    assert torch.equal(draft.layers[1].post_attention_layernorm.weight, src["post_attention_layernorm.weight"])
    assert not any("q_norm" in name for name in copied)  # Llama has no q/k norm: the draft keeps its own


def test_a_time_budget_sizes_the_schedule_once_and_resumes_with_it(lang, tmp_path):
    from dflash.train import CALIBRATION_STEPS

    target, tok, root = lang
    kw = dict(epochs=50, save_interval=CALIBRATION_STEPS + 2)
    train(cfg_for(root, tmp_path / "run", max_hours=0.003, max_steps=CALIBRATION_STEPS + 2, **kw), target=target,
          tokenizer=tok, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    sized = next(e for e in log if "calibrated_total_steps" in e)
    total = sized["calibrated_total_steps"]
    assert CALIBRATION_STEPS < total < 50 * 44  # ~11 s of steps, far fewer than 50 epochs'
    state = torch.load(tmp_path / "run" / f"checkpoint-{CALIBRATION_STEPS + 2:07d}" / "trainer_state.pt",
                       weights_only=False)
    assert state["schedule"]["total_steps"] == total and state["schedule"]["max_hours"] == 0.003
    # resumed, it keeps the measured length; another budget is another schedule
    train(cfg_for(root, tmp_path / "run", max_hours=0.003, max_steps=CALIBRATION_STEPS + 4, resume=True, **kw),
          target=target, tokenizer=tok, progress=False)
    with pytest.raises(DFlashError, match="keeps its schedule"):
        train(cfg_for(root, tmp_path / "run", max_hours=0.01, resume=True, **kw), target=target, tokenizer=tok,
              progress=False)


def test_a_step_budget_spans_the_schedule_and_ends_the_run(lang, tmp_path):
    target, tok, root = lang
    kw = dict(epochs=50, save_interval=3, log_interval=1)
    train(cfg_for(root, tmp_path / "run", schedule_steps=6, **kw), target=target, tokenizer=tok, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    steps = [e for e in log if "lr" in e]
    assert steps[-1]["step"] == 6 and steps[-1]["lr"] < 1e-3 * steps[0]["lr"]  # annealed to 0 at the budget's end
    state = torch.load(tmp_path / "run" / "checkpoint-0000006" / "trainer_state.pt", weights_only=False)
    assert state["schedule"]["total_steps"] == 6
    with pytest.raises(DFlashError, match="keeps its schedule"):  # another budget is another schedule
        train(cfg_for(root, tmp_path / "run", schedule_steps=8, resume=True, **kw), target=target, tokenizer=tok,
              progress=False)
    with pytest.raises(DFlashError, match="not with --max-hours"):
        train(cfg_for(root, tmp_path / "b", schedule_steps=8, max_hours=1.0, **kw), target=target, tokenizer=tok,
              progress=False)


def test_the_ablation_table_reads_runs_records(lang, tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import ablation_table

    target, tok, root = lang
    for name, layers in (("one", 1), ("two", 2)):  # the second also with 2 sequences a step
        train(cfg_for(root, tmp_path / name, num_layers=layers, batch_size=layers, epochs=1, max_steps=6,
                      eval_interval=3), target=target, tokenizer=tok, progress=False)
    rows = ablation_table.main([str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(tmp_path / "table")])
    assert [r["depth"] for r in rows] == [1, 2] == [r["batch"] for r in rows] and all(r["steps"] == 6 for r in rows)
    assert all(set(r["tau"]) == {"held-out"} and r["mean_tau"] >= 1 and len(r["curve"]) == 2 for r in rows)
    out = capsys.readouterr().out
    # the tiny target's 2 kv heads and 128 MLP units
    assert "| one | dflash | 44 | 1 | 2 | 128 | 8 |" in out and "held-out" in out.splitlines()[0]
    assert "| two | dflash | 44 | 2 | 2 | 128 | 8 |" in out and out.count("| live |") == 2
    # a later stage started from another run's draft names that run, as the run column does
    assert [r["start"] for r in rows] == ["fresh", "fresh"]
    assert ablation_table.start_name(str(tmp_path / "one" / "final")) == "one"
    assert ablation_table.start_name("src/dflash/drafts/m") == "src/dflash/drafts/m"
    # ... by the name the table gives that run where it is a row too, also through a link to its folder; its depth
    # is its draft's (that run's), not the --num-layers it left at the default
    train(cfg_for(root, tmp_path / "three", max_steps=2, init_draft=str(tmp_path / "two" / "final")), target=target,
          tokenizer=tok, progress=False)
    (tmp_path / "alias").symlink_to(tmp_path / "two")
    rows = ablation_table.main([str(tmp_path / "alias"), str(tmp_path / "three")])
    assert [r["run"] for r in rows] == ["alias", "three"] and rows[1]["start"] == "alias"
    assert [r["depth"] for r in rows] == [2, 2]
    assert (tmp_path / "table" / "ablation.png").read_bytes()[:4] == b"\x89PNG"

    # a run paired with a `dflash evaluate` of its draft takes τ from that evaluation instead of its log
    from dflash.evaluate import EvalConfig, run_evaluate
    draft = DFlashDraftModel.from_pretrained(tmp_path / "two" / "final", target=target)
    ev = run_evaluate(target, tok, draft, EvalConfig(prompts=str(root / "prompts.jsonl"), num_prompts=6,
                                                     max_new_tokens=16, runtime="hf"), str(tmp_path / "ev"))
    capsys.readouterr()
    rows = ablation_table.main([f"{tmp_path / 'two'}={tmp_path / 'ev'}"])
    assert rows[0]["mean_tau"] == ev["mean_tau"] and rows[0]["tau"] == {k: v["tau"] for k, v in ev["datasets"].items()}
    assert "evaluate 6×16, block 8" in capsys.readouterr().out


def test_a_trained_draft_grows_layers_that_start_as_the_identity(lang, tmp_path):
    target = tiny_target("qwen3", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    ids = torch.randint(3, 96, (14,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, [0, 2], ids)
    anchors = torch.tensor([3, 8])
    before = DFlashTrainStep(draft, 3.0).block_hidden(feats, ids, anchors).detach()
    assert draft.grow_layers(3) == 2 and len(draft.layers) == draft.config.num_hidden_layers == 3
    step = DFlashTrainStep(draft, 3.0)
    after = step.block_hidden(feats, ids, anchors)
    assert torch.equal(after, before)
    after.square().sum().backward()  # the zeroed output projections learn, so the new layers do not stay idle
    assert draft.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert draft.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(Exception, match="cannot grow a 3-layer draft to 2"):
        draft.grow_layers(2)

    # through `dflash train`: --init-draft with a larger --num-layers, saved and loaded with its new depth
    target, tok, root = lang
    train(cfg_for(root, tmp_path / "one", max_steps=3), target=target, tokenizer=tok, progress=False)
    train(cfg_for(root, tmp_path / "two", max_steps=3, init_draft=str(tmp_path / "one" / "final"), num_layers=2),
          target=target, tokenizer=tok, progress=False)
    grown = DFlashDraftModel.from_pretrained(tmp_path / "two" / "final", target=target)
    assert grown.config.num_hidden_layers == 2 and len(grown.layers) == 2
    assert grown.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # trained away from zero


KEEP_MEMORY_SCRIPT = """
import os, sys, torch
from dflash.machine import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
torch.ones(1 << 10).add_(1)  # the first op's own lazy set-up stays out of the count
before = resident()
x = torch.ones(30 << 18)  # a 30 MiB activation, every page touched
del x
print(kept, (resident() - before) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory tunes glibc's malloc")
def test_training_keeps_freed_activations_for_the_next_step():
    """In a fresh process, a freed 30 MiB tensor goes back to the kernel by default (the next step's gets fresh
    pages, which the kernel zeroes), and stays in the process after keep_freed_memory."""
    kept_mib = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", KEEP_MEMORY_SCRIPT, mode], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        kept, mib = out.stdout.split()
        assert kept == ("True" if mode == "keep" else "None")
        kept_mib[mode] = int(mib)
    assert kept_mib["keep"] >= 27 and kept_mib["default"] <= 10, kept_mib
