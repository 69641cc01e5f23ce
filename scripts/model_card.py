"""Writes the model card of a trained draft from its runs' own records (nothing typed by hand).

    python scripts/model_card.py --train RUN[:LAST_STEP] [--train FINE_TUNE ...] --data DATASET [--data ...] \
        --bench BENCH_OUT [--evaluate EVALUATE_OUT [--versus LABEL=EVALUATE_OUT ...]] [--ablation ABLATION_JSON] \
        --out CARD.md
    python scripts/model_card.py --earlier-card CARD.md --data DATASET [--data ...] [--bench BENCH_OUT] \
        [--evaluate EVALUATE_OUT [--versus LABEL=EVALUATE_OUT ...]] --out NEW_CARD.md

Several --train runs are stages in order, each one starting from the previous (`--init-draft`); LAST_STEP
says where a stage was cut (its checkpoint that the next stage started from). When the first run started from
a shipped draft whose own runs are no longer at hand, --earlier-card takes that draft's card: its stages are
carried over as it recorded them. --versus sets another draft's evaluation on the same held-out sets beside this
one's, per set with the ratio of the two τ (the peer's card against the DFlash draft of equal training compute).
With --earlier-card and no --train, the card is that same draft's, measured again: its draft and training sections
are carried over as they stand (their runs may be gone), the rest is made anew (its benchmark too, given --bench).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


BENCH = "Benchmark (`dflash bench`)"
CARRIED = "As the card before this one had it, run with the drafts shipped then."
KINDS = {"dflash": "DFlash draft", "eagle3": "EAGLE-3-style drafter (the bench's peer)"}


def stage(spec: str) -> dict:
    """A training run's settings, optimizer steps, wall time (over all its sittings) and last held-out tau,
    counting its log only up to LAST_STEP."""
    path, _, cut = spec.partition(":")
    run = Path(path)
    cfg = json.loads((run / "train_config.json").read_text())
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    if cut:
        log = [e for e in log if e["step"] <= int(cut)]
    steps = [e for e in log if "loss" in e]
    taus = [e for e in log if "eval_tau" in e]
    # each sitting's clock starts at 0 again: add up the last reading of every sitting
    wall, prev = 0.0, 0.0
    for e in steps:
        if e["seconds"] < prev:
            wall += prev
        prev = e["seconds"]
    wall += prev
    # a --max-hours run sizes its schedule from its first steps and logs the size it chose
    sized = [e["calibrated_total_steps"] for e in log if "calibrated_total_steps" in e]
    if sized and cfg.get("schedule"):
        cfg["schedule"]["total_steps"] = sized[-1]
    return {"cfg": cfg, "steps": steps[-1]["step"] if steps else 0, "wall": wall,
            "loss": steps[-1]["loss"] if steps else float("nan"), "tau": taus[-1]["eval_tau"] if taus else float("nan")}


def data_counts(folder: Path) -> tuple[int, int]:
    """(answers, answer tokens) of a regenerated or a packed (`dflash pack`) dataset folder."""
    packed = sorted(folder.glob("packed-*.safetensors"))
    if packed:
        from safetensors import safe_open

        n = t = 0
        for f in packed:
            with safe_open(str(f), "pt") as fh:
                n += len(json.loads(fh.metadata()["records"]))
                t += int(fh.get_tensor("answer_offsets")[-1])
        return n, t
    n = t = 0
    for shard in sorted(folder.glob("shard-*.jsonl")):
        for line in shard.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                r = json.loads(line)
                if r.get("kind") is None:
                    n += 1
                    t += sum(r["loss_mask"])
    return n, t


def ablation_lines(path: Path) -> list[str]:
    """The recipe comparison table of scripts/ablation_table.py's JSON."""
    from ablation_table import table_lines  # it imports this module's stage(): imported here, not at the top

    return table_lines(json.loads(path.read_text()))


