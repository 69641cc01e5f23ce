"""The recipe comparison, from training runs' own records: per run its data, depth, key/value heads, MLP width, block,
gamma, anchors, start, learning rate, schedule, hours and steps, and the last held-out evaluation (τ per test set, as
`dflash train --eval-datasets` logs it, or, given as RUN=FOLDER, the `dflash evaluate --out FOLDER` of the run's
draft, which can hold more prompts and tokens than a training run affords); a `dflash average` folder of runs'
finals is a row of its own (its runs' hours added up). A markdown table, a plot of mean τ against hours (PNG)
and one JSON line.

    python scripts/ablation_table.py runs/train/r0 runs/train/r1=runs/eval/r1 ... [--out runs/train/ablation]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_card import averaged_runs, sequences_per_step, stage  # noqa: E402  (a run's steps and wall time)


def run_row(arg: str, names: dict[Path, str] | None = None) -> dict:
    """names: the table's name of each run folder (resolved), for the start column."""
    folder, _, evaluated = arg.partition("=")
    folder = Path(folder)
    s = stage(str(folder))
    cfg = s["cfg"]
    log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    evals = [e for e in log if "eval" in e]
    last = evals[-1] if evals else {}
    curve, wall, prev = [], 0.0, 0.0  # mean τ against hours of training
    for e in log:
        if "seconds" in e:
            if e["seconds"] < prev:
                wall += prev
            prev = e["seconds"]
        if "eval_tau" in e:
            curve.append(((wall + prev) / 3600, e["eval_tau"]))
    tau, mean, source = {k: v["tau"] for k, v in last.get("eval", {}).items()}, last.get("eval_tau"), "training log"
    if evaluated:
        tau, mean, source = evaluation(evaluated)
    saved = saved_draft(folder)
    return {"run": folder.name, "method": cfg.get("method", "dflash"), "data": cfg["train_records"],
            "depth": saved.get("num_hidden_layers", cfg["num_layers"]), "kv": saved.get("num_key_value_heads", ""),
            "mlp": saved.get("intermediate_size", ""),
            "block": cfg["block_size"], "gamma": round(cfg["gamma"], 2), "anchors": cfg["num_anchors"],
            "batch": sequences_per_step(cfg),
            "distill": cfg.get("distill", 0.0),
            # what the hours bought: the target run live or its features read from a cache, the step compiled or not
            "step_kind": ("cached" if cfg.get("features") else "live") + (", compiled" if cfg.get("compile") else ""),
            "start": "target layers" if cfg.get("init_from_target") else start_name(cfg.get("init_draft"), names),
            "lr": cfg["lr"], "schedule": cfg.get("schedule", {}), "hours": round(s["wall"] / 3600, 2),
            "steps": s["steps"], "tau": tau, "mean_tau": mean, "evaluation": source, "curve": curve}


def evaluation(folder: str) -> tuple[dict, float, str]:
    """τ per set, mean τ and what measured them, from a `dflash evaluate --out` folder."""
    res = json.loads((Path(folder) / "results.json").read_text())
    c = res["config"]
    return ({k: v["tau"] for k, v in res["datasets"].items()}, res["mean_tau"],
            f"evaluate {c['num_prompts']}×{c['max_new_tokens']}, block {res['block_size']}")


def averaged_row(arg: str, names: dict[Path, str] | None = None) -> dict | None:
    """The row of a `dflash average` folder: its runs' settings (a/b where they differ), their hours and steps
    added up (both were paid for), and τ from the average's own evaluation (none without one); None for a folder
    that is not an average."""
    folder, _, evaluated = arg.partition("=")
    averaged = averaged_runs(folder)
    if averaged is None:
        return None
    runs, _ = averaged
    rows = [run_row(r, names) for r in runs]
    row = {k: rows[0][k] if all(r[k] == rows[0][k] for r in rows) else "/".join(str(r[k]) for r in rows)
           for k in rows[0]}
    row.update(run=Path(folder).name, hours=round(sum(r["hours"] for r in rows), 2),
               steps=sum(r["steps"] for r in rows), curve=[], tau={}, mean_tau=None, evaluation="")
    if evaluated:
        row["tau"], row["mean_tau"], row["evaluation"] = evaluation(evaluated)
    return row


def start_name(init_draft: str | None, names: dict[Path, str] | None = None) -> str:
    """A run started from another run's draft (<run>/final) is named by that run: by the name the table gives
    that folder where it is a row of the table too (a link to it names it), else by the folder's own name."""
    if not init_draft:
        return "fresh"
    p = Path(init_draft)
    if p.name != "final":
        return init_draft
    return (names or {}).get(p.parent.resolve(), p.parent.name)


def saved_draft(folder: Path) -> dict:
    """The config of the run's last saved draft (final, else the latest checkpoint; {} where neither is at hand):
    its depth, key/value heads and MLP width, which a stage started from another draft has from that draft, not from
    its own --num-layers / --num-kv-heads / --intermediate-size."""
    latest = folder / "latest"
    for draft in (folder / "final", folder / latest.read_text().strip() if latest.exists() else None):
        if draft is not None and (draft / "config.json").exists():
            return json.loads((draft / "config.json").read_text())
    return {}


# what a row of an ablation.json written before a column existed ran with
OLD_ROW_DEFAULTS = {"method": "dflash", "kv": "", "mlp": "", "batch": 1, "distill": 0.0, "step_kind": "live",
                    "evaluation": "training log"}


def table_lines(rows: list[dict]) -> list[str]:
    """The comparison as a markdown table (also the model card's)."""
    sets = sorted({k for r in rows for k in r["tau"]})
    head = ["run", "drafter", "records", "depth", "kv heads", "mlp units", "block", "γ", "anchors", "sequences/step",
            "distill", "start", "lr", "step", "hours", "steps", *sets, "mean τ", "τ from"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        r = {**OLD_ROW_DEFAULTS, **r}
        taus = [f"{r['tau'][k]:.2f}" if k in r["tau"] else "" for k in sets]
        mean = f"{r['mean_tau']:.2f}" if r["mean_tau"] is not None else ""
        cells = [r["run"], r["method"], r["data"], r["depth"], r["kv"], r["mlp"], r["block"], r["gamma"], r["anchors"],
                 r["batch"], r["distill"], r["start"], r["lr"], r["step_kind"], r["hours"], r["steps"], *taus, mean,
                 r["evaluation"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="`dflash train` output folders, each optionally =its `dflash evaluate` folder")
    ap.add_argument("--out", default=None, help="folder for ablation.png and ablation.json")
    args = ap.parse_args(argv)
    folders = [Path(r.partition("=")[0]) for r in args.runs]
    names = {f.resolve(): f.name for f in folders}
    rows = [averaged_row(r, names) or run_row(r, names) for r in args.runs]
    print("\n".join(table_lines(rows)))
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from dflash.io import atomic_write_text, save_png

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for r in rows:
            if r["curve"]:
                ax.plot(*zip(*r["curve"]), marker="o", label=r["run"])
        ax.set_xlabel("hours of training")
        ax.set_ylabel("held-out τ (mean over sets)")
        ax.legend(fontsize=8)
        save_png(fig, out / "ablation.png", dpi=100)
        atomic_write_text(out / "ablation.json", json.dumps(rows, indent=2) + "\n")
    print(json.dumps({r["run"]: r["mean_tau"] for r in rows}))
    return rows


if __name__ == "__main__":
    main()
