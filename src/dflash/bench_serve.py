"""`dflash bench-serve`: the server under load, DFlash and AR side by side.

For every mode (DFlash, then plain decoding with --no-draft) it starts `dflash serve` in a subprocess (or
measures --base-url), and for each concurrency level N runs N streaming clients that pull prompts from a
shared list. Per level: total throughput, per-user tokens/s, TTFT and time per output token p50/p99, and τ
(from the server's /metrics). Greedy outputs of the two modes are compared prompt by prompt, and each mode's
answers under concurrency with its answers to the same prompts alone (concurrency 1). Writes
results.json and a throughput-vs-interactivity plot (the Pareto curve); ends stdout with one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import DFlashError
from .io import atomic_write_text, save_png


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(args, draft: bool, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "dflash.cli", "serve", "--model", str(args.model), "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue),
           "--prefill-tokens", str(args.prefill_tokens), "--runtime", args.runtime,
           "--max-verify-tokens", str(args.max_verify_tokens)] + (["--fixed-width"] if args.fixed_width else [])
    for flag in ("block_size", "max_model_len", "dtype", "device", "threads", "chat_template_kwargs", "kv_cache_memory",
                 "tree_budget", "tree_topk"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += (["--draft", str(args.draft)] if args.draft else []) if draft else ["--no-draft"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait = 1800 if args.runtime.endswith("-compile") else 600  # a compiling server builds its graphs first
    deadline = time.time() + wait
    while True:
        if proc.poll() is not None:
            raise DFlashError(f"the server exited with status {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise DFlashError(f"the server did not come up in {wait} s; see {log_path}")
        time.sleep(0.5)


def _tau(url: str) -> tuple[float, float]:
    """(sum, count) of the server's acceptance-length histogram."""
    import httpx

    got = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for k in got:
            if line.startswith(f"dflash_acceptance_length_{k} "):
                got[k] = float(line.split()[-1])
    return got["sum"], got["count"]


