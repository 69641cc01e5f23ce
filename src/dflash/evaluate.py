"""`dflash evaluate`: how well a draft is accepted, on fixed held-out sets, at a fixed width.

τ alone mixes how far a draft's guesses reach with how often the first one is right. Per block slot k, the
acceptance rate given that slots 1..k-1 were accepted separates them: τ at block B is
1 + sum over k of the product of the first k rates. Measured by real greedy speculative decoding (the target
verifies every block in full, no adaptive width), on the test splits of fixed sets, so runs can be compared
with each other and with the peers. Training logs the same numbers (`dflash train --eval-datasets`).
"""

from __future__ import annotations

import json
import sys
import warnings
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .eagle import Eagle3DraftModel
from .io import atomic_write_text, save_png
from .kernels import linear

EVAL_DATASETS = ["gsm8k", "mbpp", "humaneval", "mt-bench"]


@dataclass
class EvalConfig:
    datasets: list[str] = field(default_factory=lambda: list(EVAL_DATASETS))
    num_prompts: int = 40
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the draft's own
    batch_size: int = 8  # prompts decoded together (greedy acceptance does not depend on it)
    data_dir: str | None = None
    runtime: str = "auto"
    prompts: str | None = None  # a JSONL prompt file instead of the named datasets
    topk: list[int] | None = None  # also: how often the target's token is among the draft's k best, per slot
    chat_template_kwargs: dict | None = None  # the chat template's options, e.g. {"enable_thinking": False}
    prompt_lookup: bool = False  # the text's own continuation ahead of the draft's proposals (generate's option)


def slot_acceptance(acceptance_lengths: list[int], block_size: int) -> list[float]:
    """Per drafted slot k = 1..B-1: of the steps that reached slot k (slots before it all accepted), the share
    that accepted it. acceptance_lengths count committed tokens per step, the target's own one included."""
    reached = [sum(1 for n in acceptance_lengths if n >= k) for k in range(1, block_size)]
    accepted = [sum(1 for n in acceptance_lengths if n >= k + 1) for k in range(1, block_size)]
    return [a / r if r else 0.0 for a, r in zip(accepted, reached)]


def eval_prompt_sets(cfg: EvalConfig) -> dict:
    """The prompts of cfg.datasets (or of cfg.prompts), as `dflash.prompts.Prompt`s per set."""
    from .bench import bench_prompt_sets
    from .prompts import read_prompts

    if cfg.prompts:
        return {Path(cfg.prompts).stem: read_prompts([cfg.prompts])[:cfg.num_prompts]}
    return bench_prompt_sets(cfg.datasets, cfg.num_prompts, cfg.data_dir)


def encoded_eval_sets(tokenizer, cfg: EvalConfig, sets: dict | None = None) -> dict[str, list[list[int]]]:
    """The prompts of cfg.datasets (or the given sets of Prompts) as token ids (the chat template applied)."""
    from .prompts import encode_prompt

    return {name: [encode_prompt(tokenizer, p.messages, None, cfg.chat_template_kwargs) for p in prompts]
            for name, prompts in (eval_prompt_sets(cfg) if sets is None else sets).items()}


def tau_by_category(per_prompt: list[list[int]], categories: list[str | None]) -> dict[str, dict]:
    """τ per kind of task within a set (MT-Bench's writing, roleplay, ...; prompts with none left out), from each
    prompt's [steps, tokens], summed as τ itself is: where a set's τ is low, which of its kinds hold it down."""
    counts: dict[str, list[int]] = {}
    for (steps, tokens), cat in zip(per_prompt, categories, strict=True):
        if cat is not None:
            c = counts.setdefault(cat, [0, 0, 0])
            c[0], c[1], c[2] = c[0] + steps, c[1] + tokens, c[2] + 1
    return {cat: {"tau": tokens / max(1, steps), "steps": steps, "prompts": n}
            for cat, (steps, tokens, n) in counts.items()}


