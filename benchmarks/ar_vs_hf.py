"""Plain decoding speed: our `ar_generate` vs transformers `model.generate`, side by side in one process.

Greedy, fixed number of new tokens (EOS ignored so every run decodes the same count), alternating order per
prompt after a warm-up. Prints a table and ends with one JSON line.

    python benchmarks/ar_vs_hf.py --model smollm2-135m-instruct --max-new-tokens 256 --threads 2 \
        [--runtimes fast,fast-compile,fast-int8,hf]

Quantised runtimes decode a different (quantised) target, so their "same tokens" is expected to be False;
compiled runtimes build their graphs in the warm-up, whose compile time is reported, not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash import ar_generate
from dflash.fast import RUNTIMES, compile_seconds
from dflash.loading import DEFAULT_MODEL, load_target
from dflash.machine import hardware

PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for staying productive when working from home, with a sentence on each.",
]


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model to measure")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and method")
    ap.add_argument("--runtimes", default="fast,hf", help="our runtimes to time, comma-separated")
    args = ap.parse_args()
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    if not runtimes or set(runtimes) - set(RUNTIMES):
        ap.error(f"--runtimes takes a comma-separated list of {', '.join(RUNTIMES)}")
    target, tok = load_target(args.model, dtype=args.dtype, threads=args.threads)
    target.generation_config.eos_token_id = None  # decode exactly max_new_tokens in both paths
    n = args.max_new_tokens

    def ours(runtime):
        return lambda ids: ar_generate(target, ids, max_new_tokens=n, stop_token_ids=[], runtime=runtime)

    def hf(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)

    methods = {**{f"ar_generate {r}": ours(r) for r in runtimes}, "transformers generate": hf}
    encoded = [torch.tensor([tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True)["input_ids"]]) for p in PROMPTS]
    with torch.inference_mode():
        for fn in methods.values():  # warm-up
            fn(encoded[0][:, :8])
        rates = {m: [] for m in methods}
        same = {m: True for m in methods}
        for i, ids in enumerate(encoded * args.repeats):
            order = list(methods)[i % len(methods):] + list(methods)[:i % len(methods)]
            outs = {}
            for m in order:
                t = time.perf_counter()
                outs[m] = methods[m](ids)
                rates[m].append(n / (time.perf_counter() - t))
            for m in methods:
                same[m] &= torch.equal(outs[m], outs["transformers generate"])
    med = {m: statistics.median(r) for m, r in rates.items()}
    ratio = {m: med[m] / med["transformers generate"] for m in methods}
    built = compile_seconds(target)
    if built:
        print(f"torch.compile (warm-up): {', '.join(f'{k} {v:.0f} s' for k, v in built.items())}")
    print(f"{'method':30s} {'median tok/s':>12s} {'vs generate':>11s} {'same tokens':>11s}  per prompt")
    for m, r in rates.items():
        print(f"{m:30s} {med[m]:12.1f} {ratio[m]:10.2f}x {str(same[m]):>11s}  {', '.join(f'{x:.1f}' for x in r)}")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "hardware": hardware(), "threads": torch.get_num_threads(),
                      "max_new_tokens": n, "prompts": len(encoded) * args.repeats,
                      "tokens_per_s": {m: round(v, 2) for m, v in med.items()},
                      "ratio_to_generate": {m: round(v, 3) for m, v in ratio.items()},
                      "identical_to_generate": same, "compile_seconds": built}))


if __name__ == "__main__":
    main()
