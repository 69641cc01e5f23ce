"""`dflash train`: the DFlash training recipe (packed anchors, KV-injected context, decayed loss weights).

Per sequence: the target's features at every position are the context; up to `num_anchors` random answer
positions become anchors; anchor a gets the block [x_a, MASK, ...] at positions a..a+B-1, whose queries see
context strictly before a and their own block both ways, never another block. Slot k predicts x_{a+k}, with
weight exp(-(k-1)/gamma). All blocks of a sequence run in one packed forward, whose attention is block-sparse
(`dflash.model.block_sparse_attention`): its cost grows with anchors x sequence length, not anchors squared, so
every answer position can be an anchor.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn

from .config import DRAFT_METHODS
from .eagle import Eagle3DraftModel, Eagle3TrainStep
from .errors import DFlashError
from .io import atomic_write_text, normal_permissions, save_png
from .machine import keep_freed_memory
from .model import DFlashDraftModel, block_inputs, head_loss
from .target import target_features


@dataclass
class TrainConfig:
    target: str = "smollm2-135m-instruct"
    method: str = "dflash"  # or "eagle3": the EAGLE-3-style chain drafter (dflash.eagle), for comparison
    data: list[str] = field(default_factory=list)
    output: str = "runs/draft"
    # folders written by `dflash features`: one for all of `data`, or one per `data` folder, in its order (a
    # folder per dataset lets a new dataset join without recomputing the others)
    features: list[str] = field(default_factory=list)
    init_draft: str | None = None  # start from these weights instead of a fresh draft
    init_from_target: bool = False  # fresh draft layers start as copies of the target's last layers
    draft_vocab_size: int | None = None  # proposals limited to this many most frequent answer tokens
    num_layers: int = 1
    # key/value heads of a fresh draft's layers (default: the target's). A draft layer reads the target's
    # context only through its values, so a target with few KV heads (SmolLM2-135M: 3 of 64 dims, a third of
    # the hidden size) narrows what one draft layer can take from each context position
    num_kv_heads: int | None = None
    intermediate_size: int | None = None  # the draft MLP's hidden units (default: the target's)
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    num_target_features: int | None = None  # how many target layers to tap when ids are not given
    mask_token_id: int | None = None
    num_anchors: int = 512
    gamma: float | None = None  # None: 7 for B=16, scaled with B otherwise
    distill: float = 0.0  # weight of the target's own next-token distribution in the loss (rest: its tokens)
    # 0: that distribution in full, from the target's forward at every step; K: its K most probable tokens,
    # renormalised, which `dflash features --distill-topk K` caches beside the features
    distill_topk: int = 0
    ttt_steps: int | None = None  # eagle3: chain steps unrolled in training (None: block_size - 1)
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of all steps
    weight_decay: float = 0.0
    epochs: int = 6
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule still spans all epochs)
    # a time budget instead of epochs: the schedule spans as many steps as the first CALIBRATION_STEPS say fit
    # (capped at the epochs'); for comparing recipes at equal wall-clock
    max_hours: float | None = None
    # a step budget instead of epochs: the schedule spans this many steps (capped at the epochs'); for comparing
    # recipes at equal compute where the machine's speed drifts (a time budget then sizes arms differently)
    schedule_steps: int | None = None
    max_length: int = 3072
    batch_size: int = 1  # sequences per optimizer step per process (before accumulation)
    grad_accum: int = 1
    grad_clip: float = 1.0
    dtype: str = "auto"  # the target's dtype (the draft trains in fp32); auto: bf16 where it pays (fast_bf16)
    save_dtype: str = "float32"  # of the exported draft (final/); checkpoints always keep fp32 weights
    # "bfloat16": the draft's products in bf16 (fp32 master weights and optimizer); "auto": bf16 where it pays
    autocast: str | None = None
    seed: int = 0
    save_interval: int = 500
    eval_interval: int = 500
    eval_samples: int = 8  # held-out training sequences (kept out of training), for τ when eval_datasets is unset
    eval_datasets: list[str] | None = None  # held-out test sets (dflash.evaluate), e.g. gsm8k mbpp humaneval mt-bench
    eval_prompts: int = 10  # prompts per eval dataset
    eval_max_new_tokens: int = 64
    log_interval: int = 10
    resume: bool = False
    device: str | None = None
    threads: int | None = None
    # the training step through torch.compile (inductor, shapes dynamic): its norms, RoPE, SiLU and softmax
    # pieces fused, which on a CPU cost about as much as the products; a one-time compile on the first step, and
    # a rounding away from the eager step
    compile: bool = False

    def __post_init__(self):
        if isinstance(self.features, str):  # a single folder (YAML, older train_config.json)
            self.features = [self.features]
        self.features = list(self.features or [])

    def resolved_gamma(self) -> float:
        return self.gamma if self.gamma is not None else 7.0 * (self.block_size - 1) / 15

    @classmethod
    def from_yaml(cls, path) -> dict:
        import yaml

        if not os.path.isfile(path):
            raise DFlashError(f"config file does not exist: {path}")
        with open(path) as f:
            try:
                d = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise DFlashError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(d, dict):
            raise DFlashError(f"{path}: expected a mapping of option names to values")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k.replace("-", "_") for k in d if k.replace("-", "_") not in names)
        if unknown:
            raise DFlashError(f"{path}: unknown options {unknown}")
        return {k.replace("-", "_"): v for k, v in d.items()}


# ---- the recipe's pieces (unit-tested on their own) ------------------------------------------------------

def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block slots k = 1..B-1 (slot 0, the anchor, predicts nothing)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Answer positions a whose token and next token are both supervised. loss_mask: [T] -> [n] indices."""
    lm = loss_mask.bool()
    ok = lm[:-1] & lm[1:]
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    cand = valid_anchors(loss_mask)
    if len(cand) > num_anchors:
        cand = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
    return cand


