"""Our plain and DFlash decoding against llama.cpp's plain decoding on the same GGUF, prompts and threads.

    pip install llama-cpp-python        # optional; builds from source (~20 min on 2 cores), never in CI
    python benchmarks/vs_llama_cpp.py [--datasets gsm8k,humaneval] [--num-prompts 3] [--threads 2]

llama.cpp runs the GGUF as it is (quantised); we run the same file de-quantised to bf16 (`load_target`), and
with `fast-int4` re-quantised to the GGUF's own 4-bit layout (groups of 32, a scale and an offset each).
Per prompt the methods run back to back in rotating order after a warm-up; greedy, 256 new tokens, the
chat template applied by both (the same token ids are fed to llama.cpp). Prints a table of median tokens/s
and ends with one JSON line. Without llama-cpp-python installed, the llama.cpp column is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dflash import ar_generate, spec_generate
from dflash.bench import BENCH_SETS
from dflash.fast import compile_seconds
from dflash.loading import DEFAULT_MODEL, alias_gguf, hardware, load_draft, load_target, shipped_draft
from dflash.prompts import read_prompts
from dflash.regenerate import encode_prompt

LLAMA_CPP = "llama.cpp (gguf as is)"


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="built-in alias or .gguf file")
    ap.add_argument("--draft", default=None, help="draft folder; None = the shipped one")
    ap.add_argument("--datasets", default="gsm8k,humaneval", help="bench prompt sets")
    ap.add_argument("--num-prompts", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer")
    ap.add_argument("--threads", type=int, default=2, help="threads for both")
    ap.add_argument("--data-dir", default=None, help="None = $DFLASH_DATA_DIR")
    ap.add_argument("--runtimes", default="fast,fast-int4",
                    help="our runtimes to run (fast = bf16; fast-int4 = the Q4_1 grid, close to what llama.cpp runs)")
    args = ap.parse_args()

    gguf = str(alias_gguf(args.model)) if not args.model.endswith(".gguf") else args.model
    target, tok = load_target(gguf, threads=args.threads)
    draft_path = args.draft or shipped_draft(args.model)
    draft = load_draft(draft_path, target) if draft_path else None
    n = args.max_new_tokens
    methods = {}
    for rt in args.runtimes.split(","):
        kw = dict(max_new_tokens=n, runtime=rt)
        methods[f"ours ar {rt}"] = lambda ids, kw=kw: ar_generate(target, torch.tensor([ids]), **kw)
        if draft is not None:
            methods[f"ours dflash {rt}"] = lambda ids, kw=kw: spec_generate(target, draft, torch.tensor([ids]), **kw)
            methods[f"ours dflash-adaptive {rt}"] = lambda ids, kw=kw: spec_generate(
                target, draft, torch.tensor([ids]), adaptive_width=True, **kw)
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=gguf, n_threads=args.threads, n_ctx=4096, verbose=False)

        def llama_cpp(ids):
            return llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1)

        methods[LLAMA_CPP] = llama_cpp
    except ImportError:
        print("vs_llama_cpp: llama-cpp-python is not installed; measuring our side only", file=sys.stderr)

    prompts = [p for d in args.datasets.split(",") for p in read_prompts([BENCH_SETS[d]], args.data_dir)[:args.num_prompts]]
    encoded = [encode_prompt(tok, p.messages) for p in prompts]
    with torch.inference_mode():
        for fn in methods.values():  # warm-up
            fn(encoded[0])
        rates, counts = {m: [] for m in methods}, {m: [] for m in methods}
        names = list(methods)
        for i, ids in enumerate(encoded):
            for m in names[i % len(names):] + names[:i % len(names)]:
                t = time.perf_counter()
                out = methods[m](ids)
                seconds = time.perf_counter() - t
                if isinstance(out, dict):  # llama.cpp
                    count = out["usage"]["completion_tokens"]
                else:
                    count = out.shape[1] - len(ids)
                rates[m].append(count / seconds)
                counts[m].append(count)
    med = {m: statistics.median(r) for m, r in rates.items()}
    ref = med.get(LLAMA_CPP)
    built = compile_seconds(target)
    if built:
        print(f"torch.compile (warm-up): {', '.join(f'{k} {v:.0f} s' for k, v in built.items())}")
    print(f"{'method':34s} {'median tok/s':>12s} {'vs llama.cpp':>12s}  per prompt ({len(encoded)} prompts, "
          f"{args.threads} threads)")
    for m, r in rates.items():
        vs = f"{med[m] / ref:11.2f}x" if ref else f"{'-':>12s}"
        print(f"{m:34s} {med[m]:12.1f} {vs}  {', '.join(f'{x:.1f}' for x in r)}")
    print(json.dumps({"model": gguf, "draft": str(draft_path), "hardware": hardware(), "threads": args.threads,
                      "max_new_tokens": n, "prompts": len(encoded), "tokens_per_s": {m: round(v, 2) for m, v in med.items()},
                      "ratio_to_llama_cpp": {m: round(v / ref, 3) for m, v in med.items()} if ref else None,
                      "compile_seconds": built, "new_tokens": counts}))

if __name__ == "__main__":
    main()
