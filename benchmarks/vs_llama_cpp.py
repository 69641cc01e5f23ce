"""Our plain and DFlash decoding against llama.cpp's plain decoding on the same GGUF, prompts and threads.

    pip install llama-cpp-python        # optional; builds from source (~20 min on 2 cores), never in CI
    python benchmarks/vs_llama_cpp.py [--datasets gsm8k,humaneval] [--num-prompts 3] [--threads 2]

llama.cpp runs the GGUF as it is (quantised); we run the same file de-quantised to bf16 (`load_target`), and
with `fast-int4` re-quantised to the GGUF's own 4-bit layout (groups of 32, a scale and an offset each).
Per prompt the methods run back to back in rotating order after a warm-up; greedy, 256 new tokens, the
chat template applied by both (the same token ids are fed to llama.cpp). Speed on a shared machine drifts
by 15 % or more within minutes, so the ratio to llama.cpp is taken per run (a method against llama.cpp on
the same prompt, in the same turn) and its median reported, per dataset and over all; `--repeats` runs
every prompt again. Prints a table, writes results.json and a bar plot with `--out`, and ends with one JSON
line. Without llama-cpp-python installed, the llama.cpp column is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dflash import ar_generate, spec_generate
from dflash.bench import BENCH_SETS, ratio_bars
from dflash.fast import compile_seconds
from dflash.io import atomic_write_text, save_png
from dflash.loading import DEFAULT_MODEL, alias_gguf, load_draft, load_target, shipped_draft
from dflash.machine import hardware
from dflash.prompts import read_prompts
from dflash.prompts import encode_prompt

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
    ap.add_argument("--repeats", type=int, default=1, help="times each prompt runs (every method, each time)")
    ap.add_argument("--out", default=None, help="folder for results.json and vs_llama_cpp.png")
    ap.add_argument("--no-llama-extra-bufts", action="store_true",
                    help="load the GGUF without llama.cpp's extra CPU buffer types (its AMX and repacked-weight "
                         "kernels): on an AMX Xeon (llama-cpp-python 0.3.36) the AMX one crashed at the second "
                         "decode; llama.cpp then runs its AVX-512 VNNI dot products")
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
            # what `dflash generate` does with no options
            methods[f"ours dflash-lookup-adaptive {rt}"] = lambda ids, kw=kw: spec_generate(
                target, draft, torch.tensor([ids]), adaptive_width=True, prompt_lookup=True, **kw)
            methods[f"ours dflash-tree-adaptive {rt}"] = lambda ids, kw=kw: spec_generate(
                target, draft, torch.tensor([ids]), tree_budget="auto", **kw)
    try:
        llm = llama(gguf, args.threads, extra_bufts=not args.no_llama_extra_bufts)

        def llama_cpp(ids):
            return llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1)

        methods[LLAMA_CPP] = llama_cpp
    except ImportError:
        print("vs_llama_cpp: llama-cpp-python is not installed; measuring our side only", file=sys.stderr)

    sets = args.datasets.split(",")
    prompts = [(d, p) for d in sets for p in read_prompts([BENCH_SETS[d]], args.data_dir)[:args.num_prompts]]
    encoded = [(d, encode_prompt(tok, p.messages)) for d, p in prompts]
    names = list(methods)
    # runs[m]: (dataset, tokens/s, new tokens) per prompt and repeat
    runs: dict[str, list[tuple[str, float, int]]] = {m: [] for m in methods}
    with torch.inference_mode():
        for fn in methods.values():  # warm-up (and the compiles of '*-compile' runtimes)
            fn(encoded[0][1])
        turn = 0
        for _ in tqdm(range(args.repeats), desc="repeats", disable=args.repeats == 1):
            for d, ids in tqdm(encoded, desc="prompts", leave=False):
                # back to back, in rotating order: a drift of the machine's speed hits every method alike
                for m in names[turn % len(names):] + names[:turn % len(names)]:
                    t = time.perf_counter()
                    out = methods[m](ids)
                    seconds = time.perf_counter() - t
                    count = out["usage"]["completion_tokens"] if isinstance(out, dict) else out.shape[1] - len(ids)
                    runs[m].append((d, count / seconds, count))
                turn += 1
    report = {"model": gguf, "draft": str(draft_path), "hardware": hardware(), "threads": args.threads,
              "llama_cpp_extra_bufts": not args.no_llama_extra_bufts,
              "max_new_tokens": n, "prompts": len(encoded), "repeats": args.repeats,
              "compile_seconds": compile_seconds(target), "datasets": {}}
    for d in (*sets, "all"):
        rates = {m: [r for ds, r, _ in runs[m] if d in (ds, "all")] for m in methods}
        ref = rates.get(LLAMA_CPP)
        report["datasets"][d] = {m: {
            "tokens_per_s": round(statistics.median(r), 2),
            # each run against llama.cpp's run of the same prompt in the same turn, then the median
            "median_ratio_to_llama_cpp": round(statistics.median(x / y for x, y in zip(r, ref)), 3) if ref else None,
            "runs_tokens_per_s": [round(x, 1) for x in r]} for m, r in rates.items()}
    report["new_tokens"] = {m: [c for _, _, c in r] for m, r in runs.items()}
    print(table(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "results.json", json.dumps(report, indent=2) + "\n")
        if LLAMA_CPP in methods:
            plot(report, out / "vs_llama_cpp.png")
    print(json.dumps({k: v for k, v in report.items() if k != "new_tokens"}))


def llama(gguf: str, threads: int, extra_bufts: bool):
    """llama.cpp on the GGUF; extra_bufts=False loads it as `use_extra_bufts=false` does, which Llama() takes no
    argument for: its model parameters come from llama_model_default_params, replaced for this one call."""
    import llama_cpp.llama as api
    from llama_cpp import Llama

    default = api.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    api.llama_cpp.llama_model_default_params = params
    try:
        return Llama(model_path=gguf, n_threads=threads, n_ctx=4096, verbose=False)
    finally:
        api.llama_cpp.llama_model_default_params = default


def table(report: dict) -> str:
    built = report["compile_seconds"]
    rows = [f"torch.compile (warm-up): {', '.join(f'{k} {v:.0f} s' for k, v in built.items())}"] if built else []
    rows.append(f"{'dataset':10s} {'method':34s} {'median tok/s':>12s} {'vs llama.cpp':>12s}  per run "
                f"({report['prompts']} prompts x {report['repeats']}, {report['threads']} threads)")
    for d, per in report["datasets"].items():
        for m, x in per.items():
            ratio = x["median_ratio_to_llama_cpp"]
            vs = f"{ratio:11.2f}x" if ratio is not None else f"{'-':>12s}"
            runs = ", ".join(f"{r:.1f}" for r in x["runs_tokens_per_s"]) if d != "all" else ""
            rows.append(f"{d:10s} {m:34s} {x['tokens_per_s']:12.1f} {vs}  {runs}")
    return "\n".join(rows)


def plot(report: dict, path: Path) -> None:
    """Grouped bars: each method's median ratio to llama.cpp per dataset."""
    sets = list(report["datasets"])
    methods = [m for m in report["datasets"][sets[0]] if m != LLAMA_CPP]
    save_png(ratio_bars(sets, {m: [report["datasets"][d][m]["median_ratio_to_llama_cpp"] for d in sets] for m in methods},
                        "tokens/s, ratio to llama.cpp (median of runs)",
                        f"{report['threads']} threads, {report['max_new_tokens']} new tokens, greedy"), path)


if __name__ == "__main__":
    main()
