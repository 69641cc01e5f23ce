"""`dflash average`: one draft from the weights of several ("model soup").

Drafts trained on from one start (other seeds, data or settings) stay in one basin of the loss, and the mean of
their weights can be better than each of them, at no training cost: the default draft's tenth stage is the mean
of two runs side by side, above both on held-out τ; two runs that differed only in γ averaged to no better than
either (README, `average`). The drafts must be the same network over the same target: the same config (dtype
aside), the same tensors, the same proposal vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from .config import DFlashConfig
from .errors import DFlashConfigError, DFlashInputError
from .io import atomic_write_text

RECORD = "average.json"  # what the average was made of, beside its weights (scripts/model_card.py reads it)


def _comparable(config: DFlashConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "dtype"}


def average_drafts(folders: list[str | os.PathLike], output: str | os.PathLike, weights: list[float] | None = None,
                   dtype: str = "float32") -> dict:
    """Writes the weighted mean of the drafts in `folders` (equal weights by default) to `output`, in `dtype`;
    returns the record it writes beside it (average.json). Floating-point tensors are averaged in fp64; integer
    ones (the proposal vocabulary) must be equal in every draft."""
    from .model import _read_weights, write_draft

    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise DFlashInputError("dflash average needs at least two drafts")
    out = Path(output)
    if any(out.resolve() == f.resolve() for f in folders):
        raise DFlashInputError(f"the output {out} is one of the drafts being averaged: write it elsewhere")
    weights = [1.0] * len(folders) if weights is None else [float(w) for w in weights]
    if len(weights) != len(folders):
        raise DFlashInputError(f"{len(weights)} weights for {len(folders)} drafts")
    if any(not w > 0 for w in weights):  # `not >` also catches nan
        raise DFlashInputError(f"weights must be positive, got {weights}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise DFlashInputError(f"unknown dtype {dtype!r} (float32, bfloat16 or float16)")
    total = sum(weights)
    weights = [w / total for w in weights]

    config = DFlashConfig.load(folders[0])
    first = _comparable(config)
    summed: dict[str, torch.Tensor] = {}
    for i, (folder, w) in enumerate(zip(folders, weights)):
        theirs = _comparable(DFlashConfig.load(folder)) if i else first
        if theirs != first:
            diff = sorted(k for k, v in theirs.items() if first[k] != v)
            raise DFlashConfigError(f"{folder} is not the same draft as {folders[0]}: its config differs in {diff}")
        state = _read_weights(str(folder))
        if i and state.keys() != summed.keys():
            names = sorted(state.keys() ^ summed.keys())
            raise DFlashConfigError(f"{folder} and {folders[0]} hold other tensors: {names[:5]}")
        for name, t in state.items():
            if i and t.shape != summed[name].shape:
                raise DFlashConfigError(f"{folder}: tensor {name} is {tuple(t.shape)}, "
                                        f"{tuple(summed[name].shape)} in {folders[0]}")
            if not t.is_floating_point():
                if i and not torch.equal(t, summed[name]):
                    raise DFlashConfigError(f"{folder}: {name} differs from {folders[0]}'s (drafts proposing from "
                                            "other vocabularies cannot be averaged)")
                summed[name] = t
            else:
                summed[name] = summed[name] + w * t.double() if i else w * t.double()
    state = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous() for k, v in summed.items()}
    config.dtype = dtype
    write_draft(out, state, config)
    record = {"drafts": [str(f) for f in folders], "weights": weights, "dtype": dtype}
    atomic_write_text(out / RECORD, json.dumps(record, indent=2) + "\n")
    return record
