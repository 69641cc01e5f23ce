"""The `dflash` command: generate and chat on a target with its DFlash draft."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from .errors import DFlashError
from .loading import DEFAULT_MODEL, load_draft, load_target, shipped_draft
from .prompts import parse_template_kwargs


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(lo):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def _float_in(lo, hi, lo_open=False):
    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if v < lo or v > hi or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return v
    return parse


def _tree_budget(s):
    return "auto" if s == "auto" else _int_at_least(1)(s)


def _width_option(p) -> None:
    p.add_argument("--fixed-width", action="store_true",
                   help="verify the whole block every step (default: only as many drafted tokens as the measured "
                   "acceptance pays for, see dflash.adaptive)")


def _lookup_option(p, default: bool) -> None:
    p.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=default,
                   help="where the text's last 3 (else 2) tokens occurred before, verify what followed them there "
                   "ahead of the draft's own proposals in the block (the output stays the same)")


def _model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in alias, HF model folder, .gguf file or hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", default=None, help="draft folder or hub id; when omitted, the draft shipped for --model if any")
    g.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=_float_in(0, 100), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=_float_in(0, 1, lo_open=True), default=1.0, help="1 = off")
    p.add_argument("--block-size", type=_int_at_least(2), default=None,
                   help="block size B = anchor + B-1 drafted tokens; None = the draft's own")
    p.add_argument("--system", default=None, help="system message for the chat template")
    _template_option(p)
    _width_option(p)
    p.add_argument("--tree-budget", default=None, type=_tree_budget,
                   help="verify candidate trees of N draft nodes (the draft's most probable paths and the text's "
                   "n-gram continuation) instead of one block, greedy only; auto = step by step, what pays: a plain "
                   "step, the n-gram continuation alone, or a tree")
    p.add_argument("--tree-topk", type=_int_at_least(1), default=4, help="the draft's best tokens per slot in trees")
    _lookup_option(p, True)
    p.add_argument("--seed", type=int, default=0, help="seed for sampling")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32; None = bf16 on CPU, "
                                                   "the model's own on GPU")
    p.add_argument("--device", default=None, help="cpu | cuda; None = cuda when present")
    p.add_argument("--threads", type=_int_at_least(1), default=None, help="torch threads; None = physical cores")
    _runtime_option(p)
    return p


def _template_option(p) -> None:
    p.add_argument("--chat-template-kwargs", default=None,
                   help='options of the chat template as JSON, e.g. \'{"enable_thinking": false}\' (Qwen3): match '
                   "how the draft's training answers were written")


def _runtime_option(p, default: str | None = "auto", default_help: str = "") -> None:
    from .fast import RUNTIMES

    p.add_argument("--runtime", choices=RUNTIMES, default=default,
                   help=default_help + "target forward: fast = our lean path (Llama, Qwen2, Qwen3, Mistral), "
                   "fast-int8 / fast-int4 = "
                   "the same with weight-only int8 / 4-bit (groups of 32, like GGUF Q4_1) linear layers (a quantised "
                   "target), -compile = decode and verify steps through torch.compile, hf = the model's own; auto = "
                   "fast-int4 for a model shipped as a 4-bit GGUF (Q4_0/Q4_1, bf16 on a CPU with dflash's int4 "
                   "kernel: its own grid, and DFlash output bitwise plain decoding's), else fast where supported, "
                   "else hf (the stats line names the choice)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="dflash", formatter_class=fmt,
                     description="Block-diffusion speculative decoding: exact target output, several times faster.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", parents=[_model_options()], formatter_class=fmt,
                         help="answer one prompt, streaming the text", description="Answer one prompt, streaming "
                         "the text to stdout; a stats line goes to stderr.")
    gen.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    sub.add_parser("chat", parents=[_model_options()], formatter_class=fmt, help="interactive multi-turn chat",
                   description="Interactive chat. /reset clears the history, /exit or Ctrl-D quits, "
                   "Ctrl-C stops the current answer.")
    reg = sub.add_parser("regenerate", parents=[_model_options()], formatter_class=fmt,
                         help="write training data: the target's own answers to prompts",
                         description="Answer prompts with the target (batched, resumable) and write a dataset "
                         "folder of JSONL shards: conversation, token ids and a loss mask over the answer.")
    reg.add_argument("inputs", nargs="+", help="JSONL files or folders ('prompt', 'messages' or 'turns' per line), "
                     "named sets (chat, gsm8k:train, mbpp:train, ...), or self:N for N prompts the target writes "
                     "itself (sampled; answer them with a second run on the output folder), self:N:OPENING for N "
                     "that begin with OPENING (e.g. 'self:300:Write a poem')")
    reg.add_argument("-o", "--output", required=True, help="dataset folder (a rerun resumes it)")
    reg.add_argument("--batch-size", type=_int_at_least(1), default=32, help="prompts answered together")
    reg.add_argument("--max-prompt-tokens", type=_int_at_least(1), default=1024, help="longer prompts are skipped")
    reg.add_argument("--limit", type=_int_at_least(1), default=None, help="answer only the first N prompts")
    reg.add_argument("--data-dir", default=None, help="folder of the named sets; None = $DFLASH_DATA_DIR")
    reg.add_argument("--base-url", default=None, help="an OpenAI-compatible server running --model (ours, vLLM, "
                     "SGLang), e.g. http://host:8000/v1; None = run the model here")
    reg.add_argument("--packed", default=None, help="a folder `dflash pack` made from this same run (e.g. committed "
                     "from another machine): the chunks it holds are not answered again")
    reg.set_defaults(max_new_tokens=512)
    pk = sub.add_parser("pack", formatter_class=fmt, help="keep regenerated answers as token ids (for a repository)",
                        description="Store the finished shards of a regenerated folder as immutable safetensors "
                        "files of answer token ids, each prompt referenced by its set and line (no prompt text). "
                        "`dflash train --data` reads the packed folder, re-reading the prompts from their sets. "
                        "Rerun to add shards finished since.")
    pk.add_argument("dataset", help="a folder written by `dflash regenerate`")
    pk.add_argument("-o", "--output", required=True, help="the packed folder")
    av = sub.add_parser("average", formatter_class=fmt, help="one draft from the mean of several drafts' weights",
                        description="Average the weights of drafts trained on from one start (other seeds, data "
                        "or settings: a 'model soup'); they must be the same network over the same target. Writes "
                        "the draft and average.json (what it was made of).")
    av.add_argument("drafts", nargs="+", help="draft folders (at least two)")
    av.add_argument("-o", "--output", required=True, help="folder for the averaged draft")
    av.add_argument("--weights", type=float, nargs="+", default=None,
                    help="one positive weight per draft (normalised to sum to 1); None = equal")
    av.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the averaged weights")
    _train_parsers(sub, fmt)
    be = sub.add_parser("bench", formatter_class=fmt, help="measure DFlash against plain decoding",
                        description="Run AR and DFlash back to back on every prompt; print a table, write "
                        "results.json and plots, end with one JSON line.")
    _measure_options(be, "gsm8k,math500,humaneval,mbpp,mt-bench", 20, 256)
    be.add_argument("--temperature", type=_float_in(0, 100), default=0.0, help="0 = greedy (outputs checked)")
    be.add_argument("--batch-size", type=_int_at_least(1), default=1, help="prompts per generate call")
    be.add_argument("--out", default="bench-out", help="folder for results.json and the plots")
    be.add_argument("--seed", type=int, default=0, help="seed for sampling")
    be.add_argument("--methods", default="ar,dflash",
                    help="comma-separated, starting with ar: ar, dflash (whole blocks), dflash-adaptive (adaptive "
                    "width), dflash-lookup and dflash-lookup-adaptive (the same with prompt lookup's continuation "
                    "ahead of the draft's proposals), dflash-tree (candidate trees of --tree-budget draft nodes and "
                    "the n-gram continuation), "
                    "dflash-tree-adaptive (step by step what pays: a plain step, the n-gram continuation alone or a "
                    "tree; both greedy only), "
                    "eagle3 (the EAGLE-3-style chain drafter), eagle3-adaptive (its chain length adaptive), "
                    "ngram (prompt lookup through our loop), hf (transformers generate), hf-prompt-lookup, "
                    "hf-assisted, hf-early-exit (transformers' LayerSkip self-speculation)")
    _template_option(be)
    be.add_argument("--eagle-draft", default=None,
                    help="the eagle3 drafter (from `dflash train --method eagle3`); None = the one shipped for --model")
    be.add_argument("--ngram-tokens", type=_int_at_least(1), default=10,
                    help="tokens proposed per step by ngram and hf-prompt-lookup")
    be.add_argument("--tree-budget", type=_int_at_least(1), default=16, help="draft nodes per tree for dflash-tree")
    be.add_argument("--tree-topk", type=_int_at_least(1), default=4,
                    help="the draft's best tokens per slot that trees are made of")
    be.add_argument("--assistant-model", default=None, help="the assistant for hf-assisted (same tokenizer)")
    be.add_argument("--early-exit-layer", type=_int_at_least(1), default=None,
                    help="hf-early-exit drafts with the target's first N layers; None = a quarter of them")
    _runtime_option(be)
    ev = sub.add_parser("evaluate", formatter_class=fmt, help="a draft's acceptance on held-out test sets",
                        description="Greedy speculative decoding at a fixed width on fixed test sets: τ and the "
                        "acceptance rate of each block slot given the slots before it; a table, results.json and "
                        "slot_acceptance.png, and one JSON line.")
    _measure_options(ev, "gsm8k,mbpp,humaneval,mt-bench", 40, 128)
    ev.add_argument("--batch-size", type=_int_at_least(1), default=8, help="prompts decoded together")
    ev.add_argument("--topk", default="1,2,4", help="also count, per slot, how often the target's token is among the "
                    "draft's k best (teacher-forced on the answers; comma-separated k, empty = skip; DFlash "
                    "drafts only)")
    ev.add_argument("--out", default=None, help="folder for results.json and slot_acceptance.png")
    ev.add_argument("--whole-vocabulary", action="store_true",
                    help="propose from the target's whole vocabulary even where the draft keeps a smaller one "
                    "(train --draft-vocab-size): what that limit costs in τ (scripts/compare_evaluations.py)")
    _lookup_option(ev, False)
    _template_option(ev)
    _runtime_option(ev)
    sv = sub.add_parser("serve", formatter_class=fmt, help="OpenAI-compatible server with continuous batching",
                        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics; "
                        "every decode step is one batched DFlash step over all running requests.")
    _serve_options(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=_int_at_least(0), default=8000, help="port (0 = any free one)")
    sv.add_argument("--served-model-name", default=None, help="name clients pass as `model`; None = --model")
    bs = sub.add_parser("bench-serve", formatter_class=fmt, help="throughput and latency of the server under load",
                        description="Drive a server with N concurrent streaming clients per concurrency level, "
                        "DFlash and AR in one run; print a table, write results.json and a Pareto plot.")
    _serve_options(bs)
    bs.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated client counts")
    bs.add_argument("--base-url", default=None, help="measure a running server instead of starting ours")
    bs.add_argument("--datasets", default="gsm8k,humaneval,mt-bench", help="prompt sets (comma-separated)")
    bs.add_argument("--prompts", default=None, help="a JSONL prompt file instead of --datasets")
    bs.add_argument("--num-prompts", type=_int_at_least(1), default=None,
                    help="requests per concurrency level; None = 2 x concurrency (at least 4)")
    bs.add_argument("--max-tokens", type=_int_at_least(1), default=256, help="tokens per answer")
    bs.add_argument("--data-dir", default=None, help="folder of the datasets; None = $DFLASH_DATA_DIR")
    bs.add_argument("--out", default="bench-serve-out", help="folder for results.json and the plot")
    return parser


def _measure_options(p, datasets: str, num_prompts: int, max_new_tokens: int) -> None:
    """What bench and evaluate share: the target, the draft, the prompts, where and how they run."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="target (alias, folder, .gguf or hub id)")
    p.add_argument("--draft", default=None, help="draft folder or hub id; None = the draft shipped for --model")
    p.add_argument("--datasets", default=datasets, help="comma-separated test sets")
    p.add_argument("--prompts", default=None, help="a JSONL prompt file instead of --datasets")
    p.add_argument("--num-prompts", type=_int_at_least(1), default=num_prompts, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=max_new_tokens, help="tokens per answer")
    p.add_argument("--block-size", type=_int_at_least(2), default=None, help="None = the draft's own")
    p.add_argument("--data-dir", default=None, help="folder of the datasets; None = $DFLASH_DATA_DIR")
    p.add_argument("--dtype", default=None, help="None = bf16 on CPU, the model's own on GPU")
    p.add_argument("--device", default=None, help="cpu | cuda; None = cuda when present")
    p.add_argument("--threads", type=_int_at_least(1), default=None, help="None = physical cores")


