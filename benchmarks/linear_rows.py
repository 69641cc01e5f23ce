"""What a linear layer costs for 1, 2, 4, 8 and 16 rows, per kernel, on this machine.

Speculative decoding pays off only while verifying a block of rows costs little more than decoding one; that
is a property of the matmul kernels on the hardware, not of the draft. This times the target's own layer
shapes (q/k/v, gate/up, down, LM head) with each kernel the runtimes use: fp32 `F.linear`, bf16 (prepacked
for oneDNN where the CPU allows it, else `F.linear`), and the int8 / int4 weight-only kernels (int4: PyTorch's and, with AVX-512 VNNI, dflash's). Prints a table
of microseconds and the cost of M rows over one row, and ends with one JSON line.

    python benchmarks/linear_rows.py [--model smollm2-135m-instruct] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dflash import kernels
from dflash.fast import Int4Weight, Int8Weight
from dflash.loading import DEFAULT_MODEL, hardware, load_target

ROWS = (1, 2, 4, 8, 16)


def seconds(fn, min_time: float = 0.2) -> float:
    """Median seconds per call over repeats that together take about min_time."""
    for _ in range(3):
        fn()
    t = time.perf_counter()
    fn()
    n = max(3, int(min_time / max(time.perf_counter() - t, 1e-7)))
    laps = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(max(1, n // 5)):
            fn()
        laps.append((time.perf_counter() - t) / max(1, n // 5))
    return statistics.median(laps)


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target whose layer shapes are timed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    c = load_target(args.model, device="cpu", threads=args.threads)[0].config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shapes = {  # [out, in] of the fused projections the fast runtime multiplies by
        "qkv": (head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads), c.hidden_size),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }
    g = torch.Generator().manual_seed(0)
    results = {}
    with torch.inference_mode():
        for name, (n_out, n_in) in shapes.items():
            w = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
            wb = w.bfloat16()
            kernels_ = {
                "fp32": lambda x, w=w: F.linear(x.float(), w),
                "bf16" + (" packed" if kernels.packable(wb) else ""): lambda x, wb=wb: kernels.linear(x, wb),
                "int8": lambda x, q=Int8Weight(wb): q.linear(x, None),
            }
            if n_in % 32 == 0:
                kernels_["int4 torch"] = lambda x, q=Int4Weight(wb, ours=False): q.linear(x, None)
                if kernels.int4_kernel():
                    kernels_["int4 dflash"] = lambda x, q=Int4Weight(wb, ours=True): q.linear(x, None)
            xs = {m: torch.randn(m, n_in, generator=g).bfloat16() for m in ROWS}
            for kname, fn in kernels_.items():
                us = [1e6 * seconds(lambda: fn(xs[m])) for m in ROWS]
                results.setdefault(name, {})[kname] = {"us": [round(u, 1) for u in us],
                                                       "ratio_to_1_row": [round(u / us[0], 2) for u in us]}
    print(f"{'shape':8s} {'kernel':12s} " + " ".join(f"{f'{m} row us':>10s}" for m in ROWS) + "   "
          + " ".join(f"{f'x{m}':>5s}" for m in ROWS[1:]))
    for name, per in results.items():
        for kname, r in per.items():
            print(f"{name:8s} {kname:12s} " + " ".join(f"{u:10.1f}" for u in r["us"]) + "   "
                  + " ".join(f"{x:5.2f}" for x in r["ratio_to_1_row"][1:]))
    print(json.dumps({"model": args.model, "hardware": hardware("cpu"), "threads": torch.get_num_threads(),
                      "rows": ROWS, "shapes": {k: list(v) for k, v in shapes.items()}, "results": results}))


if __name__ == "__main__":
    main()
