"""Published checkpoint format: config keys, tensor names, block_size placement, sliding-window layers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash import DFlashConfig, DFlashConfigError, DFlashDraftModel, ar_generate, spec_generate
from tiny import ragged_batch, tiny_target

# config.json of the published Qwen3-8B draft, key for key (block_size at the top level)
QWEN3_8B_DRAFT_CONFIG = """
{
  "architectures": ["DFlashDraftModel"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
  "block_size": 16,
  "bos_token_id": 151643,
  "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
  "dtype": "bfloat16",
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 12288,
  "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention", "full_attention"],
  "max_position_embeddings": 40960,
  "max_window_layers": 5,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 5,
  "num_key_value_heads": 8,
  "num_target_layers": 36,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "transformers_version": "4.57.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}
"""

PER_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight"]


def published_names(n_layers):
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(n_layers) for n in PER_LAYER}


def test_published_config_parses():
    cfg = DFlashConfig.from_dict(json.loads(QWEN3_8B_DRAFT_CONFIG))
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (16, 5, 4096, 128)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.mask_token_id == 151669
    assert cfg.num_target_layers == 36 and cfg.rope_theta == 1e6 and cfg.dtype == "bfloat16"
    # writing it back keeps every published key and value that matters to engines
    out = cfg.to_dict()
    src = json.loads(QWEN3_8B_DRAFT_CONFIG)
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                "max_position_embeddings", "attention_bias", "num_hidden_layers", "layer_types", "sliding_window",
                "num_target_layers", "block_size", "vocab_size", "bos_token_id", "eos_token_id", "auto_map"):
        assert out[key] == src[key], key
    assert out["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert out["dflash_config"]["mask_token_id"] == 151669


def test_block_size_nested_in_dflash_config():
    d = json.loads(QWEN3_8B_DRAFT_CONFIG)
    del d["block_size"]
    d["dflash_config"]["block_size"] = 10
    assert DFlashConfig.from_dict(d).block_size == 10


def test_default_layer_ids_match_published_choice():
    from dflash import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    ids = default_target_layer_ids(4, 3)
    assert len(set(ids)) == 3 and all(0 <= i < 4 for i in ids)


def small_published_dir(tmp_path, target, *, sliding=False, nested=False):
    """A draft folder written by hand the way the published ones are (not by our save_pretrained)."""
    d = json.loads(QWEN3_8B_DRAFT_CONFIG)
    tc = target.config
    d.update(hidden_size=tc.hidden_size, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_hidden_layers=2, num_target_layers=tc.num_hidden_layers, vocab_size=tc.vocab_size,
             layer_types=["full_attention"] * 2, max_position_embeddings=512, rope_theta=10000)
    d["dflash_config"] = {"mask_token_id": tc.vocab_size - 1, "target_layer_ids": [0, 2]}
    if nested:
        d["dflash_config"]["block_size"] = d.pop("block_size")
    if sliding:
        d.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True)
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for i in range(2):
        shapes.update({f"layers.{i}.input_layernorm.weight": (64,), f"layers.{i}.post_attention_layernorm.weight": (64,),
                       f"layers.{i}.self_attn.q_proj.weight": (64, 64), f"layers.{i}.self_attn.k_proj.weight": (32, 64),
                       f"layers.{i}.self_attn.v_proj.weight": (32, 64), f"layers.{i}.self_attn.o_proj.weight": (64, 64),
                       f"layers.{i}.self_attn.q_norm.weight": (16,), f"layers.{i}.self_attn.k_norm.weight": (16,),
                       f"layers.{i}.mlp.gate_proj.weight": (96, 64), f"layers.{i}.mlp.up_proj.weight": (96, 64),
                       f"layers.{i}.mlp.down_proj.weight": (64, 96)})
    tensors = {k: torch.randn(s, generator=g) * 0.05 + (1.0 if len(s) == 1 else 0.0) for k, s in shapes.items()}
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path, tensors


@pytest.mark.parametrize("nested", [False, True])
def test_load_hand_written_published_folder(tmp_path, nested):
    target = tiny_target("qwen3", seed=1)
    path, tensors = small_published_dir(tmp_path, target, nested=nested)
    draft = DFlashDraftModel.from_pretrained(path, target=target)
    assert draft.config.block_size == 16
    state = draft.state_dict()
    assert set(state) == set(tensors) == published_names(2)
    for k, v in tensors.items():
        assert torch.equal(state[k], v)
    ids = ragged_batch([6], seed=1)[0]
    assert torch.equal(spec_generate(target, draft, ids, max_new_tokens=20, stop_token_ids=[]),
                       ar_generate(target, ids, max_new_tokens=20, stop_token_ids=[]))


def test_round_trip(tmp_path):
    target = tiny_target("llama", seed=2)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=8)
    draft.save_pretrained(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == published_names(2)  # no embed_tokens, no lm_head
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["target_layer_ids"] == draft.config.target_layer_ids
    assert not any(f.name.startswith(".tmp") for f in tmp_path.iterdir())  # atomic writes leave nothing behind
    loaded = DFlashDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    ids = ragged_batch([5], seed=4)[0]
    a = spec_generate(target, draft, ids, max_new_tokens=16, return_stats=True)
    b = spec_generate(target, loaded, ids, max_new_tokens=16, return_stats=True)
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths


def test_sliding_window_layers_are_causal_and_windowed(tmp_path):
    """With layer_types=[sliding, full] and window 4, a sliding layer at block position q sees keys at
    positions q-3..q only; full layers see everything. Check it through the attention module itself."""
    target = tiny_target("qwen3", seed=1)
    path, _ = small_published_dir(tmp_path, target, sliding=True)
    draft = DFlashDraftModel.from_pretrained(path, target=target)
    assert draft.config.layer_types == ["sliding_attention", "full_attention"]
    attn = draft.layers[0].self_attn
    assert attn.sliding_window == 4 and draft.layers[1].self_attn.sliding_window is None
    from dflash.model import layer_masks

    torch.manual_seed(0)
    b, T, B = 1, 10, 4
    x = torch.randn(b, B, 64)
    block_pos = (T + torch.arange(B))[None]
    k_pos = torch.arange(T + B)[None]
    rope = draft.rotary_emb(x, block_pos)
    ck, cv = torch.randn(b, 2, T, 16), torch.randn(b, 2, T, 16)
    sliding_mask, full_mask = layer_masks(draft.config, torch.ones(b, 1, T + B, dtype=torch.bool), block_pos, k_pos)
    base = attn(x, rope, ck, cv, sliding_mask)
    # a context key older than every query's window changes nothing ...
    ck2 = ck.clone()
    ck2[:, :, :T - 4] += 5.0
    assert torch.allclose(attn(x, rope, ck2, cv, sliding_mask), base, atol=1e-6)
    # ... one inside the window does; the full layer sees it too
    ck3 = ck.clone()
    ck3[:, :, T - 1] += 5.0
    assert not torch.allclose(attn(x, rope, ck3, cv, sliding_mask), base, atol=1e-4)
    full = draft.layers[1].self_attn
    assert not torch.allclose(full(x, rope, ck2, cv, full_mask), full(x, rope, ck, cv, full_mask), atol=1e-4)
    # causal inside the block: changing the last block slot leaves the first one unchanged
    x2 = x.clone()
    x2[:, -1] += 3.0
    assert torch.allclose(attn(x2, rope, ck, cv, sliding_mask)[:, 0], base[:, 0], atol=1e-6)
    ids = ragged_batch([7, 3], seed=2)
    assert torch.equal(spec_generate(target, draft, *ids, max_new_tokens=20, stop_token_ids=[]),
                       ar_generate(target, *ids, max_new_tokens=20, stop_token_ids=[]))


def test_bad_checkpoints(tmp_path):
    with pytest.raises(DFlashConfigError, match="no config.json"):
        DFlashDraftModel.from_pretrained(tmp_path)
    d = json.loads(QWEN3_8B_DRAFT_CONFIG)
    del d["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(DFlashConfigError, match="target_layer_ids"):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashConfigError, match="invalid JSON"):
        DFlashDraftModel.from_pretrained(tmp_path)
    d = json.loads(QWEN3_8B_DRAFT_CONFIG)
    d.update(layer_types=["sliding_attention"] + ["full_attention"] * 4)
    with pytest.raises(DFlashConfigError, match="sliding_window"):
        DFlashConfig.from_dict(d)


def test_saved_files_get_ordinary_permissions(tmp_path):
    import os
    import stat

    target = tiny_target("llama", seed=2)
    DFlashDraftModel.from_target(target).save_pretrained(tmp_path / "d")
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((tmp_path / "d" / name).stat().st_mode) == 0o666 & ~umask


def test_draft_vocabulary_limits_proposals_keeps_output_and_round_trips(tmp_path):
    target = tiny_target("llama", seed=1)
    draft = DFlashDraftModel.from_target(target, block_size=4)
    vocab = list(range(3, 40))
    draft.set_draft_vocab(vocab)
    ids = ragged_batch([6, 9], seed=3)
    seen = []
    real = DFlashDraftModel.propose

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.append(out)
        return out

    DFlashDraftModel.propose = spy
    try:
        out = spec_generate(target, draft, *ids, max_new_tokens=20, stop_token_ids=[])
    finally:
        DFlashDraftModel.propose = real
    assert torch.equal(out, ar_generate(target, *ids, max_new_tokens=20, stop_token_ids=[]))
    assert all(set(p.flatten().tolist()) <= set(vocab) for p in seen)
    draft.save_pretrained(tmp_path)
    assert "draft_vocab" in load_file(str(tmp_path / "model.safetensors"))
    loaded = DFlashDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.draft_vocab.tolist() == vocab


def test_rope_frequencies_stay_fp32_when_the_draft_is_cast_or_loaded_in_bf16(tmp_path):
    target = tiny_target("qwen3", seed=1)
    draft = DFlashDraftModel.from_target(target, block_size=4)
    freqs = draft.rotary_emb.inv_freq.clone()
    assert freqs.dtype == torch.float32
    draft.to(torch.bfloat16)
    assert draft.fc.weight.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(draft.rotary_emb.inv_freq, freqs)
    draft.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path, target=target.bfloat16())
    assert loaded.fc.weight.dtype == torch.bfloat16 and torch.equal(loaded.rotary_emb.inv_freq, freqs)


def test_sharded_weights_load_and_loading_makes_no_random_init(tmp_path, monkeypatch):
    target = tiny_target("qwen3", seed=1)
    path, tensors = small_published_dir(tmp_path / "one", target)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((path / "config.json").read_text())
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / name))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, keys in shards.items() for k in keys}}))

    def no_init(*a, **k):
        raise AssertionError("loading a draft initialised random weights")
    monkeypatch.setattr(torch.nn.init, "normal_", no_init)
    a = DFlashDraftModel.from_pretrained(path, target=target)
    b = DFlashDraftModel.from_pretrained(sharded, target=target)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) and v.device.type == "cpu", k
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DFlashConfigError, match="shards that are not there.*00002"):
        DFlashDraftModel.from_pretrained(sharded)


def test_dflash_config_keys_newer_drafts_use(tmp_path):
    target = tiny_target("qwen3", seed=1)
    path, _ = small_published_dir(tmp_path, target)
    cfg = json.loads((path / "config.json").read_text())
    # a window stated inside dflash_config is honoured; keys this version does not know are warned about and
    # written back when the draft is saved again
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cfg["dflash_config"].update(sliding_window=4, selector_rank=8)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match=r"\['selector_rank'\] are not understood"):
        draft = DFlashDraftModel.from_pretrained(path, target=target)
    assert draft.config.sliding_window == 4 and draft.layers[0].self_attn.sliding_window == 4
    draft.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["dflash_config"]["selector_rank"] == 8 and again["sliding_window"] == 4
    for change, message in ((dict(use_aux_hidden_state=False), "use_aux_hidden_state is false"),
                            (dict(mask_token_id=None, mask_token="<|MASK|>"), "names its mask token '<\\|MASK\\|>'")):
        bad = json.loads(json.dumps(cfg))
        bad["dflash_config"].update(change)
        if bad["dflash_config"].get("mask_token_id", 0) is None:
            del bad["dflash_config"]["mask_token_id"]
        with pytest.raises(DFlashConfigError, match=message):
            DFlashConfig.from_dict(bad)