def earlier_stages(text: str, card: Path) -> tuple[list[str], int, float]:
    """The stage lines of a draft's card (its text), and its total optimizer steps and hours of training. A card
    from before the stage lines said what they trained on says it of its first stage in its data section: that
    count moves into the first stage's line (and its threads into every stage's)."""
    lines = [line for line in text.splitlines() if line.startswith("- Stage ")]
    total = re.search(r"^- In all (\d+) steps and ([\d.]+) h of training", text, re.M)
    if not lines or total is None:
        raise SystemExit(f"{card} has no training stages to carry over")
    used = re.search(r"Training used (\d+) of them and held out (\d+)\.", text)
    if used is not None:
        lines[0] = re.sub(r"^(- Stage 1, from [^:]*):", rf"\1, on {used.group(1)} answers ({used.group(2)} held out):",
                          lines[0])
    # and its threads, for all its stages, in its total line
    threads = re.search(r"^- In all .* training \(target dtype [^,]*, (\d+) threads,", text, re.M)
    if threads is not None:
        lines = [re.sub(r" h of wall time(?! on)", f" h of wall time on {threads.group(1)} thread(s)", line)
                 for line in lines]
    return lines, int(total.group(1)), float(total.group(2))


def section(text: str, title: str) -> list[str]:
    """The lines of a card's `## title` section (without its heading and trailing blank lines)."""
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line == f"## {title}"), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = lines[start:end]
    while body and not body[-1].strip():
        body.pop()
    return body


def merged_comparison(earlier: list[str], new: list[str]) -> list[str]:
    """An earlier card's recipe comparison (header, rule, rows) followed by the rows of a new one, where the runs
    it names are not in the earlier table already; the rows of runs no longer at hand so stay in the card. A
    column the earlier table lacks (added to the table since) is left empty in its rows; a column the new one
    lacks is an error."""
    if not earlier or not new:
        return earlier or new
    cells = lambda row: [c.strip() for c in row.split("|")[1:-1]]  # noqa: E731
    old_cols, new_cols = cells(earlier[0]), cells(new[0])
    if set(old_cols) - set(new_cols):
        raise SystemExit("the earlier card's recipe comparison has columns this one lacks: "
                         f"{sorted(set(old_cols) - set(new_cols))}")
    rows = [dict(zip(old_cols, cells(row))) for row in earlier[2:]]
    earlier = new[:2] + ["| " + " | ".join(r.get(c, "") for c in new_cols) + " |" for r in rows]
    names = {r["run"] for r in rows}
    return earlier + [row for row in new[2:] if row.split("|")[1].strip() not in names]


def renamed_starts(table: list[str], starts: dict[str, str]) -> list[str]:
    """The comparison with the start column of the named runs set by hand: a run started from a folder whose
    draft has since been replaced (the package's, shipped again) names that folder, not the draft it held then.
    A run the table does not hold is an error."""
    if not starts:
        return table
    col = [c.strip() for c in table[0].split("|")].index("start") if table else 0
    out, seen = table[:2], set()
    for row in table[2:]:
        cells = row.split("|")
        run = cells[1].strip()
        if run in starts:
            cells[col], seen = f" {starts[run]} ", seen | {run}
        out.append("|".join(cells))
    if set(starts) - seen:
        raise SystemExit(f"--start-of: no run {sorted(set(starts) - seen)} in the recipe comparison")
    return out


def versus_lines(ours: dict, label: str, theirs: dict) -> list[str]:
    """Another draft's held-out τ beside this one's (two `dflash evaluate` results.json), per set and as the ratio;
    evaluations of other prompts, lengths, widths or prompt lookup are not comparable: an error that names the
    difference."""
    from dflash.evaluate import check_comparable, paired_tau_difference

    try:
        check_comparable(ours, theirs)
    except ValueError as e:
        raise SystemExit(f"--versus {label}: {e} (this draft's first)") from None
    # both evaluations with their per-prompt counts: the ratio's 95% interval over the prompts (compare_evaluations.py)
    paired = all("per_prompt" in r for res in (ours, theirs) for r in res["datasets"].values())
    sets = paired_tau_difference(ours, theirs)["datasets"] if paired else {}
    lines = [f"| dataset | τ, this draft | τ, {label} | {label} / this |" + (" 95% interval |" if paired else ""),
             "|---|---|---|---|" + ("---|" if paired else "")]
    for name, mine in ours["datasets"].items():
        other = theirs["datasets"][name]["tau"]
        interval = f" {sets[name]['ratio_low']:.2f}-{sets[name]['ratio_high']:.2f}x |" if paired else ""
        lines.append(f"| {name} | {mine['tau']:.2f} | {other:.2f} | {other / mine['tau']:.2f}x |{interval}")
    return lines


