"""The prepared GPU check's measurements: an 8B-shaped Qwen3 target and a 5-layer DFlash draft with random
weights (acceptance is meaningless, cost is not), nothing downloaded. Prefill of 4k and 16k tokens, one decode
step against verifying 2/4/8/16 tokens (eager and compiled; on a GPU, compiled steps are CUDA graphs), the
draft's propose, peak memory. Prints a table and ends with one JSON line.

    python scripts/gpu_check.py --device cuda          # what scripts/gpu_check.sh runs after the tests
    python scripts/gpu_check.py --device cpu --small   # the dry mode (small shapes), run by the test suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dflash import DFlashDraftModel
from dflash.fast import make_adapter
from dflash.machine import hardware
from dflash.model import DraftKVCache

SHAPES = {  # Qwen3-8B's, and a small one for the dry mode
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=4096),
}


def random_target(shape: dict, device: torch.device, dtype: torch.dtype):
    """A Qwen3 of the given shape with random weights, built straight on the device (no host copy)."""
    import transformers as tf

    cfg = tf.Qwen3Config(**shape, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0)
        with torch.device(device):  # computed tables, not weights: made for real
            model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return model.eval().requires_grad_(False)


def timed(fn, device, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` calls, after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (the dry mode)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shape = SHAPES["small" if args.small else "8b"]
    prompts = [128, 512] if args.small else [4096, 16384]
    layers, block = (2, 16) if args.small else (5, 16)
    t0 = time.perf_counter()
    target = random_target(shape, device, dtype)
    draft = DFlashDraftModel.from_target(target, num_layers=layers, block_size=block, mask_token_id=3)
    load_s = time.perf_counter() - t0
    rows, results = [], {"device": hardware(device), "dtype": str(dtype).removeprefix("torch."), "shape": shape,
                         "draft_layers": layers, "block_size": block, "build_seconds": round(load_s, 1)}
    g = torch.Generator().manual_seed(1)
    # prefill, and the features the draft's context is made of
    prefill = {}
    for P in prompts:
        a = make_adapter(target, draft.config.target_layer_ids, "fast")
        ids = torch.randint(10, shape["vocab_size"], (1, P), generator=g).to(device)
        pos = torch.arange(P, device=device)[None]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def run():
            a.reset(1, P + 2 * block)
            return a.forward(ids, pos, capture=True, slot_valid=torch.ones_like(ids, dtype=torch.bool),
                             logits_to_keep=1)
        prefill[P] = timed(run, device, max(1, args.repeats // 2))
        rows.append((f"prefill {P} tokens", prefill[P], peak_gib(device)))
    results["prefill_ms"] = {str(k): round(v, 2) for k, v in prefill.items()}
    # a decode step against verify steps, after the shorter prompt, eager and compiled
    P = prompts[0]
    ids = torch.randint(10, shape["vocab_size"], (1, P), generator=g).to(device)
    pos = torch.arange(P, device=device)[None]
    for runtime in ("fast", "fast-compile"):
        if runtime == "fast-compile" and device.type != "cuda":
            results["verify_ms_fast-compile"] = "skipped: compiled steps are CUDA graphs on a GPU only"
            continue
        a = make_adapter(target, draft.config.target_layer_ids, runtime)
        a.reset(1, P + 4 * block)
        with torch.inference_mode():
            _, feats = a.forward(ids, pos, capture=True, slot_valid=torch.ones_like(ids, dtype=torch.bool),
                                 logits_to_keep=1)
        step = {}
        for q in (1, 2, 4, 8, 16):
            block_ids = torch.randint(10, shape["vocab_size"], (1, q), generator=g).to(device)
            block_pos = P + torch.arange(q, device=device)[None]

            def verify():
                with torch.inference_mode():
                    a.valid[:, a.pointer:a.pointer + q] = True
                    a.forward(block_ids, block_pos, capture=True)
                    a.rewind(q)
                    a.valid[:, a.pointer:] = False
            step[q] = timed(verify, device, args.repeats)
            rows.append((f"{runtime}: {'decode 1 token' if q == 1 else f'verify {q} tokens'}", step[q], peak_gib(device)))
        results[f"verify_ms_{runtime}"] = {str(k): round(v, 3) for k, v in step.items()}
        results[f"verify_ratio_{runtime}"] = {str(k): round(v / step[1], 2) for k, v in step.items()}
    # the draft's propose over that context
    cache = DraftKVCache(draft.config, 1, P + 2 * block, device, draft.fc.weight.dtype)
    cache.positions[0, :P] = torch.arange(P, device=device)
    with torch.inference_mode():
        draft.write_context(feats, cache, 0)
        block_ids = torch.full((1, block), 3, device=device)
        block_pos = P + torch.arange(block, device=device)[None]
        valid = torch.ones(1, P, dtype=torch.bool, device=device)
        propose = timed(lambda: draft.propose(block_ids, block_pos, cache, valid), device, args.repeats)
    rows.append((f"draft propose, block {block}", propose, peak_gib(device)))
    results["propose_ms"] = round(propose, 3)
    results["peak_gib"] = peak_gib(device)
    print(f"gpu check: {results['device']}, {results['dtype']}, target {shape['num_hidden_layers']} layers x "
          f"{shape['hidden_size']}, draft {layers} layers, block {block}")
    print(f"{'what':40s} {'ms':>10s} {'peak GiB':>9s}")
    for what, ms, peak in rows:
        print(f"{what:40s} {ms:10.2f} {'' if peak is None else f'{peak:9.1f}'}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
