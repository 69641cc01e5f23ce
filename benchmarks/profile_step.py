"""Where a DFlash step's time goes: draft propose, draft context write, target verify, and the rest
(bookkeeping), per step, next to a plain decoding step; each run's prompt phase, up to its first token, is timed
apart ("prompt ms"). A greedy verify step runs the target's output layer
only on the rows it reads (up to the first rejected token); "dflash full head" runs it on every row, the cost
of a step whose every draft token is accepted. Then the verify ratio side by side: forwards of one token and of a
block alternated call by call (see side_by_side). Prints a table and ends with one JSON line.

    python benchmarks/profile_step.py --draft runs/prelim/final [--data DATASET --draft-vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash import ar_generate, spec_generate
from dflash import fast as fast_mod
from dflash import model as model_mod
from dflash import target as target_mod
from dflash.loading import DEFAULT_MODEL, load_draft, load_target
from dflash.machine import hardware

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def side_by_side(target, draft, ids, answer, runtime, block, pairs):
    """The target's forward of one token and of a block, alternated call by call (so a shared machine's slow
    spells fall on both), each followed by the output layer on the one row every step reads (and, for "full
    head", a block's forward with it on all rows), at the context of the prompt and half the answer; medians."""
    ctx = torch.cat([ids[0], answer[:len(answer) // 2]])[None]
    nxt = torch.cat([answer[len(answer) // 2:], ids[0].repeat(block)])[:block][None]  # a short answer: any ids
    adapter = fast_mod.make_adapter(target, list(draft.config.target_layer_ids), runtime)
    adapter.reset(1, ctx.shape[1] + block)
    times = {"one": [], "verify": [], "verify_full_head": []}
    with torch.inference_mode():
        adapter.forward(ctx, torch.arange(ctx.shape[1])[None], capture=True, logits_to_keep=1)
        pos = torch.arange(ctx.shape[1], ctx.shape[1] + block)[None]
        for i in range(pairs + 2):  # two warm-ups
            for kind in (("one", "verify", "verify_full_head") if i % 2 else ("verify_full_head", "verify", "one")):
                n = 1 if kind == "one" else block
                t = time.perf_counter()
                hidden, _ = adapter.forward(nxt[:, :n], pos[:, :n], capture=True, head=False)
                adapter.head(hidden if kind == "verify_full_head" else hidden[:, :1])
                took = time.perf_counter() - t
                adapter.rewind(n)
                if i >= 2:
                    times[kind].append(took)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"context": ctx.shape[1], "pairs": pairs, "one_ms": round(ms["one"], 3),
            "verify_ms": round(ms["verify"], 3), "verify_full_head_ms": round(ms["verify_full_head"], 3),
            "verify_over_one": round(ms["verify"] / ms["one"], 3),
            "verify_full_head_over_one": round(ms["verify_full_head"] / ms["one"], 3)}


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target")
    ap.add_argument("--draft", required=True, help="draft folder")
    ap.add_argument("--prompt", default=PROMPT, help="user message")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each method, taking turns (after one warm-up)")
    ap.add_argument("--pairs", type=int, default=100, help="alternated forwards of one token and of a block")
    ap.add_argument("--data", default=None, help="regenerated or packed dataset, for --draft-vocab-size")
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="limit proposals to frequent tokens")
    ap.add_argument("--runtime", default="auto", choices=fast_mod.RUNTIMES, help="target forward")
    ap.add_argument("--dtype", default=None, help="target dtype; None = dflash's default for this machine")
    args = ap.parse_args()
    if args.rounds < 1 or args.pairs < 1:
        ap.error("--rounds and --pairs must be at least 1")
    target, tok = load_target(args.model, dtype=args.dtype, threads=args.threads)
    draft = load_draft(args.draft, target)
    if args.draft_vocab_size:
        from dflash.dataset import read_dataset
        from dflash.train import frequent_tokens

        draft.set_draft_vocab(frequent_tokens(read_dataset([args.data], tok), args.draft_vocab_size))
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]])
    spent = {"propose": 0.0, "context write": 0.0, "target forward": 0.0}

    # target forward times by the number of tokens in the call; a verify step's later output-layer rows (greedy
    # verification reads the logits of the rows up to the first rejected token: SpecBatch.step) count with it
    calls: dict[int, list[float]] = {}
    last: list[list[float]] = [[]]
    # a run's prompt phase (its prompt pass, output layer and the draft's first context write) ends where its first
    # step starts: the first propose, or a plain run's second forward. What the parts spent by then is set apart, so
    # that the per-step figures are steps' alone (a short answer's few steps would otherwise carry its prompt pass)
    prompt: dict = {"forwards": 0, "spent": None}

    def timed(name, fn):
        def wrapper(*a, **k):
            if prompt["spent"] is None and (name == "propose" or name == "target forward" and prompt["forwards"]):
                prompt["spent"] = dict(spent)
            prompt["forwards"] += name == "target forward"
            t = time.perf_counter()
            out = fn(*a, **k)
            took = time.perf_counter() - t
            if name == "target head":
                spent["target forward"] += took
                last[0][-1] += took
                return out
            spent[name] += took
            if name == "target forward":
                last[0] = calls.setdefault(a[1].shape[1], [])
                last[0].append(took)
            return out
        return wrapper

    originals = (model_mod.DFlashDraftModel.propose, model_mod.DFlashDraftModel.write_context,
                 target_mod.TargetAdapter.forward, vars(fast_mod.FastTargetAdapter).get("forward"),
                 fast_mod.FastTargetAdapter.head)
    model_mod.DFlashDraftModel.propose = timed("propose", model_mod.DFlashDraftModel.propose)
    model_mod.DFlashDraftModel.write_context = timed("context write", model_mod.DFlashDraftModel.write_context)
    target_mod.TargetAdapter.forward = timed("target forward", target_mod.TargetAdapter.forward)
    if "forward" in vars(fast_mod.FastTargetAdapter):  # an inherited forward is already timed: count it once
        fast_mod.FastTargetAdapter.forward = timed("target forward", fast_mod.FastTargetAdapter.forward)
    fast_mod.FastTargetAdapter.head = timed("target head", fast_mod.FastTargetAdapter.head)
    lazy = fast_mod.FastTargetAdapter.lazy_head
    rows, report = [], {}
    # "dflash full head": the output layer on every row of every verify step, as a step that reads them all
    methods = ("dflash", "dflash full head", "ar")
    kw = dict(max_new_tokens=args.max_new_tokens, return_stats=True, runtime=args.runtime)
    runs = {m: (lambda: ar_generate(target, ids, **kw)) if m == "ar" else (lambda: spec_generate(target, draft, ids, **kw))
            for m in methods}
    seen = {m: {"spent": dict.fromkeys(spent, 0.0), "calls": {}, "total": 0.0, "prompt": 0.0, "steps": 0, "tokens": 0}
            for m in methods}
    # the methods take turns, round by round, so that a shared machine's slow spells fall on all of them alike
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for method in methods:
            fast_mod.FastTargetAdapter.lazy_head = property(lambda self: False) if method == "dflash full head" else lazy
            for k in spent:
                spent[k] = 0.0
            calls.clear()
            prompt.update(forwards=0, spent=None)
            t = time.perf_counter()
            out = runs[method]()
            total = time.perf_counter() - t
            if round_ == 0:
                continue
            acc = seen[method]
            before = prompt["spent"] or spent  # a run that ended at its first token had no steps
            for k, v in spent.items():
                acc["spent"][k] += v - before[k]
            for n, ts in calls.items():
                acc["calls"].setdefault(n, []).extend(ts)
            acc["total"] += total - out.time_to_first_token
            acc["prompt"] += out.time_to_first_token
            acc["steps"] += out.num_steps
            acc["tokens"] += out.num_new_tokens[0]
            acc["tau"] = out.tau
            if method == "ar":  # its new tokens: what side_by_side verifies
                answer = out.sequences[0, ids.shape[1]:ids.shape[1] + out.num_new_tokens[0]]
    for method in methods:
        acc = seen[method]
        steps = max(acc["steps"], 1)
        per = {k: 1000 * v / steps for k, v in acc["spent"].items()}
        per["other"] = 1000 * acc["total"] / steps - sum(per.values())
        # a step's forward alone, the prompt pass left out: the median over the calls of each size
        forward = {n: 1000 * statistics.median(ts) for n, ts in acc["calls"].items() if n != ids.shape[1]}
        wall = acc["total"] + acc["prompt"]
        report[method] = {"ms_per_step": {k: round(v, 2) for k, v in per.items()}, "steps": acc["steps"] // args.rounds,
                          "prompt_ms": round(1000 * acc["prompt"] / args.rounds, 1),
                          "tau": round(acc["tau"], 3), "tokens_per_s": round(acc["tokens"] / wall, 2),
                          "forward_ms_by_tokens": {n: round(v, 2) for n, v in sorted(forward.items())}}
        rows.append(f"{method:16s} " + " ".join(f"{per[k]:>14.1f}" for k in per) +
                    f" {1000 * acc['prompt'] / args.rounds:9.1f} {acc['tau']:6.2f} {acc['tokens'] / wall:8.1f}")
    fast_mod.FastTargetAdapter.lazy_head = lazy
    (model_mod.DFlashDraftModel.propose, model_mod.DFlashDraftModel.write_context, target_mod.TargetAdapter.forward,
     fast_forward, fast_mod.FastTargetAdapter.head) = originals
    if fast_forward is not None:
        fast_mod.FastTargetAdapter.forward = fast_forward
    print(f"{'method':16s} " + " ".join(f"{k + ' ms':>14s}" for k in list(spent) + ["other"]) +
          f" {'prompt ms':>9s} {'tau':>6s} {'tok/s':>8s}")
    print("\n".join(rows))
    one = report["ar"]["forward_ms_by_tokens"].get(1)
    for method, key in (("dflash", "verify_{}_over_one"), ("dflash full head", "verify_{}_full_head_over_one")):
        for n, ms in report[method]["forward_ms_by_tokens"].items():
            if one and n > 1:
                print(f"{method}: target forward of {n} tokens (median): {ms:.1f} ms = {ms / one:.2f}x one "
                      f"token's ({one:.1f} ms)")
                report[key.format(n)] = round(ms / one, 3)
    report["side_by_side"] = side_by_side(target, draft, ids, answer, args.runtime, draft.config.block_size, args.pairs)
    for key, label in (("verify_over_one", "the output layer on one row"), ("verify_full_head_over_one", "all rows")):
        print(f"side by side at {report['side_by_side']['context']} cached tokens, {label}: target forward of "
              f"{draft.config.block_size} tokens {report['side_by_side'][key.replace('over_one', 'ms')]:.2f} ms = "
              f"{report['side_by_side'][key]:.2f}x one token's ({report['side_by_side']['one_ms']:.2f} ms)")
    print(json.dumps({"model": args.model, "draft": args.draft, "draft_vocab_size": args.draft_vocab_size, "runtime": args.runtime,
                      "dtype": str(target.dtype).removeprefix("torch."),
                      "hardware": hardware(target.device), "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, **report}))


if __name__ == "__main__":
    main()