def averaged_runs(spec: str) -> tuple[list[str], list[float]] | None:
    """The training runs and weights of a `dflash average` folder (its drafts are runs' finals), else None."""
    record = Path(spec.partition(":")[0]) / "average.json"
    if not record.is_file():
        return None
    if ":" in spec:
        raise SystemExit(f"--train {spec}: an averaged draft has no steps to cut at")
    rec = json.loads(record.read_text())
    runs = [Path(d) for d in rec["drafts"]]
    if any(r.name != "final" or not (r.parent / "train_config.json").is_file() for r in runs):
        raise SystemExit(f"--train {spec}: the average is not of training runs' finals ({rec['drafts']})")
    return [str(r.parent) for r in runs], rec["weights"]


def runs_of(spec: str) -> list[str]:
    """The training runs behind a --train spec: the runs a `dflash average` folder averaged, else the run itself."""
    averaged = averaged_runs(spec)
    return averaged[0] if averaged else [spec]


def sequences_per_step(cfg: dict) -> int:
    """Answers per optimizer step, over accumulation and processes."""
    return cfg.get("batch_size", 1) * cfg.get("grad_accum", 1) * cfg.get("world_size", 1)


def stage_text(s: dict) -> str:
    """What one run of a stage trained on, how, for how long, and what it reached."""
    c = s["cfg"]
    eagle = c.get("method") == "eagle3"
    # the chain's loss weighs unrolled step i by 0.8^i (dflash.eagle); gamma is DFlash's block-slot decay
    loss = (f"{c.get('ttt_steps') or c['block_size'] - 1} training-time-test steps" if eagle else
            f"block size {c['block_size']}, gamma {c['gamma']:.2f}")
    schedule = c.get("schedule") or {}
    measured = (f"{c.get('eval_prompts')} test prompts per set, {c.get('eval_max_new_tokens')} new tokens"
                if c.get("eval_datasets") else f"{c['eval_records']} held-out training answers")
    span = (f"cosine over {schedule['total_steps']} steps, a {schedule['max_hours']} h budget"
            if schedule.get("max_hours") else
            f"cosine over {c['total_steps']} steps" if c.get("schedule_steps") else
            f"cosine over {c['epochs']} epoch(s) of {c['total_steps'] // c['epochs']} steps")
    return (f"on {c['train_records']} answers ({c['eval_records']} held out): {loss}, "
            f"{c['num_anchors']} anchors per sequence, {sequences_per_step(c)} sequences per step, lr {c['lr']} "
            f"({span}), max length {c['max_length']}: {s['steps']} optimizer steps, "
            f"{s['wall'] / 3600:.2f} h of wall time on {c['threads']} thread(s), last loss {s['loss']:.3f}, "
            f"held-out tau {s['tau']:.2f} ({measured})")