def _serve_options(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in alias, HF model folder, .gguf file or hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", default=None, help="draft folder or hub id; None = the draft shipped for --model")
    g.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--max-batch-size", type=_int_at_least(1), default=16, help="sequences decoding together")
    _template_option(p)
    p.add_argument("--max-queue", type=_int_at_least(0), default=256, help="waiting requests before 429s")
    p.add_argument("--block-size", type=_int_at_least(2), default=None, help="None = the draft's own")
    p.add_argument("--max-model-len", type=_int_at_least(2), default=None, help="None = the model's context")
    p.add_argument("--prefill-tokens", type=_int_at_least(1), default=512,
                   help="prompt tokens prefilled per step while others decode")
    p.add_argument("--max-verify-tokens", type=_int_at_least(1), default=64,
                   help="tokens verified per step over the batch: blocks narrow as more sequences run")
    p.add_argument("--tree-budget", default=None, type=_tree_budget,
                   help="candidate trees of N draft nodes per row for steps whose rows all decode greedily (auto = "
                   "step by step what pays: a plain step, the n-gram continuations alone or trees); None = blocks")
    p.add_argument("--tree-topk", type=_int_at_least(1), default=4, help="the draft's best tokens per slot in trees")
    _lookup_option(p, True)
    p.add_argument("--kv-cache-memory", type=_float_in(0, 1e6, lo_open=True), default=None,
                   help="GiB the KV caches may take; requests wait for room, and one that can never fit gets a 400 "
                   "(None = 90%% of the GPU's free memory, half the CPU's available memory)")
    _width_option(p)
    p.add_argument("--dtype", default=None, help="None = bf16 on CPU, the model's own on GPU")
    p.add_argument("--device", default=None, help="cpu | cuda; None = cuda when present")
    p.add_argument("--threads", type=_int_at_least(1), default=None, help="None = physical cores")
    _runtime_option(p)


_TRAIN_HELP = {
    "target": "target model (alias, folder, .gguf or hub id)",
    "method": "dflash (block diffusion) or eagle3 (an EAGLE-3-style chain drafter, for comparison)",
    "ttt_steps": "eagle3: chain steps unrolled in training (default: block size - 1)", "data": "dataset folders from `dflash regenerate`",
    "output": "run folder: checkpoints, final draft, log.jsonl", "features": "cached target features (dflash features): one folder for all --data, or one per --data folder",
    "init_draft": "start from this draft instead of a fresh one (a --num-layers above its depth appends layers that start as the identity)",
    "init_from_target": "start the draft layers as copies of the target's last layers",
    "draft_vocab_size": "limit proposals to the N most frequent answer tokens (cheaper draft LM head)", "num_layers": "draft decoder layers",
    "num_kv_heads": "key/value heads of the draft's layers, dividing the attention heads (default: the target's); "
                    "with --init-draft, a multiple of its heads that it widens to",
    "intermediate_size": "hidden units of the draft's MLPs (default: the target's); with --init-draft, at least its "
                         "own: the new units start silent",
    "block_size": "block size B", "target_layer_ids": "target layers to tap (default: evenly spaced)",
    "num_target_features": "number of target layers to tap when ids are not given (default: num_layers)",
    "mask_token_id": "vocabulary row used as MASK (default: a spare or unused special token)",
    "num_anchors": "anchors (blocks) per sequence", "gamma": "loss decay exp(-(k-1)/gamma); None = 7*(B-1)/15",
    "distill": "weight of the target's own next-token distribution in the loss, 0..1 (the rest: its tokens); "
               "needs the target's forward, or --features cached with --distill-topk",
    "distill_topk": "distill from the target's K most probable tokens only (0: its whole distribution); "
                    "`dflash features --distill-topk K` caches them",
    "lr": "peak learning rate (AdamW)", "warmup": "warm-up fraction of all steps (then cosine decay)",
    "weight_decay": "AdamW weight decay", "epochs": "passes over the data",
    "max_steps": "stop after this many steps (schedule still spans all epochs)", "max_length": "tokens per sequence",
    "max_hours": "a time budget: the schedule spans the steps that fit, as its first steps measure (at most the "
                 "epochs'), for comparing recipes at equal wall-clock",
    "schedule_steps": "a step budget: the schedule spans this many steps (at most the epochs'), for comparing "
                      "recipes at equal compute on a machine whose speed drifts",
    "batch_size": "sequences per step per process", "grad_accum": "gradient accumulation",
    "grad_clip": "gradient norm clip (0 = off)", "dtype": "target dtype (auto: bf16 where bf16 products pay, else fp32)", "save_dtype": "dtype of saved drafts",
    "seed": "seed (data order, anchors, init)", "save_interval": "checkpoint every N steps",
    "eval_interval": "measure τ every N steps", "eval_samples": "held-out training sequences (τ without --eval-datasets)",
    "eval_datasets": "held-out test sets for τ and per-slot acceptance (gsm8k mbpp humaneval mt-bench math500)",
    "eval_prompts": "prompts per eval dataset", "autocast": "bfloat16: the draft's products in bf16 (fp32 masters); auto: where bf16 pays",
    "eval_max_new_tokens": "tokens generated per held-out prompt", "log_interval": "log every N steps",
    "resume": "continue from the latest checkpoint in --output", "device": "cpu | cuda",
    "threads": "torch threads (default: physical cores)",
    "compile": "run the training step through torch.compile (fused elementwise work; compiles on the first step)",
}


def _add_train_options(p, only=None):
    from dataclasses import fields

    from .train import TrainConfig

    for f in fields(TrainConfig):
        if only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        default = None  # real defaults come from TrainConfig (after the YAML file, if any)
        if "bool" in t:
            p.add_argument(flag, action="store_true", default=None, help=_TRAIN_HELP[f.name])
        elif t.startswith("list[int]"):
            p.add_argument(flag, type=int, nargs="+", default=default, help=_TRAIN_HELP[f.name])
        elif t.startswith("list[str]"):
            p.add_argument(flag, nargs="+", default=default, help=_TRAIN_HELP[f.name])
        else:
            kind = int if t.startswith("int") else float if t.startswith("float") else str
            p.add_argument(flag, type=kind, default=default,
                           help=f"{_TRAIN_HELP[f.name]} (default: {getattr(TrainConfig(), f.name)})")


def _train_parsers(sub, fmt):
    tr = sub.add_parser("train", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="train a DFlash draft on regenerated data",
                        description="Train a draft for a target. Options come from --config (YAML, same names) "
                        "and are overridden by flags. Runs under torchrun for several processes.")
    tr.add_argument("--config", default=None, help="YAML file with any of the options below")
    _add_train_options(tr)
    fe = sub.add_parser("features", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="cache the target's features of a dataset for training",
                        description="Run the target once over a dataset and store the features the draft needs, "
                        "so `dflash train --features DIR` skips the target forward (resumable).")
    fe.add_argument("--config", default=None, help="YAML file (the training config works)")
    _add_train_options(fe, only={"target", "data", "features", "num_layers", "target_layer_ids",
                                 "num_target_features", "max_length", "dtype", "device", "threads",
                                 "distill_topk"})
    fe.add_argument("--feature-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="dtype the features are stored in (default: the target's); bfloat16 halves the disk an "
                    "fp32 target's cache takes, and training reads them back in the target's dtype")
    _runtime_option(fe, default=None, default_help=(
        "the forward that computes the features; default: the one a folder was started with, and auto for a new "
        "folder, i.e. the features the draft will see beside the default runtime (for the default 4-bit GGUF: the "
        "int4 runtime, faster than hf on a CPU: benchmarks/features_runtimes.py); hf is what training without "
        "--features runs (in --dtype). "))


def _train_config(args):
    from dataclasses import fields

    from .train import TrainConfig

    values = TrainConfig.from_yaml(args.config) if args.config else {}
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return TrainConfig(**values)


def cmd_train(args) -> int:
    from .train import train

    cfg = _train_config(args)
    result = train(cfg)
    print(json.dumps(result))
    return 0


def cmd_pack(args) -> int:
    from .dataset import pack

    print(json.dumps(pack(args.dataset, args.output)))
    return 0


def cmd_average(args) -> int:
    from .average import average_drafts

    print(json.dumps(average_drafts(args.drafts, args.output, args.weights, args.save_dtype)))
    return 0


def cmd_features(args) -> int:
    from .config import default_target_layer_ids
    from .dataset import read_dataset
    from .machine import default_device
    from .train import check_feature_folders, compute_features, feature_runtime, precision

    cfg = _train_config(args)
    if not cfg.features:
        raise DFlashError("pass --features DIR: the folder to write the features into (or one per --data folder)")
    check_feature_folders(cfg.features, cfg.data)
    train_dtype = precision(cfg.dtype, cfg.device or default_device())
    targets = {}

    def target_for(runtime):
        # hf computes what live training computes, in the training dtype; a lean runtime runs the target as
        # `dflash generate` loads it (its default dtype unless --dtype says otherwise)
        dtype = train_dtype if runtime == "hf" else (None if cfg.dtype == "auto" else cfg.dtype)
        if dtype not in targets:
            targets[dtype] = load_target(cfg.target, dtype=dtype, device=cfg.device, threads=cfg.threads)
        return targets[dtype]

    groups = [cfg.data] if len(cfg.features) == 1 else [[d] for d in cfg.data]
    made = []
    for folder, data in zip(cfg.features, groups):
        runtime = args.runtime or feature_runtime(folder) or "auto"
        target, tokenizer = target_for(runtime)
        n_layers = target.config.get_text_config().num_hidden_layers
        ids = cfg.target_layer_ids or default_target_layer_ids(n_layers, cfg.num_target_features or cfg.num_layers)
        records = read_dataset(data, tokenizer)
        manifest = compute_features(target, records, ids, folder, max_length=cfg.max_length,
                                    dtype=args.feature_dtype or str(target.dtype).removeprefix("torch."),
                                    distill_topk=cfg.distill_topk, runtime=runtime)
        made.append({"features": folder, "records": len(records), "runtime": manifest["runtime"]})
    print(json.dumps({"made": made, "target_layer_ids": ids}))
    return 0


class Session:
    """A loaded target (and draft) answering chat turns as a stream of text."""

    def __init__(self, args):
        from .generate import default_stop_token_ids

        self.args = args
        self.target, self.tokenizer = load_target(args.model, dtype=args.dtype, device=args.device,
                                                  threads=args.threads)
        self.draft = None if args.no_draft else resolve_draft(args.model, args.draft, self.target)
        self.stop_ids = default_stop_token_ids(self.target)
        self.generator = torch.Generator(device=self.target.device).manual_seed(args.seed)

    def encode(self, messages: list[dict]) -> torch.Tensor:
        from .prompts import encode_prompt

        return torch.tensor([encode_prompt(self.tokenizer, messages, self.args.system,
                                           parse_template_kwargs(self.args.chat_template_kwargs))], dtype=torch.long)

    def answer(self, messages: list[dict], out=sys.stdout):
        """Streams the answer to `out`; returns (text, GenerationOutput)."""
        from .engine import TextStream
        from .generate import stream_generate

        a = self.args
        stream = stream_generate(self.target, self.draft, self.encode(messages), block_size=a.block_size,
                                 max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                 top_p=a.top_p, stop_token_ids=self.stop_ids, generator=self.generator,
                                 runtime=a.runtime, adaptive_width=not a.fixed_width, tree_budget=a.tree_budget,
                                 tree_topk=a.tree_topk, prompt_lookup=a.prompt_lookup)
        text = TextStream(self.tokenizer)
        while True:
            try:
                rows = next(stream)
            except StopIteration as stop:
                result = stop.value
                break
            out.write(text.push(rows[0]))
            out.flush()
        out.write(text.push([], final=True))
        return text.text, result


def resolve_draft(model, draft, target):
    """--draft if given, else the draft shipped for the model, else None (said on stderr)."""
    if draft is not None:
        return load_draft(draft, target)
    found = shipped_draft(model)
    if found is None:
        print(f"dflash: no draft is shipped for {model}; decoding without one (pass --draft DIR)", file=sys.stderr)
        return None
    return load_draft(found, target)


def stats_line(result) -> str:
    n = sum(result.num_new_tokens)
    draft = f"τ={result.tau:.2f}, acceptance {result.acceptance_histogram}" if result.block_size > 1 else "no draft"
    if result.width_counts:
        draft += f", steps per verify width {result.width_counts[1:]}"
    if result.step_choices:
        draft += ", steps per check " + ", ".join(f"{k} {n}" for k, n in result.step_choices.items())
    return (f"[dflash] {n} new tokens in {result.total_time:.2f}s, {result.tokens_per_second:.1f} tok/s, "
            f"{draft}, steps={result.num_steps}, ttft={result.time_to_first_token * 1000:.0f} ms, "
            f"runtime {result.runtime}")


def cmd_generate(args) -> int:
    session = Session(args)
    _, result = session.answer([{"role": "user", "content": args.prompt}])
    print(flush=True)
    print(stats_line(result), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    session = Session(args)
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print("dflash chat: /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            text, result = session.answer(history)
        except KeyboardInterrupt:
            history.pop()
            print("\n(answer cancelled)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": text})
        print(flush=True)
        print(stats_line(result), file=sys.stderr)


def cmd_regenerate(args) -> int:
    from .regenerate import RegenerateConfig, regenerate

    cfg = RegenerateConfig(sources=args.inputs, output=args.output, model=args.model,
                           draft=None if args.no_draft else args.draft, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, batch_size=args.batch_size, limit=args.limit, seed=args.seed,
                           system=args.system, base_url=args.base_url, runtime=args.runtime,
                           chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
                           packed=args.packed)
    if args.base_url:  # the server runs the model; only its tokenizer is needed here
        regenerate(cfg, data_dir=args.data_dir)
        return 0
    target, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    regenerate(cfg, target=target, tokenizer=tokenizer, data_dir=args.data_dir)
    return 0


def cmd_bench(args) -> int:
    from .bench import DFLASH_METHODS, EAGLE_METHODS, BenchConfig, run_bench

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    target, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    draft_path = draft = assistant = eagle = eagle_path = None
    if set(DFLASH_METHODS) & set(methods):
        draft_path = args.draft or shipped_draft(args.model)
        if draft_path is None:
            raise DFlashError(f"no draft given and none shipped for {args.model}: pass --draft DIR")
        draft = load_draft(draft_path, target)
    if set(EAGLE_METHODS) & set(methods):
        eagle_path = args.eagle_draft or shipped_draft(args.model, "eagle3")
        if eagle_path is None:
            raise DFlashError(f"method eagle3 needs --eagle-draft DIR (from `dflash train --method eagle3`): none is "
                              f"shipped for {args.model}")
        eagle = load_draft(eagle_path, target, method="eagle3")
        if eagle.config.draft_method != "eagle3":
            raise DFlashError(f"--eagle-draft {eagle_path} is a {eagle.config.draft_method} draft, not eagle3")
    if args.assistant_model:
        assistant, _ = load_target(args.assistant_model, dtype=args.dtype, device=args.device, threads=args.threads)
    cfg = BenchConfig(datasets=[d.strip() for d in args.datasets.split(",") if d.strip()], prompts=args.prompts,
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                      temperature=args.temperature, batch_size=args.batch_size, out=args.out, data_dir=args.data_dir,
                      seed=args.seed, model=str(args.model), draft=str(draft_path), runtime=args.runtime,
                      methods=methods, ngram_tokens=args.ngram_tokens, assistant_model=args.assistant_model,
                      tree_budget=args.tree_budget, tree_topk=args.tree_topk,
                      eagle_draft=eagle_path and str(eagle_path), early_exit_layer=args.early_exit_layer,
                      chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    report = run_bench(cfg, target, tokenizer, draft, assistant=assistant, eagle=eagle)
    return 1 if report["real_mismatches"] else 0


def cmd_evaluate(args) -> int:
    from .evaluate import EvalConfig, run_evaluate

    target, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    draft_path = args.draft or shipped_draft(args.model)
    if draft_path is None:
        raise DFlashError(f"no draft given and none shipped for {args.model}: pass --draft DIR")
    draft = load_draft(draft_path, target)
    if args.whole_vocabulary:
        draft.set_draft_vocab(None)
    cfg = EvalConfig(datasets=[d.strip() for d in args.datasets.split(",") if d.strip()], num_prompts=args.num_prompts,
                     max_new_tokens=args.max_new_tokens, block_size=args.block_size, batch_size=args.batch_size,
                     data_dir=args.data_dir, runtime=args.runtime, prompts=args.prompts,
                     topk=[int(k) for k in args.topk.split(",") if k.strip()] or None,
                     chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
                     prompt_lookup=args.prompt_lookup)
    vocab = draft.config.vocab_size if draft.draft_vocab is None else draft.draft_vocab.numel()
    run_evaluate(target, tokenizer, draft, cfg, args.out, {"model": str(args.model), "draft": str(draft_path),
                                                           "proposal_vocabulary": vocab})
    return 0


def _engine(args):
    from .engine import EngineConfig, LLMEngine

    target, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    draft = None if args.no_draft else resolve_draft(args.model, args.draft, target)
    cfg = EngineConfig(max_batch_size=args.max_batch_size, max_queue=args.max_queue, block_size=args.block_size,
                       max_model_len=args.max_model_len, prefill_tokens=args.prefill_tokens, runtime=args.runtime,
                       max_verify_tokens=args.max_verify_tokens, adaptive_width=not args.fixed_width,
                       kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30),
                       tree_budget=args.tree_budget, tree_topk=args.tree_topk, prompt_lookup=args.prompt_lookup)
    return LLMEngine(target, tokenizer, draft, cfg)


def cmd_serve(args) -> int:
    from .server import serve

    engine = _engine(args)
    kind = f"DFlash, block {engine.block_size}" if engine.draft is not None else "no draft"
    print(f"dflash serve: {args.model} ({kind}), max batch {args.max_batch_size}, context {engine.max_model_len}",
          file=sys.stderr)
    if args.runtime.endswith("-compile"):
        print("dflash serve: compiling the step graphs before listening", file=sys.stderr)
        engine.warm_up()
    serve(engine, args.served_model_name or str(args.model), host=args.host, port=args.port,
          chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    return 0


def cmd_bench_serve(args) -> int:
    from .bench_serve import run_bench_serve

    report = run_bench_serve(args)
    return 0 if report else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stdout/stderr carry the answer and one stats line, not load bars
    hf_logging.set_verbosity_error()
    log = logging.getLogger("dflash")  # our own notes (e.g. how long torch.compile took) go to stderr
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dflash: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        parse_template_kwargs(getattr(args, "chat_template_kwargs", None))  # a bad one fails before any loading
        return {"generate": cmd_generate, "chat": cmd_chat, "regenerate": cmd_regenerate, "pack": cmd_pack,
                "average": cmd_average, "train": cmd_train, "features": cmd_features, "bench": cmd_bench,
                "evaluate": cmd_evaluate, "serve": cmd_serve, "bench-serve": cmd_bench_serve}[args.command](args)
    except DFlashError as e:
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
