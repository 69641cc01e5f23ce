"""How far weight-only quantisation (`--runtime fast-int8`, `fast-int4`) moves the model: greedy answers to
GSM8K test questions from each quantised target next to the same target in the fast bf16 runtime.

Quantisation changes the target, so DFlash on int8/int4 is lossless against that target's own decoding, not
bf16's; this reports what that costs. It counts how many outputs are identical, the median token where they
part, how often the final numbers agree, and each runtime's accuracy against the reference answers. Prints a
table and ends with one JSON line.

    DFLASH_DATA_DIR=../shared/data python benchmarks/quant_drift.py --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
from tqdm.auto import tqdm

from dflash import ar_generate
from dflash.generate import default_stop_token_ids
from dflash.loading import DEFAULT_MODEL, load_target
from dflash.machine import hardware
from dflash.prompts import read_prompts
from dflash.prompts import encode_prompt, left_pad, pad_id_for

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in a text (GSM8K references end with '#### N'; answers are read the same way)."""
    found = NUMBER.findall(text.split("####")[-1]) or NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def answers(model: str, runtime: str, prompts, args) -> tuple[list[list[int]], list[str], float]:
    target, tok = load_target(model, dtype=args.dtype, threads=args.threads)
    stops = default_stop_token_ids(target)
    pad = pad_id_for(tok, stops)
    tokens, texts, seconds, count = [], [], 0.0, 0
    for start in tqdm(range(0, len(prompts), args.batch_size), desc=runtime, unit="batch"):
        chunk = prompts[start:start + args.batch_size]
        ids, mask = left_pad([encode_prompt(tok, p.messages) for p in chunk], pad)
        t0 = time.perf_counter()
        out = ar_generate(target, ids, mask, max_new_tokens=args.max_new_tokens, runtime=runtime, return_stats=True)
        seconds += time.perf_counter() - t0
        P = ids.shape[1]
        for i, n in enumerate(out.num_new_tokens):
            row = out.sequences[i, P:P + n].tolist()
            tokens.append(row)
            texts.append(tok.decode(row, skip_special_tokens=True))
            count += n
    return tokens, texts, count / seconds


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model to measure")
    ap.add_argument("--num-prompts", type=int, default=64, help="first N GSM8K test questions")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit")
    ap.add_argument("--batch-size", type=int, default=8, help="questions decoded together")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the unquantised weights")
    ap.add_argument("--data-dir", default=None, help="None = $DFLASH_DATA_DIR")
    ap.add_argument("--quantized", default="fast-int8,fast-int4", help="quantised runtimes to compare with fast")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = read_prompts(["gsm8k:test"], args.data_dir)[:args.num_prompts]
    gold = [final_number(p.meta.get("answer", "")) for p in prompts]
    runtimes = ["fast"] + args.quantized.split(",")
    runs = {rt: answers(args.model, rt, prompts, args) for rt in runtimes}
    n = len(prompts)
    base_tok, base_txt, _ = runs["fast"]
    base_ans = [final_number(t) for t in base_txt]
    summary = {"model": args.model, "prompts": n, "max_new_tokens": args.max_new_tokens, "hardware": hardware(),
               "threads": args.threads,
               "batch_size": args.batch_size, "runtimes": {}}
    for rt, (toks, txts, speed) in runs.items():
        parted = [first_difference(a, b) for a, b in zip(base_tok, toks)]
        ans = [final_number(t) for t in txts]
        summary["runtimes"][rt] = {
            "tokens_per_s": round(speed, 1),
            "accuracy": sum(a is not None and a == g for a, g in zip(ans, gold)) / n,
            "identical_outputs": sum(p is None for p in parted),
            "answers_agree": sum(a == b for a, b in zip(base_ans, ans)),
            "median_first_difference": statistics.median([p for p in parted if p is not None] or [None]),
        }
    print(f"{'runtime':<10} {'tok/s (batch ' + str(args.batch_size) + ')':>18} {'GSM8K accuracy':>15} "
          f"{'same output':>12} {'same answer':>12} {'parts at (median)':>18}")
    for rt, r in summary["runtimes"].items():
        print(f"{rt:<10} {r['tokens_per_s']:>18.1f} {r['accuracy']:>15.3f} {r['identical_outputs']:>8}/{n:<3} "
              f"{r['answers_agree']:>8}/{n:<3} {str(r['median_first_difference']):>18}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
