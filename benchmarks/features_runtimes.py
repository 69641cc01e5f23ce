"""What `dflash features --runtime` costs and changes: the feature cache of the same answers computed by each
runtime, side by side in one process, against the model's own forward (`hf`).

Every runtime writes the tapped states and the top-k next tokens of the first --num-records answers of --data
into a fresh temporary folder through `dflash.train.compute_features` (the code `dflash features` runs), so the
time is what a user pays, adapter set-up included (after one untimed short record per runtime, which builds the
kernels it uses where this machine has not built them yet). `hf` runs the target in --hf-dtype (the training
precision on a CPU), a lean runtime in --dtype (how `dflash generate` loads it). Agreement is per answer: the relative L2
difference of the states against `hf`'s, and how often the top-1 next token is the same. Prints a table and ends
with one JSON line.

    python benchmarks/features_runtimes.py --data data/smollm2-135m-instruct/self-answers --num-records 24 \
        --runtimes hf,auto --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflash.config import default_target_layer_ids
from dflash.dataset import read_dataset
from dflash.fast import RUNTIMES, resolve_runtime
from dflash.loading import DEFAULT_MODEL, load_target
from dflash.machine import hardware
from dflash.train import FeatureStore, compute_features


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target model")
    ap.add_argument("--data", nargs="+", default=["data/smollm2-135m-instruct/self-answers"],
                    help="answer folders (regenerated or packed)")
    ap.add_argument("--num-records", type=int, default=24, help="answers to compute features for")
    ap.add_argument("--max-length", type=int, default=1536, help="tokens per answer at most")
    ap.add_argument("--num-target-features", type=int, default=3, help="target layers tapped")
    ap.add_argument("--topk", type=int, default=32, help="next tokens kept per position (as --distill-topk)")
    ap.add_argument("--runtimes", default="hf,auto", help="comma-separated; the first is the reference")
    ap.add_argument("--hf-dtype", default="float32", help="dtype of the hf runtime's target")
    ap.add_argument("--dtype", default=None, help="dtype of a lean runtime's target (default: as dflash generate)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    if not runtimes or set(runtimes) - set(RUNTIMES):
        ap.error(f"--runtimes takes a comma-separated list of {', '.join(RUNTIMES)}")

    targets = {}
    for r in runtimes:
        dtype = args.hf_dtype if r == "hf" else args.dtype
        if dtype not in targets:
            targets[dtype] = load_target(args.model, dtype=dtype, threads=args.threads)
    tokenizer = next(iter(targets.values()))[1]
    records = read_dataset(args.data, tokenizer)[:args.num_records]
    tokens = sum(min(len(r["input_ids"]), args.max_length) for r in records)
    n_layers = next(iter(targets.values()))[0].config.get_text_config().num_hidden_layers
    layer_ids = default_target_layer_ids(n_layers, args.num_target_features)

    seconds, made = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in runtimes:
            target = targets[args.hf_dtype if r == "hf" else args.dtype][0]
            name = f"{r} ({resolve_runtime(target, r)})" if r == "auto" else r
            folder = Path(tmp) / r
            # untimed first: a runtime's kernels are compiled on their first use on a machine (tens of seconds),
            # which is not what computing features costs
            compute_features(target, records[:1], layer_ids, Path(tmp) / f"{r}-warm-up", max_length=32,
                             dtype="float32", distill_topk=args.topk, runtime=r, progress=False)
            t = time.perf_counter()
            compute_features(target, records, layer_ids, folder, max_length=args.max_length, dtype="float32",
                             distill_topk=args.topk, runtime=r, progress=False)
            seconds[name] = time.perf_counter() - t
            store = FeatureStore(folder)
            made[name] = [(store.get(i), store.get_topk(i)[0]) for i in range(len(records))]

    ref_name = next(iter(made))
    ref = made[ref_name]  # per record: (states [T, F*H], top-k ids [T, K])
    rows = {}
    for name, got in made.items():
        diff = [((g - r).norm() / r.norm()).item() for (g, _), (r, _) in zip(got, ref)]
        agree = sum((g[:, 0] == r[:, 0]).sum().item() for (_, g), (_, r) in zip(got, ref))
        rows[name] = {"seconds": round(seconds[name], 2), "tokens_per_s": round(tokens / seconds[name], 1),
                      "speedup": round(seconds[ref_name] / seconds[name], 3),
                      "median_relative_difference": round(statistics.median(diff), 5),
                      "top1_agreement": round(agree / tokens, 4)}
    print(f"{len(records)} answers, {tokens} tokens, layers {layer_ids}, {torch.get_num_threads()} threads")
    print(f"{'runtime':24s} {'seconds':>8s} {'tok/s':>8s} {'speed-up':>9s} {'median rel. diff':>17s} "
          f"{'top-1 same':>11s}")
    for name, row in rows.items():
        print(f"{name:24s} {row['seconds']:8.1f} {row['tokens_per_s']:8.1f} {row['speedup']:8.2f}x "
              f"{row['median_relative_difference']:17.4f} {row['top1_agreement']:11.3f}")
    print(json.dumps({"model": args.model, "hardware": hardware(), "threads": torch.get_num_threads(),
                      "records": len(records), "tokens": tokens, "target_layer_ids": layer_ids,
                      "hf_dtype": args.hf_dtype, "dtype": args.dtype, "reference": ref_name, "runtimes": rows}))


if __name__ == "__main__":
    main()
