"""Training data: the records `dflash regenerate` writes, and the same records packed as token ids to keep.

A regenerated folder holds JSONL shards with the conversation text. The answers are the most expensive artifact
of a draft's recipe (hours of the target's decoding), so `dflash pack` stores them compactly for a repository:
per regenerated shard one immutable safetensors file with the answer token ids (uint16 where the vocabulary
fits) and, per record, a reference to its prompt ("gsm8k:train:123", a named set and its line) instead of the
prompt's text, with a hash of the prompt's token ids. Reading a packed folder re-reads each prompt from its set,
encodes it with the target's chat template and checks the hash, so a changed prompt file or tokenizer is
caught, not trained on. Prompts the target wrote itself ("self:k") are its own output and are kept as ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from .errors import DFlashError
from .regenerate import PACKED, SELF_PROMPT, SHARD


def read_dataset(paths: list[str | os.PathLike], tokenizer=None, data_dir=None) -> list[dict]:
    """Records of regenerated dataset folders (or single shard files) and packed folders, in shard order.
    Packed folders need the target's tokenizer (and the folder of the named prompt sets)."""
    records = []
    for path in map(Path, paths):
        if path.is_dir() and any(path.glob(PACKED)):
            records += read_packed(path, tokenizer, data_dir)
            continue
        files = sorted(path.glob("shard-*.jsonl")) if path.is_dir() else [path]
        if not files or not files[0].exists():
            raise DFlashError(f"no dataset shards (shard-*.jsonl or {PACKED}) in {path}")
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                        ids, lm = r["input_ids"], r["loss_mask"]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        print(f"dflash: skipped {f}:{lineno}: not a dataset record ({e})", file=sys.stderr)
                        continue
                    if r.get("kind") == SELF_PROMPT:
                        continue  # a user turn the target wrote: a prompt to answer, not an answer
                    if len(ids) != len(lm) or not any(lm):
                        print(f"dflash: skipped {f}:{lineno}: loss_mask does not fit input_ids", file=sys.stderr)
                        continue
                    records.append(r)
    return records


def prompt_hash(ids: list[int]) -> int:
    """63 bits of a SHA-256 of the prompt's token ids (fits an int64 tensor)."""
    return int.from_bytes(hashlib.sha256(json.dumps(ids).encode()).digest()[:8], "little") >> 1


def _is_self(source: str) -> bool:
    return source.startswith("self:")


def pack(folder: str | os.PathLike, output: str | os.PathLike) -> dict:
    """Packs every finished shard of a regenerated folder that `output` does not hold yet (existing packed
    shards are never rewritten). Returns counts."""
    from safetensors.torch import save_file

    from .io import atomic_path, atomic_write_text

    folder, output = Path(folder), Path(output)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise DFlashError(f"{folder} is not a regenerated dataset folder (no manifest.json)")
    output.mkdir(parents=True, exist_ok=True)
    settings = json.loads(manifest.read_text())["settings"]
    out_manifest = output / "manifest.json"
    if out_manifest.is_file() and json.loads(out_manifest.read_text())["settings"] != settings:
        raise DFlashError(f"{output} packs a dataset made with other settings; pack into another folder")
    atomic_write_text(out_manifest, json.dumps({"settings": settings, "packed_from": folder.name}, indent=2) + "\n")
    new = records = tokens = 0
    for shard in sorted(folder.glob("shard-*.jsonl")):
        m = SHARD.match(shard.name)
        target = output / f"packed-{m.group(1)}-{m.group(2)}.safetensors"
        if target.exists():
            continue
        # JSON lines split on "\n" only: str.splitlines also breaks at U+2028 and friends, which answers written
        # with ensure_ascii=False carry raw inside their strings
        rows = [json.loads(line) for line in shard.read_text(encoding="utf-8").split("\n") if line.strip()]
        rows = [r for r in rows if r.get("kind") is None]  # answers only
        answers, prompts_self, meta = [], [], []
        for r in rows:
            n = r["num_prompt_tokens"]
            source = r.get("source") or _source_from_prompt_file(r["id"], folder)
            if ":" not in source:
                raise DFlashError(f"{shard}: record {r['id']} names no prompt set ({source!r}); regenerate it "
                                  "from named sets or from a prompt file whose lines carry 'source'")
            answers.append(r["input_ids"][n:])
            prompts_self.append(r["input_ids"][:n] if _is_self(source) else [])
            meta.append([source, r["finish_reason"]])
        vocab_max = max((max(a) for a in answers + prompts_self if a), default=0)
        dtype = torch.uint16 if vocab_max < 1 << 16 else torch.int32

        def flat(lists):
            return (torch.tensor([t for x in lists for t in x], dtype=torch.int64).to(dtype),
                    torch.tensor([0] + [len(x) for x in lists]).cumsum(0))
        answer_ids, answer_offsets = flat(answers)
        self_ids, self_offsets = flat(prompts_self)
        tensors = {"answer_ids": answer_ids, "answer_offsets": answer_offsets, "self_prompt_ids": self_ids,
                   "self_prompt_offsets": self_offsets,
                   "prompt_hash": torch.tensor([prompt_hash(r["input_ids"][:r["num_prompt_tokens"]]) for r in rows],
                                               dtype=torch.int64)}
        with atomic_path(target) as tmp:
            save_file(tensors, tmp, metadata={"records": json.dumps(meta)})
        new += 1
        records += len(rows)
        tokens += len(answer_ids)
    return {"output": str(output), "new_shards": new, "new_records": records, "new_answer_tokens": tokens}


