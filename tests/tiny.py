"""Tiny random targets of several architectures, built in-process (no network). DFLASH_TEST_DEVICE=cuda puts
them on a GPU (scripts/gpu_check.sh runs the lossless and sampling tests that way)."""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")

VOCAB = 96
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]


def tiny_config(arch: str, vocab: int = VOCAB, layers: int = 4):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(head_dim=16, sliding_window=512, query_pre_attn_scalar=16, **common)
    if arch == "phi3":
        return tf.Phi3Config(**common)
    raise ValueError(arch)


def tiny_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, vocab, layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    return model.to(DEVICE)


def ragged_batch(lengths, vocab: int = VOCAB, seed: int = 0, pad_id: int = 0):
    """Left-padded prompts of the given lengths (ids avoid the special tokens 0..2) and their mask."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


@torch.no_grad()
def reference_greedy(target, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids=()):
    """The target's own greedy continuation of one unpadded prompt, by HF `generate`, and the smallest
    top-1/top-2 logit gap met on the way (how far float noise is from flipping an argmax)."""
    out = target.generate(prompt[None].to(target.device), max_new_tokens=max_new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True,
                          eos_token_id=list(stop_token_ids) or None, pad_token_id=0)
    new = out.sequences[0, prompt.shape[0]:].tolist()
    gaps = [float(l[0].topk(2).values[0] - l[0].topk(2).values[1]) for l in out.logits]
    if stop_token_ids:
        for k, t in enumerate(new):
            if t in stop_token_ids:
                new = new[:k + 1]
                break
    return new, min(gaps)