class DFlashTrainStep(nn.Module):
    """Loss of one sequence; a module so DistributedDataParallel can wrap it."""

    def __init__(self, draft: DFlashDraftModel, gamma: float, distill: float = 0.0):
        super().__init__()
        self.draft = draft
        self.distill = distill
        # on the draft's device: DistributedDataParallel broadcasts buffers, and NCCL takes no CPU tensor
        self.register_buffer("weights", loss_weights(draft.config.block_size, gamma).to(draft.fc.weight.device),
                             persistent=False)

    def block_hidden(self, features, input_ids, anchors):
        """Final hidden states [n, B, H] of every anchor's block, all blocks in one packed forward.
        features: [T, n_ids*H]; input_ids: [T]; anchors: [n]."""
        cfg = self.draft.config
        block_ids, block_pos, _ = block_inputs(input_ids.cpu(), torch.ones_like(input_ids.cpu()), anchors.cpu(),
                                               cfg.block_size, cfg.mask_token_id)
        return self.draft.packed_blocks(features, block_ids, block_pos, anchors)

    def forward(self, features, input_ids, loss_mask, anchors, target_logits=None):
        """Weighted loss of one sequence, and (correct, counted) predictions per block slot. target_logits [T, V]:
        the target's next-token logits over the sequence, for distillation (or its top tokens: target_topk)."""
        d = self.draft
        block_ids, block_pos, labels = block_inputs(input_ids.cpu(), loss_mask.cpu(), anchors.cpu(),
                                                    d.config.block_size, d.config.mask_token_id)
        labels = labels.to(features.device)
        hidden = d.packed_blocks(features, block_ids, block_pos, anchors)[:, 1:]  # predictions: the mask slots
        counted = labels != -100
        w = self.weights.to(features.device).expand_as(labels)
        soft = {}
        if self.distill:
            # slot k of anchor a predicts token a+k: the target's distribution for it sits at position a+k-1
            pos = anchors.to(labels.device)[:, None] + torch.arange(labels.shape[1], device=labels.device)
            soft = dict(target_logits=target_logits, positions=pos.clamp(max=input_ids.shape[0] - 1),
                        distill=self.distill)
        loss, correct = head_loss(d, hidden, labels, w, **soft)
        return loss, (correct.sum(0), counted.float().sum(0))


# ---- target features -------------------------------------------------------------------------------------