@torch.inference_mode()
def evaluate_draft(target, draft, prompt_sets: dict[str, list[list[int]]], cfg: EvalConfig, *, pad_id: int = 0,
                   progress: bool = True) -> dict:
    """τ, per-slot acceptance and the acceptance histogram per set of prompts (token ids), and τ averaged over
    the sets."""
    from tqdm.auto import tqdm

    from .generate import _resolve_block_size, default_stop_token_ids, spec_generate
    from .prompts import left_pad

    B = _resolve_block_size(draft, cfg.block_size, None)
    stops = default_stop_token_ids(target)
    topk = cfg.topk
    if topk and isinstance(draft, Eagle3DraftModel):
        # the teacher-forced slots are those of one block forward, [anchor, MASK...]: a chain drafter has none
        warnings.warn("evaluate: --topk counts a DFlash draft's block slots; skipped for an EAGLE-3-style draft",
                      stacklevel=2)
        topk = None
    was_training = draft.training
    draft.eval()
    results = {}
    bar = tqdm(total=sum(len(p) for p in prompt_sets.values()), unit="prompt", desc="evaluate",
               disable=not progress, dynamic_ncols=True)
    for name, prompts in prompt_sets.items():
        lengths, texts = [], []
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # batches pad little
        per_prompt = [[0, 0] for _ in prompts]  # [steps, tokens they committed], in the set's own order
        prompts = [prompts[i] for i in order]
        for i in range(0, len(prompts), cfg.batch_size):
            ids, mask = left_pad(prompts[i:i + cfg.batch_size], pad_id)
            out = spec_generate(target, draft, ids.to(target.device), mask.to(target.device), block_size=B,
                                max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, return_stats=True,
                                runtime=cfg.runtime, prompt_lookup=cfg.prompt_lookup)
            lengths += out.acceptance_lengths
            for j, steps, accepted in zip(order[i:i + cfg.batch_size], out.row_steps, out.row_accepted):
                per_prompt[j] = [steps, accepted]
            P = ids.shape[1]
            texts += [(p + out.sequences[r, P:P + n].tolist(), len(p))
                      for r, (p, n) in enumerate(zip(prompts[i:i + cfg.batch_size], out.num_new_tokens))]
            bar.update(ids.shape[0])
        hist = [0] * B
        for n in lengths:
            hist[n - 1] += 1
        results[name] = {"tau": sum(lengths) / max(1, len(lengths)), "slot_acceptance": slot_acceptance(lengths, B),
                         "acceptance_histogram": hist, "steps": len(lengths), "prompts": len(prompts),
                         "per_prompt": per_prompt}
        if topk:
            results[name]["topk_hits"], results[name]["copy_split"] = topk_hits(target, draft, texts, topk, B)
    bar.close()
    if was_training:
        draft.train()
    return {"block_size": B, "datasets": results,
            "mean_tau": sum(r["tau"] for r in results.values()) / max(1, len(results))}


def copyable(ids: list[int], start: int) -> list[bool]:
    """For positions start..len(ids)-1: whether prompt lookup guesses the token from the text before it (the
    latest earlier occurrence of the last 3, else 2 tokens is followed by it: NgramDraft.repeats): the tokens a
    draft could take by copying from its context."""
    from .ngram import NgramDraft

    lookup, words = NgramDraft.repeats(1), array("i", ids)  # an array's prefixes reach the lookup unconverted
    return [lookup.propose(words[:i], 1) == [ids[i]] for i in range(start, len(ids))]


@torch.no_grad()
def topk_hits(target, draft, texts: list[tuple[list[int], int]], ks: list[int],
              block_size: int) -> tuple[dict, dict]:
    """Per k and block slot: how often the target's own next token is among the draft's k most probable ones,
    with every answer position as anchor and the target's text as context (teacher-forced, so a slot is counted
    whatever the slots before it proposed). k = 1 is the chain's per-slot accuracy; the gain at k > 1 is what
    candidate trees (dflash.tree) can take.
    Returns ({k: rates}, split); split holds, under "copy" and "novel", the top-1 rate per slot over the tokens
    that prompt lookup guesses right from the text before them (`copyable`) and over the others, and under
    "copy_share" the copyable part of the slot-1 tokens: a draft that reads its context takes the copyable ones
    far more often than the others; one that guesses from the last few tokens alone takes both alike."""
    from .model import block_inputs
    from .target import target_features

    draft.config.block_size, saved = block_size, draft.config.block_size
    hits = torch.zeros(len(ks), block_size - 1)
    counted = torch.zeros(block_size - 1)
    kind_hits, kind_counted = torch.zeros(2, block_size - 1), torch.zeros(2, block_size - 1)  # novel, copy
    weight, bias, rows = draft._proposal_head()
    try:
        for ids, n_prompt in texts:
            copy = torch.tensor([False] * (n_prompt + 1) + copyable(ids, n_prompt + 1))
            ids = torch.tensor(ids)
            anchors = torch.arange(n_prompt, len(ids) - 1)
            if len(anchors) == 0:
                continue
            feats = target_features(target, draft.config.target_layer_ids, ids).to(draft.fc.weight.dtype)
            block_ids, block_pos, labels = block_inputs(ids, torch.ones_like(ids), anchors, block_size,
                                                        draft.config.mask_token_id)
            hidden = draft.packed_blocks(feats, block_ids, block_pos, anchors)[:, 1:]  # [n, B-1, H]
            logits = linear(hidden.reshape(-1, hidden.shape[-1]).to(draft.lm_head.weight.dtype), weight, bias)
            top = logits.topk(max(ks), -1).indices.view(*labels.shape, -1).cpu()
            top = top if rows is None else rows.cpu()[top]
            ok = labels != -100
            counted += ok.sum(0)
            for i, k in enumerate(ks):
                hits[i] += ((top[..., :k] == labels[..., None]).any(-1) & ok).sum(0)
            # the label of slot k of anchor a sits at a + k
            label_copy = copy[(anchors[:, None] + torch.arange(1, block_size)).clamp(max=len(ids) - 1)] & ok
            right = (top[..., 0] == labels) & ok
            for kind, where in enumerate((ok & ~label_copy, label_copy)):
                kind_hits[kind] += (right & where).sum(0)
                kind_counted[kind] += where.sum(0)
    finally:
        draft.config.block_size = saved
    rates = {str(k): (hits[i] / counted.clamp(min=1)).tolist() for i, k in enumerate(ks)}
    split = {"copy_share": float(kind_counted[1, 0] / counted[0].clamp(min=1)),
             "copy": (kind_hits[1] / kind_counted[1].clamp(min=1)).tolist(),
             "novel": (kind_hits[0] / kind_counted[0].clamp(min=1)).tolist()}
    return rates, split


