"""Whether one draft is accepted more than another, or only seems to be: two `dflash evaluate` outputs of the same
held-out prompts, τ per set and averaged, the difference and its 95% bootstrap interval over the prompts (paired:
both drafts answered the same prompts). A markdown table and one JSON line (which also holds the ratio of the two
τ with its interval, what `scripts/model_card.py --versus` shows).

    python scripts/compare_evaluations.py runs/eval-stage6 runs/eval-stage7 [--resamples 10000]

The interval speaks of the choice of prompts only; another training seed of the same recipe moves a draft too,
which only more runs measure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dflash.evaluate import paired_tau_difference  # noqa: E402


def read(path: str) -> dict:
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    if not p.is_file():
        raise SystemExit(f"{path}: no results.json of `dflash evaluate --out` there")
    return json.loads(p.read_text())


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("base", help="`dflash evaluate --out` folder (or its results.json) of the draft compared against")
    ap.add_argument("other", help="the same of the draft compared")
    ap.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = ap.parse_args()
    try:
        d = paired_tau_difference(read(args.base), read(args.other), args.resamples, args.seed)
    except ValueError as e:
        raise SystemExit(f"{args.base} against {args.other}: {e}") from None
    print(f"| set | τ, {Path(args.base).name} | τ, {Path(args.other).name} | difference | 95% interval | "
          "resamples ≤ 0 | prompts |")
    print("|---|---|---|---|---|---|---|")
    for name, r in [*d["datasets"].items(), ("mean", d["mean"])]:
        print(f"| {name} | {r['base']:.3f} | {r['other']:.3f} | {r['difference']:+.3f} | "
              f"[{r['low']:+.3f}, {r['high']:+.3f}] | {r['share_not_above_zero']:.3f} | {r.get('prompts', '')} |")
    print(json.dumps({"base": args.base, "other": args.other, **d}))


if __name__ == "__main__":
    main()
