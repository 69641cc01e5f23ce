"""The OpenAI-compatible server, driven by the official `openai` client on 127.0.0.1 with tiny models."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from dflash import DFlashDraftModel, ar_generate
from dflash.engine import EngineConfig, LLMEngine
from dflash.server import build_app
from structured import make_tokenizer, progression, trained_target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, engine: LLMEngine, **app_options):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", **app_options), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def model():
    return trained_target(seed=0), make_tokenizer()


@pytest.fixture(scope="module")
def served(model):
    target, tok = model
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    s = Served(LLMEngine(target, tok, draft, EngineConfig(max_batch_size=4, max_queue=16, prefill_tokens=16)))
    yield s
    s.close()


def words(start, step, n):
    return " ".join(f"t{t}" for t in progression(start, step, n))


def greedy_text(model, prompt: str, max_tokens: int) -> str:
    target, tok = model
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = ar_generate(target, ids, max_new_tokens=max_tokens, stop_token_ids=[tok.eos_token_id])
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    text = httpx.get(served.url + "/metrics").text
    assert "dflash_acceptance_length_bucket" in text and "dflash_num_requests_running" in text


def test_chat_and_completions_streaming_and_not(served, model):
    prompt = words(3, 2, 6)
    want = greedy_text(model, prompt, 10)
    chat = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == want
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 10 and chat.usage.prompt_tokens == 6 and chat.usage.total_tokens == 16

    chunks = list(served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices

    comp = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert comp.choices[0].text == want and comp.usage.completion_tokens == 10
    streamed = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_stop_strings(served, model):
    prompt = words(5, 3, 5)
    full = greedy_text(model, prompt, 12)
    stop_word = full.split()[4]
    r = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop_word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop_word)]
    s = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=12, temperature=0, stop=stop_word, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == full[:full.index(stop_word)]


def test_concurrent_greedy_requests_match_each_alone(served):
    prompts = [words(s, d, 4 + s % 5) for s, d in zip(range(1, 33, 4), [1, 2, 3, 4, 5, 1, 2, 3])]
    alone = [served.client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts]

    async def together():
        return await asyncio.gather(*[served.aclient.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                                        temperature=0) for p in prompts])

    assert [r.choices[0].text for r in asyncio.run(together())] == alone


def test_malformed_requests_get_400s(served):
    bad = [dict(messages=[{"role": "user", "content": "t1"}], temperature="hot"),
           dict(messages=[]),
           dict(messages=[{"role": "wizard", "content": "t1"}]),
           dict(messages=[{"role": "user", "content": "t1"}], n=2),
           dict(messages=[{"role": "user", "content": "t1"}], max_tokens=-1),
           dict(messages=[{"role": "user", "content": "t1 " * 300}]),
           dict(messages=[{"role": "user", "content": "t1"}], max_tokens=1000)]
    for body in bad:
        r = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny", **body})
        assert r.status_code == 400, body
        assert r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    too_long = httpx.post(served.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "t1 " * 300}]}).json()
    assert "maximum context length is 256" in too_long["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model="tiny", prompt="t1", max_tokens=3, extra_body={"top_p": 0})
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="t1", max_tokens=3)
    # fields we do not know are ignored, as OpenAI does
    ok = httpx.post(served.url + "/v1/completions", json={"prompt": "t1 t2", "max_tokens": 2, "user": "x",
                                                          "frequency_penalty": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_frees_the_row(served):
    before = served.metric('dflash_requests_total{finish_reason="abort"}')
    with httpx.stream("POST", served.url + "/v1/completions",
                      json={"prompt": words(1, 1, 5), "max_tokens": 240, "temperature": 0, "stream": True}) as r:
        next(r.iter_lines())
    deadline = time.time() + 10
    while served.metric('dflash_requests_total{finish_reason="abort"}') == before:
        assert time.time() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)
    assert served.engine.runner.rows == [] or all(not s.aborted for s in served.engine.runner.rows)
    assert served.metric("dflash_num_requests_running") == 0 or served.engine.scheduler.running


def test_full_queue_gives_429(model):
    target, tok = model
    s = Served(LLMEngine(target, tok, None, EngineConfig(max_batch_size=1, max_queue=1)))
    try:
        async def flood():
            return await asyncio.gather(*[s.aclient.completions.create(model="tiny", prompt=words(i, 1, 4),
                                                                       max_tokens=200, temperature=0)
                                          for i in range(5)], return_exceptions=True)

        results = asyncio.run(flood())
        limited = [r for r in results if isinstance(r, openai.RateLimitError)]
        served_ok = [r for r in results if not isinstance(r, Exception)]
        assert limited and served_ok and len(limited) + len(served_ok) == 5
        assert all(r.usage.completion_tokens == 200 for r in served_ok)
    finally:
        s.close()


def test_sigterm_exits_cleanly(tiny_gguf):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "serve", "--model", str(tiny_gguf), "--no-draft",
                             "--dtype", "float32", "--threads", "1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        # a request in flight when SIGTERM arrives is finished; then the server exits with status 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "hello", "max_tokens": 200, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            assert [x for x in lines if x][-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_regenerate_through_the_server_matches_local_regenerate(served, model, tmp_path):
    from dflash.dataset import read_dataset
    from dflash.regenerate import RegenerateConfig, regenerate
    from structured import write_prompts

    target, tok = model
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    common = dict(sources=[str(prompts)], model="tiny", max_new_tokens=12, batch_size=4)
    regenerate(RegenerateConfig(output=str(tmp_path / "local"), **common), target=target, tokenizer=tok,
               progress=False)
    regenerate(RegenerateConfig(output=str(tmp_path / "remote"), base_url=served.url + "/v1", **common),
               tokenizer=tok, progress=False)
    local, remote = read_dataset([tmp_path / "local"]), read_dataset([tmp_path / "remote"])
    assert len(local) == 6 and [r["input_ids"] for r in remote] == [r["input_ids"] for r in local]
    assert [r["loss_mask"] for r in remote] == [r["loss_mask"] for r in local]