def plot_slot_acceptance(results: dict, png: Path, title: str = "") -> None:
    """One curve per dataset: acceptance rate of each drafted slot, given the slots before it were accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results["datasets"].items():
        rates = r["slot_acceptance"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} (τ {r['tau']:.2f})")
    ax.set_xlabel("block slot k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(title or f"per-slot acceptance, block {results['block_size']}")
    ax.legend(fontsize=8)
    save_png(fig, png, dpi=100)


def evaluation_settings(results: dict) -> dict:
    """What two `dflash evaluate` results must share to be compared: the prompts, their number and length, the
    width and prompt lookup."""
    c = results["config"]
    return {"block_size": results["block_size"], "num_prompts": c["num_prompts"],
            "max_new_tokens": c["max_new_tokens"], "prompts": c.get("prompts"),
            "prompt_lookup": c.get("prompt_lookup", False)}


def check_comparable(base: dict, other: dict) -> None:
    """ValueError naming the first setting two evaluations differ in, or a set `other` lacks."""
    mine, theirs = evaluation_settings(base), evaluation_settings(other)
    for key in mine:
        if mine[key] != theirs[key]:
            raise ValueError(f"the evaluations ran {key}={mine[key]} and {key}={theirs[key]}")
    missing = sorted(set(base["datasets"]) - set(other["datasets"]))
    if missing:
        raise ValueError(f"the second evaluation lacks {', '.join(missing)}")


def paired_tau_difference(base: dict, other: dict, resamples: int = 10000, seed: int = 0) -> dict:
    """τ of `other` minus τ of `base` (two `dflash evaluate` results of two drafts on the same prompts), and their
    ratio, per set and averaged over the sets, each with a 95% bootstrap interval over the prompts: both drafts
    answered the same prompts, so each resample draws prompts (with replacement, per set) and recomputes both τ
    on them (steps and tokens summed, as τ itself is). Prompt by prompt the two drafts' differences vary far less
    than their τ do, which is what lets differences of a few hundredths be told from the choice of prompts. What it
    does not measure: how much another training seed would move a draft."""
    check_comparable(base, other)
    g = torch.Generator().manual_seed(seed)
    sets, taus = {}, []
    for name, r in base["datasets"].items():
        a, b = r.get("per_prompt"), other["datasets"][name].get("per_prompt")
        if a is None or b is None:
            raise ValueError(f"{name}: an evaluation holds no per-prompt counts (made before dflash kept them); "
                             "run dflash evaluate again")
        if len(a) != len(b):
            raise ValueError(f"{name}: {len(a)} prompts against {len(b)}")
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)  # [n, (steps, tokens)]
        pick = torch.randint(len(a), (resamples, len(a)), generator=g)
        resampled = _tau(a[pick]), _tau(b[pick])  # [resamples] each
        taus.append(resampled)
        sets[name] = {**_compared(_tau(a).item(), _tau(b).item(), *resampled), "prompts": len(a)}
    mean = _compared(*(sum(v[k] for v in sets.values()) / len(sets) for k in ("base", "other")),
                     *(torch.stack(t).mean(0) for t in zip(*taus)))
    return {"datasets": sets, "mean": mean, "resamples": resamples, "seed": seed}


def _compared(base: float, other: float, base_r: torch.Tensor, other_r: torch.Tensor) -> dict:
    """The difference and ratio of two τ, with intervals from their resampled values."""
    d, r = other_r - base_r, other_r / base_r
    (d_lo, d_hi), (r_lo, r_hi) = (torch.quantile(t, torch.tensor([0.025, 0.975], dtype=t.dtype)).tolist()
                                  for t in (d, r))
    return {"base": base, "other": other, "difference": other - base, "low": d_lo, "high": d_hi,
            "share_not_above_zero": (d <= 0).double().mean().item(), "ratio": other / base, "ratio_low": r_lo,
            "ratio_high": r_hi}


def _tau(t: torch.Tensor) -> torch.Tensor:
    """τ of prompts' [..., n, (steps, tokens)] counts: their tokens over their steps."""
    return t[..., 1].sum(-1) / t[..., 0].sum(-1)