async def _one(client, model: str, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage else 0
    end = time.perf_counter()
    first = first or end
    return {"text": "".join(text), "tokens": n, "ttft": first - t0, "latency": end - t0,
            "tpot": ((last or end) - first) / (n - 1) if n > 1 else float("nan")}


async def _level(url: str, model: str, prompts: list, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    todo = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)

    async def worker():
        while todo:
            i, p = todo.pop(0)
            results[i] = await _one(client, model, p.messages, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def measure(url: str, model: str, prompts: list, levels: list[int], max_tokens: int, num_prompts) -> list[dict]:
    from tqdm.auto import tqdm

    rows = []
    asyncio.run(_level(url, model, prompts[:1], 1, 8))  # warm-up
    for c in tqdm(levels, desc="concurrency", unit="level"):
        n = num_prompts or max(4, 2 * c)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        s0, c0 = _tau(url)
        results, wall = asyncio.run(_level(url, model, batch, c, max_tokens))
        s1, c1 = _tau(url)
        tokens = sum(r["tokens"] for r in results)
        per_user = [r["tokens"] / r["latency"] for r in results if r["latency"] > 0]
        rows.append({
            "concurrency": c, "requests": n, "tokens": tokens, "wall_s": round(wall, 3),
            "throughput_tok_s": tokens / wall, "per_user_tok_s_p50": _percentile(per_user, 0.5),
            "ttft_p50_s": _percentile([r["ttft"] for r in results], 0.5),
            "ttft_p99_s": _percentile([r["ttft"] for r in results], 0.99),
            "tpot_p50_s": _percentile([r["tpot"] for r in results], 0.5),
            "tpot_p99_s": _percentile([r["tpot"] for r in results], 0.99),
            "tau": (s1 - s0) / (c1 - c0) if c1 > c0 else 1.0, "texts": [r["text"] for r in results],
        })
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode, rows in results.items():
        xs = [r["per_user_tok_s_p50"] for r in rows]
        ys = [r["throughput_tok_s"] for r in rows]
        ax.plot(xs, ys, marker="o", label=mode)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("per-user tokens/s (interactivity)")
    ax.set_ylabel("total tokens/s (throughput)")
    ax.set_title("dflash serve: throughput vs interactivity (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)


def classify_mismatches(args, prompts: list, results: dict) -> list[dict]:
    """Where the DFlash and AR servers' greedy answers part: the target's logit gap between their two tokens
    after the shared prefix (the target loaded here in the servers' dtype; the texts are re-tokenized). A gap
    within the dtype's rounding is a near-tie: verifying a block and decoding one token round differently, so
    bf16 can flip it without any bug. Anything else is reported as unexplained."""
    from .bench import _first_difference, _tie_check
    from .loading import load_target
    from .prompts import encode_prompt, parse_template_kwargs

    pairs = [(d["concurrency"], i, x, y) for d, a in zip(results["dflash"], results["ar"])
             for i, (x, y) in enumerate(zip(d["texts"], a["texts"])) if x != y]
    if not pairs:
        return []
    target, tok = load_target(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    found = []
    for concurrency, i, spec_text, ar_text in pairs:
        prompt = encode_prompt(tok, prompts[i % len(prompts)].messages, None,
                               parse_template_kwargs(getattr(args, "chat_template_kwargs", None)))
        ar_ids, spec_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (ar_text, spec_text))
        k = _first_difference(ar_ids, spec_ids)
        gap, tie = _tie_check(target, prompt + ar_ids[:k], ar_ids[k] if k < len(ar_ids) else None,
                              spec_ids[k] if k < len(spec_ids) else None, args.runtime)
        found.append({"concurrency": concurrency, "request": i, "token": k, "logit_gap": gap, "near_tie": tie})
    return found


def differences_from_solo(rows: list[dict], num_prompts: int) -> dict:
    """A server's greedy answers under concurrency > 1 against the same prompt's answer at concurrency 1 (the
    request i of every level asks prompt i mod num_prompts): a row must not depend on who else is served."""
    solo = next((r["texts"] for r in rows if r["concurrency"] == 1), None)
    if solo is None:
        return {"compared": 0, "differing": 0}
    alone = {i % num_prompts: text for i, text in enumerate(solo)}
    pairs = [(text, alone[i % num_prompts]) for r in rows if r["concurrency"] > 1
             for i, text in enumerate(r["texts"]) if i % num_prompts in alone]
    return {"compared": len(pairs), "differing": sum(a != b for a, b in pairs)}


def run_bench_serve(args) -> dict:
    from .bench import BENCH_SETS
    from .prompts import read_prompts

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise DFlashError(f"--concurrency takes positive integers, got {args.concurrency!r}")
    if args.prompts:
        prompts = read_prompts([args.prompts])
    else:
        names = [d.strip() for d in args.datasets.split(",") if d.strip()]
        unknown = [d for d in names if d not in BENCH_SETS]
        if unknown:
            raise DFlashError(f"unknown dataset(s) {unknown} (known: {', '.join(BENCH_SETS)})")
        per = max(levels) * 2
        sets = [read_prompts([BENCH_SETS[d]], args.data_dir)[:per] for d in names]
        prompts = [p for group in zip(*sets) for p in group]  # interleaved, so every level mixes the sets
    if not prompts:
        raise DFlashError("no prompts to send")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = {"server": None} if args.base_url else ({"ar": False} if args.no_draft else {"dflash": True, "ar": False})
    results = {}
    for mode, draft in modes.items():
        proc = None
        url = args.base_url.rstrip("/").removesuffix("/v1") if args.base_url else None
        try:
            if url is None:
                proc, url = start_server(args, draft, out / f"server-{mode}.log")
            import httpx

            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            results[mode] = measure(url, model, prompts, levels, args.max_tokens, args.num_prompts)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=120)
    details = classify_mismatches(args, prompts, results) if {"dflash", "ar"} <= set(results) else []
    solo = {mode: differences_from_solo(rows, len(prompts)) for mode, rows in results.items()}
    mismatches, near_ties = len(details), sum(d["near_tie"] for d in details)
    lines = [f"{'mode':<7} {'conc':>4} {'tok/s':>8} {'user tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
             f"{'tpot p50':>9} {'tpot p99':>9} {'τ':>5}"]
    for mode, rows in results.items():
        for r in rows:
            lines.append(f"{mode:<7} {r['concurrency']:>4} {r['throughput_tok_s']:>8.1f} {r['per_user_tok_s_p50']:>10.1f} "
                         f"{r['ttft_p50_s'] * 1000:>7.0f}ms {r['ttft_p99_s'] * 1000:>7.0f}ms "
                         f"{r['tpot_p50_s'] * 1000:>7.1f}ms {r['tpot_p99_s'] * 1000:>7.1f}ms {r['tau']:>5.2f}")
    ratios = {}
    if "dflash" in results and "ar" in results:
        ratios = {r["concurrency"]: r["throughput_tok_s"] / a["throughput_tok_s"]
                  for r, a in zip(results["dflash"], results["ar"])}
        lines.append("DFlash / AR throughput: " + ", ".join(f"c={c}: {x:.2f}x" for c, x in ratios.items()))
    for mode, found in solo.items():
        if found["compared"]:
            lines.append(f"{mode}: {found['differing']} of {found['compared']} greedy answers under concurrency "
                         f"differ from the same prompt's answer alone")
    if mismatches:
        lines.append(f"WARNING: {mismatches} greedy answers differ between DFlash and AR: {near_ties} part at a "
                     f"near-tie within the dtype's rounding, {mismatches - near_ties} unexplained")
    print("\n".join(lines))
    from .machine import hardware

    report = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
              # the servers this command started ran here; a --base-url server's machine is unknown
              "hardware": None if args.base_url else hardware(args.device),
              "throughput_ratio": ratios, "greedy_mismatches": mismatches, "near_ties": near_ties,
              "mismatch_details": details, "differences_from_solo": solo}
    atomic_write_text(out / "results.json", json.dumps(report, indent=2, default=str) + "\n")
    plot(results, out / "pareto.png")
    summary = {"bench_serve": str(out), "throughput_ratio": {str(k): round(v, 3) for k, v in ratios.items()},
               **{f"{m}_tok_s": {str(r["concurrency"]): round(r["throughput_tok_s"], 1) for r in rows}
                  for m, rows in results.items()}, "greedy_mismatches": mismatches, "near_ties": near_ties,
               "differences_from_solo": solo}
    print(json.dumps(summary))
    return report