def _source_from_prompt_file(record_id: str, folder: Path) -> str:
    """The set and line a record's prompt came from, where the record names only a line of a prompt file
    ("rest-prompts.jsonl:17") whose lines carry it ("source"): the file is looked for beside the dataset."""
    name, _, line = record_id.rpartition(":")
    for base in (folder.parent, Path.cwd()):
        path = base / name
        if path.is_file() and line.isdigit():
            if path not in _prompt_file_sources:
                with open(path, encoding="utf-8") as f:
                    _prompt_file_sources[path] = {k: json.loads(text).get("source") for k, text in enumerate(f, 1)
                                                  if text.strip()}
            found = _prompt_file_sources[path].get(int(line))
            if isinstance(found, str):
                return found
    return record_id


_prompt_file_sources: dict[Path, dict[int, str | None]] = {}


def read_packed(folder: Path, tokenizer, data_dir=None) -> list[dict]:
    """The records of a packed folder, each prompt re-read from its set and checked against its hash."""
    from safetensors import safe_open

    from .prompts import encode_prompt, read_prompts

    if tokenizer is None:
        raise DFlashError(f"{folder} holds packed answers: reading them needs the target's tokenizer")
    settings = json.loads((folder / "manifest.json").read_text())["settings"]
    shards = []
    for f in sorted(folder.glob(PACKED)):
        with safe_open(str(f), "pt") as fh:
            shards.append(({k: fh.get_tensor(k) for k in fh.keys()}, json.loads(fh.metadata()["records"])))
    sets = sorted({src.rsplit(":", 1)[0] for _, meta in shards for src, _ in meta if not _is_self(src)})
    by_id = {p.id: p for p in read_prompts(sets, data_dir, warn=False)} if sets else {}
    records, bad = [], 0
    for t, meta in shards:
        a_ids, a_off = t["answer_ids"].long().tolist(), t["answer_offsets"].tolist()
        s_ids, s_off = t["self_prompt_ids"].long().tolist(), t["self_prompt_offsets"].tolist()
        for i, ((source, finish), h) in enumerate(zip(meta, t["prompt_hash"].tolist())):
            if _is_self(source):
                prompt_ids = s_ids[s_off[i]:s_off[i + 1]]
                messages = []  # its text is in the ids only (training reads ids)
            else:
                p = by_id.get(source)
                if p is None:
                    bad += 1
                    continue
                messages = p.messages
                prompt_ids = encode_prompt(tokenizer, messages, settings.get("system"),
                                           settings.get("chat_template_kwargs"))
            if prompt_hash(prompt_ids) != h:
                bad += 1
                continue
            answer = a_ids[a_off[i]:a_off[i + 1]]
            records.append({"id": source, "source": source, "messages": messages, "input_ids": prompt_ids + answer,
                            "loss_mask": [0] * len(prompt_ids) + [1] * len(answer),
                            "num_prompt_tokens": len(prompt_ids), "finish_reason": finish})
    if bad:
        raise DFlashError(f"{folder}: {bad} packed records do not match their prompts (a missing or changed prompt "
                          "set, or another tokenizer or chat template)")
    return records
