"""What a linear layer costs for 1, 2, 4, 8 and 16 rows, per kernel, on this machine.

Speculative decoding pays off only while verifying a block of rows costs little more than decoding one; that
is a property of the matmul kernels on the hardware, not of the draft. This times the target's own layer
shapes (q/k/v, gate/up, down, LM head) with each kernel the runtimes use: fp32 `F.linear`, bf16 (prepacked
for oneDNN where the CPU allows it, else `F.linear`), and the int8 / int4 weight-only kernels (int8: PyTorch's per row and dflash's Q8_0; int4: PyTorch's
and each build of dflash's this CPU runs: AVX-512 VNNI, AVX2). Then the same for all the decoder layers' products with each layer's own
weights, which is what a step streams from memory (the per-shape figures reuse one weight from cache), and one
layer's attention on dflash's kernel with the rows as a step's queries over --context cached slots. Prints a
table of microseconds and the cost of M rows over one row, and ends with one JSON line.

    python benchmarks/linear_rows.py [--model smollm2-135m-instruct] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dflash import kernels, machine
from dflash.fast import Int4Weight, Int8Weight
from dflash.loading import DEFAULT_MODEL, load_target
from dflash.machine import hardware

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


def _products(w: torch.Tensor, fp32: bool = True) -> dict:
    """kernel name -> x -> x @ w.T, for each kernel the runtimes use (w [out, in] fp32)."""
    wb = w.bfloat16()
    out = {"fp32": lambda x: F.linear(x.float(), w)} if fp32 else {}
    # as the fast runtime multiplies a bf16 weight: packed for oneDNN where the CPU allows it, else F.linear (a
    # draft's kernels.linear would take Q8_0 there)
    packed = kernels.packed_weight(wb) if kernels.packable(wb) else None
    out["bf16" + (" packed" if packed else "")] = lambda x: packed.linear(x, None) if packed else F.linear(x, wb)
    out["int8"] = lambda x, q=Int8Weight(wb): q.linear(x, None)
    if kernels.Q8Weight.fits(wb):  # Q8_0 on dflash's kernel (the int4 runtime's LM head)
        out["q8_0 dflash"] = lambda x, q=kernels.Q8Weight(wb): q.linear(x, None)
    if w.shape[1] % 32 == 0:
        out["int4 torch"] = lambda x, q=Int4Weight(wb, ours=False): q.linear(x, None)
        if kernels.int4_kernel() and w.shape[0] % 16 == 0:
            q4 = Int4Weight(wb, ours=True)
            flags = machine.cpu_flags() or set()
            for build, (needs, _) in kernels.INT4_BUILDS.items():  # each build this CPU runs (same bits)
                if needs <= flags and kernels._int4_build(build) is None:
                    out[f"int4 {build}"] = lambda x, op=kernels.int4_op(build), q=q4: op(x, q.qweight, q.scales)
    return out


def _timed(fn) -> dict:
    us = [1e6 * seconds(lambda: fn(m)) for m in ROWS]
    return {"us": [round(u, 1) for u in us], "ratio_to_1_row": [round(u / us[0], 2) for u in us]}


def main():
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target whose layer shapes are timed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--context", type=int, default=300, help="cached slots that a step's queries attend to")
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
            products = _products(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5)
            xs = {m: torch.randn(m, n_in, generator=g).bfloat16() for m in ROWS}
            for kname, fn in products.items():
                results.setdefault(name, {})[kname] = _timed(lambda m: fn(xs[m]))
        # a whole step's products, every layer's own weights: what streams from memory once per step
        layer_shapes = [shapes["qkv"], (c.hidden_size, c.num_attention_heads * head_dim), shapes["gate_up"],
                        shapes["down"]]
        stack = [(n_in, _products(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5, fp32=False))
                 for _ in range(c.num_hidden_layers) for n_out, n_in in layer_shapes]
        xs = {m: {n: torch.randn(m, n, generator=g).bfloat16() for n in {n for n, _ in stack}} for m in ROWS}
        for kname in stack[0][1]:
            results.setdefault(f"{c.num_hidden_layers} layers", {})[kname] = _timed(
                lambda m: [fns[kname](xs[m][n_in]) for n_in, fns in stack])
        # the output layer as a step meets it, streamed from memory (two copies taken in turn, each larger than a
        # CPU's cache), on the int4 runtime's Q8_0 kernel
        n_out, n_in = shapes["lm_head"]
        if "q8_0 dflash" in results["lm_head"]:  # the Q8_0 kernel runs here (and fits the head's shape)
            heads = [kernels.Q8Weight(torch.randn(n_out, n_in, generator=g).bfloat16() / n_in ** 0.5) for _ in range(2)]
            xh = {m: torch.randn(m, n_in, generator=g).bfloat16() for m in ROWS}
            both = _timed(lambda m: [h.linear(xh[m], None) for h in heads])
            results["lm_head from memory"] = {"q8_0 dflash": {"us": [round(u / 2, 1) for u in both["us"]],
                                                              "ratio_to_1_row": both["ratio_to_1_row"]}}
        # a layer's attention over --context cached slots on dflash's kernel, the m rows being the step's queries
        if kernels.cache_attention_kernel():
            qs = {m: torch.randn(1, c.num_attention_heads, m, head_dim, generator=g).bfloat16() for m in ROWS}
            kv = [torch.randn(1, c.num_key_value_heads, args.context + max(ROWS), head_dim, generator=g).bfloat16()
                  for _ in range(2)]

            def attention(m):
                T = args.context + m
                visible = torch.ones(1, m, T, dtype=torch.bool)
                visible[0, :, args.context:] = torch.ones(m, m, dtype=torch.bool).tril()
                return torch.ops.dflash_attn.cache_attention(qs[m], kv[0][:, :, :T], kv[1][:, :, :T], visible,
                                                             head_dim ** -0.5)
            results["attention"] = {f"dflash {args.context} slots": _timed(attention)}
    print(f"{'shape':10s} {'kernel':16s} " + " ".join(f"{f'{m} row us':>10s}" for m in ROWS) + "   "
          + " ".join(f"{f'x{m}':>5s}" for m in ROWS[1:]))
    for name, per in results.items():
        for kname, r in per.items():
            print(f"{name:10s} {kname:16s} " + " ".join(f"{u:10.1f}" for u in r["us"]) + "   "
                  + " ".join(f"{x:5.2f}" for x in r["ratio_to_1_row"][1:]))
    print(json.dumps({"model": args.model, "hardware": hardware("cpu"), "threads": torch.get_num_threads(),
                      "rows": ROWS, "context": args.context, "shapes": {k: list(v) for k, v in shapes.items()}, "results": results}))


if __name__ == "__main__":
    main()
