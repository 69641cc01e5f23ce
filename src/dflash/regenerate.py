"""`dflash regenerate`: answers to training prompts, written by the target itself, as a resumable dataset.

A source `self:N` asks the target for N prompts of its own: its chat template up to the user's message, sampled
until the user turn ends; `self:N:OPENING` has each of them begin with OPENING ("Write a poem", "Act as"), which
steers the prompts towards a kind of task that the plain template rarely brings. Those records (kind
"self-prompt") are a prompt file for a second run, which answers them; training skips them.

The prompts are put in a fixed order (by token length within windows) and cut into fixed chunks of
`batch_size`; chunk k becomes shard `shard-<start>-<end>.jsonl`, written atomically once all its answers are
done. A restarted run skips the chunks whose shards exist, so nothing is generated twice and nothing is lost.
Sampling seeds depend only on a prompt's chunk and place in it, so a resumed run writes exactly what an
uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import DFlashError
from .io import atomic_write_text
from .prompts import BadLine, Prompt, encode_prompt, read_prompts, user_turn_prefix

SHARD = re.compile(r"^shard-(\d+)-(\d+)\.jsonl$")
PACKED = "packed-*.safetensors"  # the chunks `dflash pack` keeps (dflash.dataset)
PACKED_SHARD = re.compile(r"^packed-(\d+)-(\d+)\.safetensors$")
SELF = re.compile(r"^self:(\d+)(?::(.+))?$", re.S)  # N prompts that the target writes itself [, each from OPENING]
SELF_PROMPT = "self-prompt"  # the kind of such a record: a prompt to answer, not training data


@dataclass
class RegenerateConfig:
    sources: list[str]
    output: str
    model: str
    draft: str | None = None
    max_new_tokens: int = 512
    max_prompt_tokens: int = 1024
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 32
    limit: int | None = None  # first N prompts of the fixed order only
    seed: int = 0
    system: str | None = None
    base_url: str | None = None  # an OpenAI-compatible server that runs the model (ours, vLLM, SGLang)
    runtime: str = "auto"  # the local target's forward (dflash.fast)
    chat_template_kwargs: dict | None = None  # the template's options, e.g. {"enable_thinking": False}
    packed: str | None = None  # a `dflash pack` folder of this same run: the chunks it holds are not generated again

    def identity(self) -> dict:
        """Settings a resumed run must share with the run that started the folder."""
        d = asdict(self)  # batch_size stays: chunk boundaries must not move
        del d["output"], d["limit"], d["base_url"], d["runtime"], d["packed"]  # where/how the model runs may change
        if d["chat_template_kwargs"] is None:  # as folders made before the option existed say it
            del d["chat_template_kwargs"]
        return d


def fixed_order(items: list, batch_size: int, seed: int, window: int = 8) -> list:
    """A seeded shuffle (early shards mix every source), then sorted by prompt length within windows of
    `window` batches (so a batch pads little)."""
    g = torch.Generator().manual_seed(seed)
    items = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]
    span = batch_size * window
    return [x for k in range(0, len(items), span) for x in sorted(items[k:k + span], key=lambda pi: len(pi[1]))]


def _settings_diff(settings: dict | None, cfg: RegenerateConfig, moved: bool = False) -> dict:
    """{setting: (stored, cfg's)} for every setting a folder's manifest records otherwise than cfg. moved: the
    stored run may have read its prompt files from another place (another machine's checkout), so a prompt file
    or folder counts by its name."""
    settings, mine = settings or {}, cfg.identity()
    if moved:
        def named(sources):
            return [Path(x).name if (os.sep in x or "/" in x) and not SELF.match(x) else x for x in sources or []]

        settings = {**settings, "sources": named(settings.get("sources"))}
        mine = {**mine, "sources": named(mine.get("sources"))}
    return {k: (settings.get(k), mine.get(k)) for k in {**settings, **mine} if settings.get(k) != mine.get(k)}


def done_chunks(output: Path) -> set[int]:
    return {int(m.group(1)) for p in output.glob("shard-*.jsonl") if (m := SHARD.match(p.name))}


def packed_chunks(folder: str | os.PathLike, cfg: RegenerateConfig) -> set[int]:
    """Chunks already kept by `dflash pack` (say, committed from another machine), so that a run whose `runs/`
    folder is gone does not answer them again. The packed folder must come from a run with the same settings."""
    folder = Path(folder)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise DFlashError(f"--packed {folder}: not a packed dataset folder (no manifest.json)")
    diff = _settings_diff(json.loads(manifest.read_text()).get("settings"), cfg, moved=True)
    if diff:
        raise DFlashError(f"--packed {folder} holds answers made with other settings {diff} (theirs, this run's); "
                          "its chunks cannot stand for this run's")
    return {int(m.group(1)) for p in folder.glob(PACKED) if (m := PACKED_SHARD.match(p.name))}


def _check_manifest(output: Path, cfg: RegenerateConfig) -> None:
    path = output / "manifest.json"
    if path.is_file():
        diff = _settings_diff(json.loads(path.read_text()).get("settings"), cfg)
        if diff:
            raise DFlashError(f"{output} was started with other settings {diff} (old, new); "
                              "use another output folder or the same settings to resume")
    else:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"settings": cfg.identity()}, indent=2) + "\n")


def regenerate(cfg: RegenerateConfig, *, target=None, tokenizer=None, draft=None, data_dir=None,
               progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from .generate import default_stop_token_ids
    from .loading import load_draft, load_target, load_tokenizer

    output = Path(cfg.output)
    _check_manifest(output, cfg)
    bad: list[BadLine] = []
    self_sources = [src for src in cfg.sources if SELF.match(src)]
    if self_sources and cfg.base_url:
        raise DFlashError(f"{self_sources[0]}: prompts the target writes need the model here (a server's chat API "
                          "cannot continue a user turn)")
    if self_sources and cfg.temperature <= 0:
        raise DFlashError(f"{self_sources[0]}: the target writes prompts by sampling; pass --temperature > 0")
    prompts = read_prompts([src for src in cfg.sources if src not in self_sources], data_dir, bad)
    if cfg.base_url:
        if tokenizer is None:
            tokenizer = load_tokenizer(cfg.model)
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    else:
        if target is None:
            target, tokenizer = load_target(cfg.model)
        if draft is None and cfg.draft:
            draft = load_draft(cfg.draft, target)
        stop_ids = default_stop_token_ids(target)
    encoded, too_long = [], []
    for p in prompts:
        ids = encode_prompt(tokenizer, p.messages, cfg.system, cfg.chat_template_kwargs)
        (encoded if len(ids) <= cfg.max_prompt_tokens else too_long).append((p, ids))
    for src in self_sources:
        n, opening = SELF.match(src).groups()
        prefix = user_turn_prefix(tokenizer, cfg.system, opening or "")
        # the opening travels with each prompt: the text the second run answers starts with it
        encoded += [(Prompt(f"{src}:{k}", [], {"source": f"self:{k}", "opening": opening or ""}), prefix)
                    for k in range(int(n))]
    for p, ids in too_long:
        print(f"dflash: skipped {p.id}: prompt has {len(ids)} tokens > --max-prompt-tokens {cfg.max_prompt_tokens}",
              file=sys.stderr)
    encoded = fixed_order(encoded, cfg.batch_size, cfg.seed)
    if cfg.limit is not None:
        encoded = encoded[:cfg.limit]
    n = len(encoded)
    starts = list(range(0, n, cfg.batch_size))
    finished = done_chunks(output) | (packed_chunks(cfg.packed, cfg) if cfg.packed else set())
    todo = [s for s in starts if s not in finished]
    t0, new_tokens, written = time.perf_counter(), 0, 0
    bar = tqdm(total=n, initial=n - sum(min(cfg.batch_size, n - s) for s in todo), unit="sample",
               desc="regenerate", disable=not progress, dynamic_ncols=True)
    chunks = [(s, encoded[s:s + cfg.batch_size]) for s in todo]
    if cfg.base_url:
        answered = ((s, remote_answers(cfg, [c[0].messages for c in chunk], s, tokenizer, stop_ids))
                    for s, chunk in chunks)
    else:
        answered = engine_answers(target, draft, chunks, cfg)
    for s, answers in answered:
        chunk = encoded[s:s + cfg.batch_size]
        lines = []
        for (prompt, prompt_ids), answer in zip(chunk, answers):
            k = len(answer)
            finish = "stop" if answer and answer[-1] in stop_ids else "length"
            text = tokenizer.decode(answer, skip_special_tokens=True)
            new_tokens += k
            record = {"id": prompt.id, "source": prompt.meta.get("source", prompt.id),
                      "messages": prompt.messages + [{"role": "assistant", "content": text}],
                      "input_ids": prompt_ids + answer, "loss_mask": [0] * len(prompt_ids) + [1] * len(answer),
                      "num_prompt_tokens": len(prompt_ids), "finish_reason": finish}
            if not prompt.messages:  # a prompt the target wrote: kept when its user turn ended
                if finish != "stop" or not text.strip():
                    continue
                record.update(kind=SELF_PROMPT, messages=[{"role": "user", "content": self_prompt_text(
                    tokenizer, prompt.meta["opening"], prompt_ids, answer, text)}])
            lines.append(json.dumps(record, ensure_ascii=False))
        atomic_write_text(output / f"shard-{s:06d}-{s + len(chunk):06d}.jsonl", "\n".join(lines) + "\n")
        written += len(chunk)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    summary = {"output": str(output), "samples": n, "written_now": written, "answer_tokens_now": new_tokens,
               "seconds": round(time.perf_counter() - t0, 1), "bad_lines": len(bad), "too_long": len(too_long)}
    print(f"dflash regenerate: {n} samples in {output} ({written} written now, {new_tokens} answer tokens, "
          f"{summary['seconds']} s); skipped {len(bad)} bad lines and {len(too_long)} over-long prompts",
          file=sys.stderr)
    return summary


def self_prompt_text(tokenizer, opening: str, prompt_ids: list[int], answer: list[int], text: str) -> str:
    """The user message the target wrote: its sampled text, after the opening it was given. The continuation is
    read from the decoded whole, since a tokenizer may decode the space between the opening and it only there."""
    if opening:
        head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        whole = tokenizer.decode(prompt_ids + answer, skip_special_tokens=True)
        text = opening + (whole[len(head):] if whole.startswith(head) else text)
    return text.strip()


def engine_answers(target, draft, chunks: list[tuple[int, list]], cfg: RegenerateConfig):
    """Answers chunk by chunk through the serving engine's continuous batching: a row that finishes takes the
    next prompt at once, so the batch stays full instead of shrinking as a static batch's rows finish (which
    made fewer tokens per second). Each answer is the target's alone: the runtimes compute a row the same
    whoever runs beside it, and a sampled row draws from its own generator, seeded by the chunk and its place
    in it (as requests to a server are). Yields (chunk start, answers as token ids) as chunks complete."""
    from collections import deque

    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    engine = LLMEngine(target, None, draft, EngineConfig(max_batch_size=cfg.batch_size, runtime=cfg.runtime,
                                                         max_queue=2 * cfg.batch_size))
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    queue, live = deque(chunks), {}
    while queue or live:
        while queue and engine.scheduler.num_waiting < cfg.batch_size:  # rows never wait for prompts
            s, chunk = queue.popleft()
            live[s] = [engine.add_request(ids, max_tokens=cfg.max_new_tokens, sampling=sampling,
                                          seed=cfg.seed * 1_000_003 + s + i) for i, (_, ids) in enumerate(chunk)]
        engine.step()
        for s in [s for s, seqs in live.items() if all(q.finish_reason for q in seqs)]:
            yield s, [q.output_ids + ([q.stop_token_id] if q.finish_reason == "stop" else []) for q in live.pop(s)]


def remote_answers(cfg: RegenerateConfig, conversations: list[list[dict]], chunk_start: int, tokenizer,
                   stop_ids: list[int]) -> list[list[int]]:
    """The chunk's answers from an OpenAI-compatible server, all requests in flight at once, as token ids
    (the text re-encoded; the stop token appended when the server stopped on it)."""
    import asyncio

    import openai

    async def ask_all():
        client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                                    timeout=3600)
        extra = {"top_k": cfg.top_k} if cfg.top_k else {}
        if cfg.chat_template_kwargs:  # vLLM's and SGLang's name for it, and ours
            extra["chat_template_kwargs"] = cfg.chat_template_kwargs
        try:
            model = (await client.models.list()).data[0].id  # the server's name for it may differ from ours
            return await asyncio.gather(*[client.chat.completions.create(
                model=model, messages=([{"role": "system", "content": cfg.system}] if cfg.system else []) + msgs,
                max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                seed=cfg.seed * 1_000_003 + chunk_start + i, extra_body=extra)
                for i, msgs in enumerate(conversations)])
        finally:
            await client.close()

    try:
        replies = asyncio.run(ask_all())
    except openai.OpenAIError as e:
        raise DFlashError(f"the server at {cfg.base_url} failed: {e}") from None
    answers = []
    for r in replies:
        ids = tokenizer(r.choices[0].message.content or "", add_special_tokens=False)["input_ids"]
        if r.choices[0].finish_reason == "stop" and stop_ids:
            ids = ids + stop_ids[:1]
        answers.append(ids[:cfg.max_new_tokens])
    return answers