def format_table(results: dict) -> str:
    B = results["block_size"]
    head = "| dataset | τ | " + " | ".join(f"slot {k}" for k in range(1, B)) + " | steps |"
    rows = [head, "|" + "---|" * (B + 2)]
    for name, r in results["datasets"].items():
        rows.append(f"| {name} | {r['tau']:.2f} | " + " | ".join(f"{a:.2f}" for a in r["slot_acceptance"])
                    + f" | {r['steps']} |")
    tops = [(name, k, rates) for name, r in results["datasets"].items() for k, rates in r.get("topk_hits", {}).items()]
    if tops:  # teacher-forced: the target's token among the draft's k best, per slot
        rows += ["", "| dataset | top-k | " + " | ".join(f"slot {k}" for k in range(1, B)) + " |",
                 "|" + "---|" * (B + 1)]
        rows += [f"| {name} | {k} | " + " | ".join(f"{a:.2f}" for a in rates) + " |" for name, k, rates in tops]
    splits = [(name, r["copy_split"]) for name, r in results["datasets"].items() if "copy_split" in r]
    if splits:  # teacher-forced top-1 over the tokens prompt lookup guesses from the text before them, and the rest
        rows += ["", "| dataset | tokens | share | " + " | ".join(f"slot {k}" for k in range(1, B)) + " |",
                 "|" + "---|" * (B + 2)]
        rows += [f"| {name} | {kind} | {share:.2f} | " + " | ".join(f"{a:.2f}" for a in split[kind]) + " |"
                 for name, split in splits
                 for kind, share in (("copy", split["copy_share"]), ("novel", 1 - split["copy_share"]))]
    kinds = [(name, r["by_category"]) for name, r in results["datasets"].items() if r.get("by_category")]
    if kinds:
        rows += ["", "| dataset | category | τ | prompts |", "|---|---|---|---|"]
        rows += [f"| {name} | {cat} | {c['tau']:.2f} | {c['prompts']} |" for name, cats in kinds
                 for cat, c in cats.items()]
    return "\n".join(rows)


def run_evaluate(target, tokenizer, draft, cfg: EvalConfig, out: str | None, extra: dict | None = None) -> dict:
    """The command: evaluates, prints the table, writes results.json and slot_acceptance.png into `out`, ends
    stdout with one JSON line."""
    from .machine import hardware

    from .generate import default_stop_token_ids
    from .prompts import pad_id_for

    sets = eval_prompt_sets(cfg)
    results = evaluate_draft(target, draft, encoded_eval_sets(tokenizer, cfg, sets), cfg,
                             pad_id=pad_id_for(tokenizer, default_stop_token_ids(target)))
    for name, prompts in sets.items():
        by_category = tau_by_category(results["datasets"][name]["per_prompt"],
                                      [p.meta.get("category") for p in prompts])
        if by_category:  # the set's prompts name their kinds
            results["datasets"][name]["by_category"] = by_category
    results.update({"config": asdict(cfg), "hardware": hardware(target.device), **(extra or {})})
    print(format_table(results))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out) / "results.json", json.dumps(results, indent=2) + "\n")
        plot_slot_acceptance(results, Path(out) / "slot_acceptance.png")
        print(f"dflash evaluate: wrote {out}/results.json and slot_acceptance.png", file=sys.stderr)
    print(json.dumps({"mean_tau": round(results["mean_tau"], 4), "block_size": results["block_size"],
                      **{f"tau_{k}": round(r["tau"], 4) for k, r in results["datasets"].items()}}))
    return results