def trained_sections(train: list[str], earlier: str, earlier_card: str | None) -> tuple[str, list[str], list[str]]:
    """The card's title, its draft section and its training section, from the training runs (the stages of an
    earlier card before them). A stage given as a `dflash average` folder is the runs it averaged, side by side."""
    groups = []  # per stage: its runs' records, and the average's weights (None: one run)
    for spec in train:
        averaged = averaged_runs(spec)
        groups.append(([stage(r) for r in averaged[0]], averaged[1]) if averaged else ([stage(spec)], None))
    before, before_steps, before_hours = earlier_stages(earlier, Path(earlier_card)) if earlier else ([], 0, 0.0)
    first = groups[0][0][0]["cfg"]
    last = Path(train[-1].partition(":")[0])
    final = (last if groups[-1][1] else last / "final") / "config.json"
    draft_cfg = json.loads(final.read_text())
    from safetensors import safe_open

    proposals = first["draft_vocab_size"] or draft_cfg["vocab_size"]
    tensors = final.parent / "model.safetensors"
    if tensors.is_file():  # a fine-tune keeps the draft vocabulary of the draft it started from
        with safe_open(tensors, "pt") as f:
            if "draft_vocab" in f.keys():
                proposals = f.get_slice("draft_vocab").get_shape()[0]
    eagle = draft_cfg.get("draft_method") == "eagle3"
    shape = (f"a chain of {draft_cfg['block_size'] - 1} proposals per step" if eagle else
             f"block size {draft_cfg['block_size']}, mask token {first['mask_token_id']}")
    title = f"# {KINDS['eagle3' if eagle else 'dflash']} for {first['target']}"
    width = f" of {draft_cfg['intermediate_size']} MLP units" if "intermediate_size" in draft_cfg else ""
    draft = [f"- {draft_cfg['num_hidden_layers']} draft layer(s){width}, {shape}, target layers {first['target_layer_ids']}, "
             f"proposals from the {proposals} most frequent answer tokens."]
    lines = list(before)
    for i, (runs, weights) in enumerate(groups, start=len(before)):
        copied = " (layers copied from the target's last ones)" if runs[0]["cfg"].get("init_from_target") else ""
        start = f"from a fresh draft{copied}" if i == 0 else "from the previous stage"
        if weights is None:
            lines.append(f"- Stage {i + 1}, {start}, {stage_text(runs[0])}.")
        else:
            shares = "/".join(f"{w:.2f}" for w in weights)
            lines.append(f"- Stage {i + 1}, {start}, {len(runs)} runs side by side, their weights then averaged "
                         f"(`dflash average`, weights {shares}): " +
                         "; ".join(f"({chr(97 + j)}) {stage_text(r)}" for j, r in enumerate(runs)) + ".")
    runs = [r for rs, _ in groups for r in rs]
    total = before_hours + sum(s["wall"] for s in runs) / 3600
    lines.append(f"- In all {before_steps + sum(s['steps'] for s in runs)} steps and {total:.2f} h of training "
                 f"(target dtype {first['dtype']}, {first['device'] or 'cpu'}).")
    return title, draft, lines


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--train", action="append", default=[],
                    help="a `dflash train` output folder, optionally :LAST_STEP; repeat for fine-tuning stages")
    ap.add_argument("--data", required=True, action="append",
                    help="a `dflash regenerate` (or `dflash pack`) dataset folder; repeat for several")
    ap.add_argument("--bench", help="the `dflash bench` output folder (needed with --train)")
    ap.add_argument("--out", required=True, help="where to write the card")
    ap.add_argument("--earlier-card", help="card of the draft the first --train run started from; without "
                    "--train, the card of the same draft, whose draft and training sections are kept")
    ap.add_argument("--evaluate", help="a `dflash evaluate --out` folder: the held-out table and per-slot plot")
    ap.add_argument("--versus", action="append", default=[], metavar="LABEL=EVALUATE_OUT",
                    help="another draft's `dflash evaluate --out` folder on the same sets, set beside this one's")
    ap.add_argument("--ablation", help="scripts/ablation_table.py's ablation.json: the recipe comparison")
    ap.add_argument("--start-of", action="append", default=[], metavar="RUN=START",
                    help="what the comparison's run RUN started from, where its record names a folder that holds "
                    "another draft now (the package's)")
    args = ap.parse_args()
    if not args.train and not args.earlier_card:
        ap.error("--train is needed, or --earlier-card alone for a new card of that same draft")
    if args.train and not args.bench:
        ap.error("--bench is needed with --train: a newly trained draft has no benchmark yet")
    if args.versus and not args.evaluate:
        ap.error("--versus compares with this draft's --evaluate: give it")
    if any("=" not in v for v in args.versus):
        ap.error("--versus takes LABEL=EVALUATE_OUT")
    if any("=" not in v for v in args.start_of):
        ap.error("--start-of takes RUN=START")
    earlier = Path(args.earlier_card).read_text() if args.earlier_card else ""
    data_lines, n_samples, n_tokens = [], 0, 0
    for folder in map(Path, args.data):
        manifest = json.loads((folder / "manifest.json").read_text())["settings"]
        n, t = data_counts(folder)
        n_samples, n_tokens = n_samples + n, n_tokens + t
        data_lines.append(f"- `{folder.name}`: {n} answers ({t} answer tokens) written by the target itself "
                          f"(`dflash regenerate`, temperature {manifest['temperature']}, up to "
                          f"{manifest['max_new_tokens']} new tokens) for the prompt sets "
                          f"{', '.join(Path(x).name if '/' in x else x for x in manifest['sources'])}.")
    if len(data_lines) > 1:
        data_lines.append(f"- In all {n_samples} answers ({n_tokens} answer tokens).")
    if args.train:
        title, draft_lines, training_lines = trained_sections(args.train, earlier, args.earlier_card)
    else:  # the same draft measured again: what it is and how it was trained stand as its card says
        title, draft_lines = earlier.splitlines()[0], section(earlier, "Draft")
        training_lines = section(earlier, "Training")
        if not draft_lines or not training_lines:
            raise SystemExit(f"{args.earlier_card} has no draft and training sections to carry over")
    if args.bench:  # the table without the final JSON line (results.json holds the same numbers)
        bench = ["```", *(line for line in (Path(args.bench) / "table.txt").read_text().strip().splitlines()
                          if not line.startswith("{")), "```"]
    else:  # the drafts it ran may since have changed (the DFlash draft beside a peer): said once
        bench = section(earlier, BENCH)
        if bench and bench[0] != CARRIED:
            bench = [CARRIED, "", *bench]
    lines = [
        title,
        "",
        "Generated by `scripts/model_card.py` from the training runs, their data and the benchmark.",
        "",
        "## Data",
        *data_lines,
        "- Training splits and prompt sets only; each stage below says how many of these answers it trained on.",
        "",
        "## Draft",
        *draft_lines,
        "",
        "## Training",
        *training_lines,
        "",
    ]
    if args.evaluate:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        import shutil

        from dflash.evaluate import format_table

        results = json.loads((Path(args.evaluate) / "results.json").read_text())
        shutil.copy(Path(args.evaluate) / "slot_acceptance.png", Path(args.out).parent / "slot_acceptance.png")
        cfg = results["config"]
        lines += ["## Held-out evaluation (`dflash evaluate`)",
                  f"Greedy, block {results['block_size']}, fixed width, {cfg['num_prompts']} test prompts per set, "
                  f"{cfg['max_new_tokens']} new tokens, {results['hardware']}. τ, and per block slot the share of "
                  "steps that accepted it among those that accepted every slot before it:", "",
                  format_table(results), "", "![per-slot acceptance](slot_acceptance.png)", ""]
        for label, _, folder in (v.partition("=") for v in args.versus):
            theirs = json.loads((Path(folder) / "results.json").read_text())
            lines += [f"## Against {label} (the same evaluation)", *versus_lines(results, label, theirs), ""]
    # the earlier card's comparison rows stay: the runs behind them may be gone (another machine, an older stop)
    recipe = "Recipe comparison (`scripts/ablation_table.py`)"
    comparison = merged_comparison(section(earlier, recipe), ablation_lines(Path(args.ablation)) if args.ablation else [])
    comparison = renamed_starts(comparison, dict(v.split("=", 1) for v in args.start_of))
    if comparison:
        lines += [f"## {recipe}", *comparison, ""]
    if bench:
        lines += [f"## {BENCH}", *bench, ""]
    Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
