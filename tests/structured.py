"""A tiny target that has learned a simple language, so its greedy text is predictable and a draft can learn it.

Sentences are arithmetic progressions modulo the vocabulary ("t3 t5 t7 t9 ..."); a few hundred optimizer
steps teach a 2-layer Llama to continue them. Also a word-level tokenizer for it (no network).
"""

from __future__ import annotations

import torch

V = 40  # tokens t0..t35 carry the language; 36.. are specials
SPECIALS = ["<pad>", "<eos>", "<mask>"]


def progression(start: int, step: int, n: int) -> list[int]:
    return [(start + i * step) % 36 for i in range(n)]


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(36)}
    vocab.update({s: 36 + i for i, s in enumerate(SPECIALS)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")


def trained_target(seed: int = 0, steps: int = 300):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=37, pad_token_id=36, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, 36, (32,), generator=g).tolist()
        stepsz = torch.randint(1, 6, (32,), generator=g).tolist()
        batch = torch.tensor([progression(s, d, 48) for s, d in zip(starts, stepsz)])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = 37
    model.generation_config.pad_token_id = 36
    return model


def write_prompts(path, n: int, seed: int = 0):
    import json

    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            s, d = torch.randint(0, 36, (1,), generator=g).item(), torch.randint(1, 6, (1,), generator=g).item()
            k = torch.randint(4, 8, (1,), generator=g).item()
            f.write(json.dumps({"prompt": " ".join(f"t{t}" for t in progression(s, d, k))}) + "\n")
    return path