class FeatureStore:
    """Target features cached on disk by `dflash features`: one safetensors shard per chunk of records."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.manifest = _feature_manifest(folder)
        if self.manifest is None:
            raise DFlashError(f"no features manifest in {folder} (run `dflash features` first)")
        self.chunk = self.manifest["chunk"]
        self._shards: dict[int, object] = {}  # open shards, read one record at a time

    def check(self, layer_ids, fingerprint, distill_topk: int = 0):
        if distill_topk and self.manifest.get("distill_topk") != distill_topk:
            raise DFlashError(f"features in {self.folder} hold the target's top {self.manifest.get('distill_topk', 0)} "
                              f"tokens, not the top {distill_topk} that --distill-topk asks for (dflash features "
                              f"--distill-topk {distill_topk} into another folder)")
        if self.manifest["target_layer_ids"] != list(layer_ids):
            raise DFlashError(f"features in {self.folder} tap layers {self.manifest['target_layer_ids']}, "
                              f"the draft needs {list(layer_ids)}")
        if self.manifest["fingerprint"] != fingerprint:
            raise DFlashError(f"features in {self.folder} were computed for another dataset")
        missing = [s for s in range(0, self.manifest["num_records"], self.chunk)
                   if not (self.folder / f"features-{s:07d}.safetensors").is_file()]
        if missing:
            raise DFlashError(f"features in {self.folder} are incomplete ({len(missing)} shards missing); "
                              "rerun `dflash features` to finish them")

    def _shard(self, idx: int):
        # records are read one at a time out of their memory-mapped shard: training visits them in random order,
        # and loading a whole shard (64 records, ~100 MB) for each would cost more than the target forward
        from safetensors import safe_open

        s = idx - idx % self.chunk
        if s not in self._shards:
            self._shards[s] = safe_open(str(self.folder / f"features-{s:07d}.safetensors"), framework="pt")
        return self._shards[s]

    def get(self, idx: int) -> torch.Tensor:
        return self._shard(idx).get_tensor(str(idx))

    def get_topk(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top tokens after every position of record idx: ids [T, K] and log-probabilities [T, K]."""
        shard = self._shard(idx)
        return shard.get_tensor(f"{idx}.ids").long(), shard.get_tensor(f"{idx}.logp")


