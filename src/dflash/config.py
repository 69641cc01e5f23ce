"""Draft configuration, stored in the published DFlash checkpoint format (a Qwen3 config plus `dflash_config`)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import DFlashConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DRAFT_METHODS = ("dflash", "eagle3")
# dflash_config keys this version reads (the rest are kept but warned about)
DFLASH_CONFIG_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "mask_token", "use_aux_hidden_state",
                      "sliding_window", "swa_window_size", "layer_types"}


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Target layers whose outputs feed the draft: the middle layer for one id, else evenly spaced in [1, L-3]."""
    if num_target_layers < 1:
        raise DFlashConfigError(f"the target must have at least one layer, got {num_target_layers}")
    if num_ids < 1:
        raise DFlashConfigError(f"need at least one target layer id, got {num_ids}")
    if num_ids == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    if hi - lo + 1 < num_ids:  # shallow targets: spread over every layer instead
        lo, hi = 0, num_target_layers - 1
    if hi - lo + 1 < num_ids:
        raise DFlashConfigError(f"cannot pick {num_ids} distinct layer ids from a {num_target_layers}-layer target")
    return [int(round(lo + (hi - lo) * i / (num_ids - 1))) for i in range(num_ids)]


@dataclass
class DFlashConfig:
    """Shape and conditioning of a DFlash draft.

    `block_size` is the number of positions the draft fills per step (anchor + B-1 masks); the published
    `num_speculative_tokens=16` means the same thing, while vLLM's `num_speculative_tokens` counts B-1.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int
    num_hidden_layers: int = 1
    block_size: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    dtype: str | None = None
    draft_method: str = "dflash"  # "dflash" or "eagle3" (the EAGLE-3-style chain drafter in dflash.eagle)
    # keys from a loaded config.json that we do not interpret; written back unchanged
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise DFlashConfigError(msg)

        if self.block_size < 2:
            bad(f"block_size must be >= 2 (anchor + at least one mask), got {self.block_size}")
        if self.num_hidden_layers < 1:
            bad(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if not self.target_layer_ids:
            bad("target_layer_ids is empty")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                bad(f"target_layer_ids {self.target_layer_ids} out of range for a target with "
                    f"{self.num_target_layers} layers (valid: 0..{self.num_target_layers - 1})")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            bad(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
                bad(f"unknown layer type {t!r} (expected {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r})")
        if self.draft_method not in DRAFT_METHODS:
            bad(f"unknown draft_method {self.draft_method!r} (expected one of {', '.join(DRAFT_METHODS)})")
        if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            bad("layer_types uses sliding_attention but sliding_window is not a positive integer")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    # ---- published format -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        d.update({
            "architectures": ["Eagle3DraftModel" if self.draft_method == "eagle3" else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING_ATTENTION in self.layer_types,
            "max_window_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "dflash_config": {
                **self.extra.get("dflash_config", {}),
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
            },
        })
        if self.draft_method != "dflash":
            d["draft_method"] = self.draft_method
        if self.dtype is not None:
            d["dtype"] = self.dtype
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        d = dict(d)
        dc = d.pop("dflash_config", None) or {}
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size") if k not in d]
        if missing:
            raise DFlashConfigError(f"draft config is missing required keys: {missing}")
        if "target_layer_ids" not in dc and "target_layer_ids" not in d:
            raise DFlashConfigError("draft config has no dflash_config.target_layer_ids")
        if "mask_token_id" not in dc and "mask_token_id" not in d:
            named = dc.get("mask_token")
            raise DFlashConfigError("draft config has no dflash_config.mask_token_id" + (
                f" (it names its mask token {named!r} by text only; add its id from the target's tokenizer)"
                if named else ""))
        if dc.get("use_aux_hidden_state", True) is not True:
            raise DFlashConfigError("dflash_config.use_aux_hidden_state is false: this draft reads the target's last "
                                    "hidden state instead of tapped layers, which dflash does not run")
        unknown = sorted(set(dc) - DFLASH_CONFIG_KEYS)
        if unknown:
            warnings.warn(f"draft config: dflash_config keys {unknown} are not understood by this version of "
                          "dflash and are ignored (kept when the draft is saved again)", stacklevel=3)
        # newer checkpoints may state the window (and layer kinds) inside dflash_config
        window = dc.get("sliding_window", dc.get("swa_window_size"))
        if window is not None:
            d["sliding_window"] = window
        if dc.get("layer_types") is not None:
            d["layer_types"] = dc["layer_types"]
        # newer checkpoints nest block_size in dflash_config; older ones keep it at top level
        block_size = dc.get("block_size", d.get("block_size", 16))
        rope = d.get("rope_parameters") or {}
        kwargs = {k: d[k] for k in known if k in d}
        kwargs["block_size"] = block_size
        kwargs["target_layer_ids"] = dc.get("target_layer_ids", d.get("target_layer_ids"))
        kwargs["mask_token_id"] = dc.get("mask_token_id", d.get("mask_token_id"))
        if "rope_theta" not in d and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        if "num_target_layers" not in kwargs:
            kwargs["num_target_layers"] = max(kwargs["target_layer_ids"]) + 1
        if "Eagle3DraftModel" in (d.get("architectures") or []):
            kwargs.setdefault("draft_method", "eagle3")
        if "torch_dtype" in d and "dtype" not in d:
            kwargs["dtype"] = d["torch_dtype"]
        extra = {k: v for k, v in d.items() if k not in known and k not in
                 ("rope_parameters", "torch_dtype", "architectures", "model_type", "hidden_act",
                  "attention_dropout", "use_sliding_window", "max_window_layers", "tie_word_embeddings")}
        if unknown:
            extra["dflash_config"] = {k: dc[k] for k in unknown}
        return cls(**kwargs, extra=extra)

    def save(self, directory: str | os.PathLike) -> None:
        from .io import atomic_write_text

        atomic_write_text(os.path.join(directory, "config.json"), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "DFlashConfig":
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise DFlashConfigError(f"no config.json in draft directory {directory!s}")
        with open(path) as f:
            try:
                return cls.from_dict(json.load(f))
            except json.JSONDecodeError as e:
                raise DFlashConfigError(f"{path}: invalid JSON ({e})") from None

    def to_qwen3_config(self):
        """A transformers Qwen3Config with the same shape (used for its rotary embedding)."""
        from transformers import Qwen3Config

        rope_parameters = dict(self.rope_scaling or {})
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
        rope_parameters["rope_theta"] = self.rope_theta
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, num_hidden_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            rope_parameters=rope_parameters,
        )

    def __eq__(self, other):
        return isinstance(other, DFlashConfig) and asdict(self) == asdict(other)


def rope_settings(text_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from an HF config of either the 4.x or the 5.x layout."""
    rp = getattr(text_config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(rp["rope_theta"]), scaling
    if isinstance(rp, dict) and rp:  # per-layer-type layouts (e.g. Gemma 3): use the full-attention one
        inner = rp.get(FULL_ATTENTION) or next(iter(rp.values()))
        if isinstance(inner, dict) and "rope_theta" in inner:
            scaling = {k: v for k, v in inner.items() if k != "rope_theta"}
            return float(inner["rope_theta"]), (None if scaling.get("rope_type", "default") == "default" else scaling)
    theta = getattr(text_config, "rope_theta", 10000.0)
    scaling = getattr(text_config, "rope_scaling", None)
    return float(theta), scaling