class FeatureStores:
    """Several feature folders read as one: folder i caches the i-th consecutive group of records."""

    def __init__(self, stores: list[FeatureStore], sizes: list[int]):
        import itertools

        self.stores = stores
        self.starts = list(itertools.accumulate([0] + sizes[:-1]))

    def _find(self, idx: int) -> tuple[FeatureStore, int]:
        import bisect

        i = bisect.bisect_right(self.starts, idx) - 1
        return self.stores[i], idx - self.starts[i]

    def get(self, idx: int) -> torch.Tensor:
        store, j = self._find(idx)
        return store.get(j)

    def get_topk(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        store, j = self._find(idx)
        return store.get_topk(j)


def check_feature_folders(folders: list[str], data: list) -> None:
    if len(folders) not in (1, len(data)):
        raise DFlashError(f"--features: {len(folders)} folders for {len(data)} --data folders; give one folder for "
                          "all the data, or one per --data folder, in the same order")


def open_features(folders: list[str], groups: list[list[dict]], layer_ids, max_length: int, distill_topk: int = 0):
    """The feature cache of records read as `groups` (one group per dataset folder): one folder for them all, or
    one per group, each checked against its records."""
    check_feature_folders(folders, groups)
    if len(folders) == 1:
        groups = [[r for g in groups for r in g]]
    stores = []
    for folder, records in zip(folders, groups):
        store = FeatureStore(folder)
        store.check(layer_ids, dataset_fingerprint(records, max_length), distill_topk)
        stores.append(store)
    return stores[0] if len(stores) == 1 else FeatureStores(stores, [len(g) for g in groups])


def frequent_tokens(records: list[dict], n: int) -> list[int]:
    """The n most frequent answer tokens (ties by id), for a draft vocabulary."""
    from collections import Counter

    counts = Counter(t for r in records for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def precision(name: str | None, device) -> str | None:
    """A training precision as asked, with "auto" resolved for `device`: bfloat16 where bf16 products pay
    (kernels.fast_bf16), else float32."""
    from .kernels import fast_bf16

    if name != "auto":
        return name
    return "bfloat16" if fast_bf16(device) else "float32"


def dataset_fingerprint(records: list[dict], max_length: int) -> str:
    import hashlib

    h = hashlib.sha256(str(max_length).encode())
    for r in records:
        h.update(json.dumps(r["input_ids"][:max_length]).encode())
    return h.hexdigest()[:16]


def target_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable next tokens after every position, ids [T, k] and log-probabilities [T, k] (fp32),
    from the target's logits [T, V]: what a distilled draft learns from with --distill-topk."""
    logp, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return ids, logp


def _feature_manifest(folder) -> dict | None:
    """The manifest of the features in `folder` (None: no features there yet). Folders from before the manifest
    named the runtime were made by the model's own forward."""
    mpath = Path(folder) / "manifest.json"
    return {"runtime": "hf", **json.loads(mpath.read_text())} if mpath.is_file() else None


def feature_runtime(folder) -> str | None:
    """The runtime that made the features in `folder` (None: no features there yet)."""
    manifest = _feature_manifest(folder)
    return manifest and manifest["runtime"]


def compute_features(target, records, layer_ids, output, *, max_length, dtype, chunk=64, progress=True,
                     distill_topk: int = 0, runtime: str = "hf"):
    """Writes every record's target features to `output` (resumable, one atomic shard per chunk); with
    distill_topk, also the target's top tokens after every position (target_topk). runtime: the target forward
    that computes them (dflash.fast.make_adapter's names); 'hf' is the one live training runs, a lean runtime
    gives the features the draft will see when it serves beside that runtime (the int4 runtime's differ from the
    model's own by its rounding) and is faster."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from .fast import make_adapter, resolve_runtime
    from .io import atomic_path

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    runtime = resolve_runtime(target, runtime)
    fp = dataset_fingerprint(records, max_length)
    manifest = {"target_layer_ids": list(layer_ids), "fingerprint": fp, "num_records": len(records),
                "chunk": chunk, "max_length": max_length, "dtype": dtype, "runtime": runtime}
    if distill_topk:
        manifest["distill_topk"] = distill_topk
    old = _feature_manifest(out)
    if old is not None:
        if old != manifest:
            diff = ", ".join(f"{k} {old.get(k)!r} (asked: {manifest.get(k)!r})" for k in sorted({*old, *manifest})
                             if old.get(k) != manifest.get(k))
            raise DFlashError(f"{out} holds features made with other settings: {diff}; use another folder")
    else:
        atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    adapter = None if runtime == "hf" else make_adapter(target, list(layer_ids), runtime)
    todo = [s for s in range(0, len(records), chunk) if not (out / f"features-{s:07d}.safetensors").is_file()]
    bar = tqdm(total=len(records), initial=len(records) - sum(min(chunk, len(records) - s) for s in todo),
               unit="seq", desc="features", disable=not progress, dynamic_ncols=True)
    for s in todo:
        tensors = {}
        for i in range(s, min(s + chunk, len(records))):
            ids = torch.tensor(records[i]["input_ids"][:max_length])
            if adapter is not None:
                feats, logits = _runtime_features(adapter, ids, with_logits=bool(distill_topk))
            elif distill_topk:
                feats, logits = target_features(target, layer_ids, ids, with_logits=True)
            else:
                feats = target_features(target, layer_ids, ids)
            if distill_topk:
                top, logp = target_topk(logits, distill_topk)
                tensors[f"{i}.ids"], tensors[f"{i}.logp"] = top.int().cpu().contiguous(), logp.cpu().contiguous()
            tensors[str(i)] = feats.to(getattr(torch, dtype)).cpu().contiguous()
            bar.update(1)
        with atomic_path(out / f"features-{s:07d}.safetensors") as tmp:
            save_file(tensors, tmp)
    bar.close()
    return manifest


@torch.inference_mode()
def _runtime_features(adapter, ids: torch.Tensor, with_logits: bool):
    """target_features through a runtime's adapter: one prompt pass over the whole sequence [T]."""
    n = ids.shape[0]
    adapter.reset(1, n)
    ids = ids[None].to(adapter.device)
    logits, feats = adapter.forward(ids, torch.arange(n, device=ids.device)[None], capture=True,
                                    logits_to_keep=0 if with_logits else 1)
    return feats[0], logits[0] if with_logits else None


# ---- the loop --------------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        # one GPU per process: without it every rank's NCCL work lands on GPU 0
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _save_checkpoint(out: Path, step: int, draft, optimizer, scheduler, state: dict, keep: int = 2) -> Path:
    """Draft (published format, the fp32 master weights) + optimizer, scheduler, RNG and data position, in one
    atomic folder. A lower save dtype applies to exported drafts only: resuming from rounded weights would
    not continue the run."""
    import tempfile

    final = out / f"checkpoint-{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out))
    try:
        save_draft(draft, tmp, "float32")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state(), **state}, tmp / "trainer_state.pt")
        normal_permissions(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_text(out / "latest", final.name + "\n")
    for old in sorted(out.glob("checkpoint-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_draft(draft: DFlashDraftModel, folder, dtype: str) -> None:
    """Saves a copy of the draft in `dtype` (training keeps fp32 masters)."""
    copy = type(draft)(draft.config)
    if draft.draft_vocab is not None:
        copy.set_draft_vocab(draft.draft_vocab)
    copy.load_state_dict(draft.state_dict())
    copy.to(getattr(torch, dtype)).save_pretrained(folder)


def latest_checkpoint(out: Path) -> Path | None:
    p = out / "latest"
    if p.is_file():
        ckpt = out / p.read_text().strip()
        if (ckpt / "trainer_state.pt").is_file():
            return ckpt
    return None


CALIBRATION_STEPS = 20  # steps timed to size a --max-hours schedule


def lr_schedule(cfg: TrainConfig, total_steps: int) -> dict:
    """The learning-rate schedule of a run: linear warm-up, then cosine decay to 0 at total_steps. Saved with
    every checkpoint; a resumed run must ask for the same one (see schedule_identity)."""
    return {"kind": "cosine", "peak_lr": cfg.lr, "warmup": cfg.warmup, "max_hours": cfg.max_hours,
            "warmup_steps": int(cfg.warmup * total_steps), "total_steps": total_steps}


def schedule_identity(schedule: dict) -> dict:
    """What a resumed run must ask for: the same kind, peak and warm-up, and the same length (in steps, or the
    same time budget, whose steps the first sitting measured)."""
    keys = ["kind", "peak_lr", "warmup", "max_hours"] + ([] if schedule.get("max_hours") else ["total_steps"])
    return {k: schedule.get(k) for k in keys}


def lr_factor(schedule: dict, step: int) -> float:
    warmup, total = schedule["warmup_steps"], schedule["total_steps"]
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _check_schedule(resume_from: Path, saved: dict | None, asked: dict) -> None:
    if saved is None or schedule_identity(saved) != schedule_identity(asked):
        was = "no recorded schedule (an older dflash wrote it)" if saved is None else f"the schedule {saved}"
        raise DFlashError(f"{resume_from} was trained with {was}; this run asks for {asked}. A resumed run keeps "
                          "its schedule (same --lr, --warmup, --epochs, data and batch); to train on with another, "
                          f"start a new stage: --init-draft {resume_from} --output <new folder>")


def held_out_prompts(records: list[dict]) -> list[list[int]]:
    return [r["input_ids"][:r.get("num_prompt_tokens", len(r["input_ids"]))] for r in records]


def train(cfg: TrainConfig, *, target=None, tokenizer=None, progress: bool = True) -> dict:
    """Trains a draft as `cfg` says (resuming from its latest checkpoint with --resume); under torchrun each
    process trains its share of every global batch. Returns the last step, held-out τ and the output folder."""
    import torch.distributed as dist

    owns_group = not (dist.is_available() and dist.is_initialized())
    rank, world = _dist()
    try:
        return _train(cfg, rank, world, target=target, tokenizer=tokenizer, progress=progress)
    finally:
        # a process group left to the interpreter's exit can abort a rank in gloo's teardown ("terminate called
        # without an active exception") after the training itself succeeded
        if owns_group and world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, world: int, *, target=None, tokenizer=None, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from .evaluate import EvalConfig, encoded_eval_sets, evaluate_draft
    from .generate import default_stop_token_ids
    from .loading import load_draft, load_target
    from .prompts import pad_id_for
    from .dataset import read_dataset

    is_main = rank == 0
    out = Path(cfg.output)
    if cfg.method not in DRAFT_METHODS:
        raise DFlashError(f"unknown --method {cfg.method!r}: expected one of {', '.join(DRAFT_METHODS)}")
    if not cfg.data:
        raise DFlashError("no training data: pass one or more dataset folders (from `dflash regenerate`)")
    if not 0.0 <= cfg.distill <= 1.0:
        raise DFlashError(f"--distill {cfg.distill}: expected a weight in [0, 1]")
    if cfg.schedule_steps is not None and (cfg.schedule_steps < 1 or cfg.max_hours is not None):
        raise DFlashError(f"--schedule-steps {cfg.schedule_steps}: expected a step count >= 1, and not with "
                          "--max-hours (a budget in steps or in time, not both)")
    if cfg.distill_topk < 0 or (cfg.distill_topk and not cfg.distill):
        raise DFlashError(f"--distill-topk {cfg.distill_topk}: expected a token count >= 1, with --distill")
    if cfg.distill and cfg.method == "eagle3":
        raise DFlashError("--distill learns from the target's logits, which the EAGLE-3-style trainer does not take")
    if cfg.distill and cfg.features and not cfg.distill_topk:
        raise DFlashError("--distill learns from the target's logits, which cached features (--features) do not "
                          "hold: train without --features, or cache the target's top tokens (dflash features "
                          "--distill-topk K) and pass --distill-topk K")
    if cfg.num_kv_heads is not None and cfg.method != "dflash":
        raise DFlashError(f"--num-kv-heads {cfg.num_kv_heads}: the {cfg.method} drafter keeps the target's heads")
    if cfg.intermediate_size is not None and (cfg.method != "dflash" or cfg.intermediate_size < 1):
        raise DFlashError(f"--intermediate-size {cfg.intermediate_size}: expected a unit count >= 1, for a dflash draft")
    keep_freed_memory()  # every step frees and allocates its activations again
    if target is None:
        device = cfg.device or (f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
        target, tokenizer = load_target(cfg.target, dtype=precision(cfg.dtype, device), device=device,
                                        threads=cfg.threads)
    target.requires_grad_(False)
    device = target.device
    groups = [read_dataset([d], tokenizer) for d in cfg.data]  # one per folder: a feature folder may cache each
    records = [r for g in groups for r in g]
    if len(records) <= cfg.eval_samples:
        raise DFlashError(f"only {len(records)} usable records: need more than eval_samples={cfg.eval_samples}")
    fingerprint = dataset_fingerprint(records, cfg.max_length)
    g = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(records), generator=g).tolist()
    eval_idx, train_idx = perm[:cfg.eval_samples], sorted(perm[cfg.eval_samples:])

    resume_from = latest_checkpoint(out) if cfg.resume else None
    if resume_from is not None:
        draft = load_draft(resume_from, target, dtype=torch.float32)
    elif cfg.init_draft:
        draft = load_draft(cfg.init_draft, target, dtype=torch.float32)
        if draft.config.block_size != cfg.block_size:
            # B is no weight shape, so a draft can be fine-tuned to a new block size (e.g. shorter blocks for a
            # weak draft, whose far slots are rarely accepted)
            print(f"dflash train: {cfg.init_draft} has block size {draft.config.block_size}; training with "
                  f"{cfg.block_size}", file=sys.stderr)
            draft.config.block_size = cfg.block_size
        deeper = cfg.num_layers > draft.config.num_hidden_layers
        wider = cfg.num_kv_heads not in (None, draft.config.num_key_value_heads)
        broader = cfg.intermediate_size not in (None, draft.config.intermediate_size)
        if (deeper or wider or broader) and draft.config.draft_method != "dflash":
            raise DFlashError("--num-layers / --num-kv-heads / --intermediate-size: only a dflash draft grows")
        torch.manual_seed(cfg.seed)  # the new layers' and units' random weights, as a fresh draft's
        if deeper:
            have = draft.config.num_hidden_layers
            draft.grow_layers(cfg.num_layers)
            print(f"dflash train: {cfg.init_draft} grew from {have} to {cfg.num_layers} layers; the new ones start "
                  f"as the identity, so training starts from its proposals", file=sys.stderr)
        if wider:
            have = draft.config.num_key_value_heads
            draft.widen_kv_heads(cfg.num_kv_heads)
            print(f"dflash train: {cfg.init_draft} widened from {have} to {cfg.num_kv_heads} key/value heads, each a "
                  f"copy of the one its query heads read, so training starts from its proposals", file=sys.stderr)
        if broader:
            have = draft.config.intermediate_size
            draft.widen_mlp(cfg.intermediate_size)
            print(f"dflash train: {cfg.init_draft} widened its MLPs from {have} to {cfg.intermediate_size} units; the "
                  f"new ones start silent (zero down projection), so training starts from its proposals",
                  file=sys.stderr)
    elif cfg.method == "eagle3":
        torch.manual_seed(cfg.seed)
        draft = Eagle3DraftModel.from_target(target, block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids,
                                             num_target_features=cfg.num_target_features)
        draft.to(torch.float32)
    else:
        torch.manual_seed(cfg.seed)
        draft = DFlashDraftModel.from_target(target, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                             target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
                                             tokenizer=tokenizer, num_target_features=cfg.num_target_features,
                                             num_key_value_heads=cfg.num_kv_heads,
                                             intermediate_size=cfg.intermediate_size)
        if cfg.init_from_target:
            n = target.config.get_text_config().num_hidden_layers
            draft.init_from_target_layers(target, list(range(n - cfg.num_layers, n)))
        draft.to(torch.float32)
    if cfg.draft_vocab_size:
        draft.set_draft_vocab(frequent_tokens([records[i] for i in train_idx], cfg.draft_vocab_size))
    draft.train()
    layer_ids = draft.config.target_layer_ids
    store = None
    if cfg.features:
        store = open_features(cfg.features, groups, layer_ids, cfg.max_length, cfg.distill_topk)

    eagle = draft.config.draft_method == "eagle3"
    if eagle != (cfg.method == "eagle3"):
        raise DFlashError(f"--method {cfg.method} but the starting draft is a {draft.config.draft_method} draft")
    n_slots = (cfg.ttt_steps or cfg.block_size - 1) if eagle else cfg.block_size - 1  # per-slot (per-step) accuracy
    step_module = (Eagle3TrainStep(draft, n_slots) if eagle
                   else DFlashTrainStep(draft, cfg.resolved_gamma(), cfg.distill))
    model = step_module
    if world > 1:
        model = nn.parallel.DistributedDataParallel(step_module, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        model = torch.compile(model, dynamic=True)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    global_batch = cfg.batch_size * cfg.grad_accum * world
    steps_per_epoch = max(1, len(train_idx) // global_batch)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.schedule_steps:
        total_steps = min(total_steps, cfg.schedule_steps)
    schedule = lr_schedule(cfg, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(schedule, i))
    step = 0
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        _check_schedule(resume_from, state.get("schedule"), schedule)
        schedule.update(state["schedule"])  # a time budget's steps as its first sitting measured them
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
        if state.get("fingerprint") != fingerprint:
            raise DFlashError(f"{resume_from} was trained on other data; resume with the same data")
    calibrate = cfg.max_hours is not None and step < CALIBRATION_STEPS  # a fresh time-budgeted run sizes itself
    first_step = step
    last = min(schedule["total_steps"], cfg.max_steps) if cfg.max_steps else schedule["total_steps"]
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "train_config.json", json.dumps(
            {**asdict(cfg), "mask_token_id": draft.config.mask_token_id, "target_layer_ids": layer_ids,
             "gamma": cfg.resolved_gamma(), "train_records": len(train_idx), "eval_records": len(eval_idx),
             "total_steps": total_steps, "schedule": schedule, "world_size": world}, indent=2) + "\n")
        print(f"dflash train: {len(train_idx)} sequences, {steps_per_epoch} steps/epoch x {cfg.epochs} epochs, "
              f"global batch {global_batch}, draft {sum(p.numel() for p in params) / 1e6:.1f}M params, "
              f"layers {layer_ids}, mask token {draft.config.mask_token_id}", file=sys.stderr)
    writer = None
    if is_main:
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out / "tb"))
        except Exception:  # TensorBoard is optional
            writer = None
    eval_cfg = EvalConfig(datasets=cfg.eval_datasets or [], num_prompts=cfg.eval_prompts,
                          max_new_tokens=cfg.eval_max_new_tokens, block_size=cfg.block_size)
    eval_sets, pad_id = {}, 0
    if is_main and cfg.eval_datasets:
        if tokenizer is None:
            raise DFlashError("evaluating on --eval-datasets needs the target's tokenizer")
        eval_sets = encoded_eval_sets(tokenizer, eval_cfg)
        pad_id = pad_id_for(tokenizer, default_stop_token_ids(target))
    elif is_main and eval_idx:
        eval_sets = {"held-out": held_out_prompts([records[i] for i in eval_idx])}
    if cfg.autocast not in (None, "bfloat16", "auto"):
        raise DFlashError(f"--autocast {cfg.autocast!r}: expected bfloat16 or auto (or leave it unset for fp32)")
    # the draft's products in bf16 where asked; its weights, gradients and optimizer state stay fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=precision(cfg.autocast, device) == "bfloat16")
    log_path = out / "log.jsonl"
    bar = tqdm(total=last, initial=step, unit="step", desc="train", disable=not (progress and is_main),
               dynamic_ncols=True)
    t0 = time.perf_counter()
    cal_t, cal_step = t0, first_step  # where the calibration's timing starts
    window_loss, window_n = 0.0, 0
    slot_correct = torch.zeros(n_slots)
    slot_total = torch.zeros(n_slots)
    tau = None
    while step < last:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
        start = in_epoch * global_batch
        batch = [train_idx[i] for i in order[start:start + global_batch].tolist()][rank::world]
        optimizer.zero_grad(set_to_none=True)
        for micro, idx in enumerate(batch):
            r = records[idx]
            ids = torch.tensor(r["input_ids"][:cfg.max_length])
            lm = torch.tensor(r["loss_mask"][:cfg.max_length])
            ag = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch * 100_003 + idx)
            anchors = sample_anchors(lm, cfg.num_anchors, ag)
            logits = None
            if store is not None:
                # as the target's forward would give them: a cache may be stored narrower (dflash features
                # --feature-dtype)
                feats = store.get(idx).to(target.dtype)
                logits = store.get_topk(idx) if cfg.distill else None
            elif cfg.distill:
                feats, logits = target_features(target, layer_ids, ids, with_logits=True)
                logits = target_topk(logits, cfg.distill_topk) if cfg.distill_topk else logits
            else:
                feats = target_features(target, layer_ids, ids)
            feats = feats.to(device)
            sync = world == 1 or micro == len(batch) - 1
            ctx = model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx, autocast:
                if len(anchors) == 0:  # nothing to learn here; keep DDP's collectives in step
                    loss = sum(p.sum() * 0 for p in params)
                    per_slot = (torch.zeros(n_slots), torch.zeros(n_slots))
                else:
                    extra = () if logits is None else (
                        tuple(t.to(device) for t in logits) if isinstance(logits, tuple) else logits.to(device),)
                    loss, per_slot = model(feats, ids.to(device), lm.to(device), anchors.to(device), *extra)
                (loss / len(batch)).backward()
            window_loss += loss.item()
            window_n += 1
            slot_correct += per_slot[0].cpu()
            slot_total += per_slot[1].cpu()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        if calibrate and cfg.compile and step == first_step + 1:  # the first step compiled: no measure of speed
            cal_t, cal_step = time.perf_counter(), step
        if calibrate and step == CALIBRATION_STEPS:
            per_step = (time.perf_counter() - cal_t) / (step - cal_step)
            fits = max(CALIBRATION_STEPS + 1, int(cfg.max_hours * 3600 / per_step))
            schedule.update(total_steps=min(total_steps, fits), warmup_steps=int(cfg.warmup * min(total_steps, fits)))
            last = min(schedule["total_steps"], cfg.max_steps) if cfg.max_steps else schedule["total_steps"]
            bar.total = last
            calibrate = False
            if is_main:
                _log(log_path, writer, {"step": step, "calibrated_total_steps": schedule["total_steps"],
                                        "seconds_per_step": round(per_step, 3)})
        bar.update(1)
        if is_main and (step % cfg.log_interval == 0 or step == last):
            acc = (slot_correct / slot_total.clamp(min=1)).tolist()
            entry = {"step": step, "epoch": epoch, "loss": window_loss / max(1, window_n),
                     "lr": scheduler.get_last_lr()[0], "acc_slot1": acc[0], "acc_by_slot": [round(a, 4) for a in acc],
                     "seconds": round(time.perf_counter() - t0, 1)}
            _log(log_path, writer, entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", acc1=f"{acc[0]:.2f}")
            window_loss, window_n = 0.0, 0
            slot_correct.zero_()
            slot_total.zero_()
        if is_main and (step % cfg.eval_interval == 0 or step == last) and eval_sets:
            ev = evaluate_draft(target, draft, eval_sets, eval_cfg, pad_id=pad_id, progress=False)
            tau = ev["mean_tau"]
            _log(log_path, writer, {"step": step, "eval_tau": tau, "eval": {
                name: {"tau": round(r["tau"], 4), "slot_acceptance": [round(a, 4) for a in r["slot_acceptance"]]}
                for name, r in ev["datasets"].items()}})
            bar.set_postfix(tau=f"{tau:.2f}")
        if is_main and (step % cfg.save_interval == 0 or step == last):
            _save_checkpoint(out, step, draft, optimizer, scheduler,
                             {"step": step, "fingerprint": fingerprint, "schedule": schedule})
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
    bar.close()
    if is_main:
        save_draft(draft, out / "final", cfg.save_dtype)
        plot_training_log(log_path, out / "training.png")
        if writer is not None:
            writer.close()
    return {"step": step, "tau": tau, "output": str(out)}


def plot_training_log(log_path: Path, png: Path) -> None:
    """Loss, slot-1 accuracy and held-out τ against the step, from log.jsonl (all sittings of a run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    train_e = [e for e in entries if "loss" in e]
    eval_e = [e for e in entries if "eval_tau" in e]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    axes[0].plot([e["step"] for e in train_e], [e["loss"] for e in train_e])
    axes[0].set_title("weighted loss")
    axes[1].plot([e["step"] for e in train_e], [e["acc_slot1"] for e in train_e])
    axes[1].set_title("slot-1 accuracy")
    axes[2].plot([e["step"] for e in eval_e], [e["eval_tau"] for e in eval_e], marker="o")
    axes[2].set_title("held-out τ (greedy spec decoding)")
    for ax in axes:
        ax.set_xlabel("step")
    save_png(fig, png, dpi=100)


def _log(path: Path, writer, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
    if writer is not None:
        for k, v in entry.items():
            if isinstance(v, (int, float)) and k != "step":
                writer.add_scalar(k, v, entry["step"])
