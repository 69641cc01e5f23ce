"""An OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

The engine and the event loop run in threads of their own (`dflash serve`: the engine on the main thread, where
the model was loaded and compiled, and uvicorn beside it); request handlers only queue work and await results,
so the event loop never blocks on the model. Every sequence reports its text deltas through a callback that
hops back onto the event loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, Field, field_validator

from .engine import LLMEngine, QueueFullError, Sequence
from .errors import DFlashInputError
from .metrics import EngineMetrics
from .prompts import encode_prompt
from .sampling import SamplingParams


# ---- request bodies (unknown fields are ignored, as OpenAI does) ---------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # extension (vLLM's); 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, n):
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is understood
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise DFlashInputError(f"unsupported content part of type {p.get('type')!r}; only 'text'")
                parts.append(p["text"])
            return "".join(parts)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict | None = None  # vLLM's and SGLang's extension, e.g. {"enable_thinking": false}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _single(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class _Stream:
    """The event-loop side of one sequence: text deltas arrive through an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_update(self, seq: Sequence, delta: str) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (delta, seq.finish_reason))


def _usage(seq: Sequence) -> dict:
    n = len(seq.output_ids)
    return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": n, "total_tokens": seq.num_prompt_tokens + n}


def build_app(engine: LLMEngine, model_name: str, *, shutdown_timeout: float = 30.0,
              engine_thread: bool = True, chat_template_kwargs: dict | None = None) -> FastAPI:
    """The app; its lifespan starts the engine's loop in a thread of its own, unless engine_thread is False: then
    the caller runs `engine.run_forever(app.state.stop_engine)`, which returns once the app has shut down."""
    engine.metrics = engine.metrics or EngineMetrics(engine.block_size)
    stop_engine = threading.Event()
    live: set[Sequence] = set()

    @asynccontextmanager
    async def lifespan(app):
        thread = None
        if engine_thread:
            thread = threading.Thread(target=engine.run_forever, args=(stop_engine,), name="dflash-engine",
                                      daemon=True)
            thread.start()
        app.state.accepting = True
        yield
        # uvicorn has stopped accepting and waited for open requests; cancel whatever is still running
        app.state.accepting = False
        for seq in list(live):
            engine.abort(seq)
        deadline = time.monotonic() + shutdown_timeout
        while engine.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop_engine.set()
        engine.wakeup.set()
        if thread is not None:
            thread.join(timeout=5)

    app = FastAPI(title="dflash", lifespan=lifespan)
    app.state.stop_engine = stop_engine

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request")
        return _error(400, f"{where}: {msg}" if where else msg, param=where)

    @app.get("/health")
    async def health():
        if not getattr(app.state, "accepting", False):
            return PlainTextResponse("shutting down", status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dflash",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _serve(request: Request, body: _Common, prompt_ids: list[int], chat: bool):
        if body.model is not None and body.model != model_name:
            return _error(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                          param="model", code="model_not_found")
        if not getattr(app.state, "accepting", False):
            return _error(503, "the server is shutting down", type_="server_error")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream = _Stream(asyncio.get_running_loop())
        try:
            sampling = SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p)
            seq = engine.add_request(prompt_ids, max_tokens=max_tokens, sampling=sampling, stop=body.stop,
                                     seed=body.seed, on_update=stream.on_update)
        except DFlashInputError as e:
            return _error(400, str(e))
        except QueueFullError as e:
            return _error(429, str(e), type_="rate_limit_error")
        live.add(seq)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if seq.finish_reason is not None:  # max_tokens=0
            stream.queue.put_nowait(("", seq.finish_reason))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(seq, stream, rid, created, chat, include_usage),
                                     media_type="text/event-stream")
        return await _complete(request, seq, stream, rid, created, chat)

    def _chunk(rid, created, chat, delta: str | None, finish, role=False) -> dict:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}

    async def _sse(seq, stream, rid, created, chat, include_usage):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield event(_chunk(rid, created, chat, None, None, role=True))
            while True:
                delta, finish = await stream.queue.get()
                if delta or finish:
                    yield event(_chunk(rid, created, chat, delta if delta else None, finish))
                if finish:
                    break
            if include_usage:
                yield event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": model_name, "choices": [], "usage": _usage(seq)})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: free its row now
            live.discard(seq)
            if seq.finish_reason is None:
                engine.abort(seq)

    async def _complete(request, seq, stream, rid, created, chat):
        parts = []
        try:
            while True:
                try:
                    delta, finish = await asyncio.wait_for(stream.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.abort(seq)
                        return PlainTextResponse("", status_code=499)
                    continue
                parts.append(delta)
                if finish:
                    break
        finally:
            live.discard(seq)
            if seq.finish_reason is None:
                engine.abort(seq)
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": seq.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": seq.finish_reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": _usage(seq)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            # the server's template options (--chat-template-kwargs), the request's own on top
            options = {**(chat_template_kwargs or {}), **(body.chat_template_kwargs or {})}
            prompt_ids = encode_prompt(engine.tokenizer, messages, None, options)
        except DFlashInputError as e:
            return _error(400, str(e), param="messages")
        except TemplateError as e:  # the template itself refused (its raise_exception, an option it rejects)
            return _error(400, f"the chat template failed: {e}", param="chat_template_kwargs")
        return await _serve(request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        prompt_ids = list(prompt) if isinstance(prompt, list) else engine.tokenizer(prompt)["input_ids"]
        return await _serve(request, body, prompt_ids, chat=False)

    return app


def serve(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", chat_template_kwargs: dict | None = None) -> None:
    """Runs the server until SIGINT/SIGTERM: uvicorn stops accepting, lets open requests finish (up to 30 s),
    then the engine cancels what is left and stops.

    The engine's loop runs on this thread, the one that loaded and compiled the model, and uvicorn on another.
    torch's CPU kernels split their work over an OpenMP pool that belongs to the thread running them: run from
    a second thread, the same int4 product took twice as long, and so did the engine's steps (measured on a
    2-core CPU; our reading is that two pools on two cores stop spinning between parallel regions, as the main
    thread's pool also slows down that way with OMP_WAIT_POLICY=passive)."""
    import signal
    import sys

    import uvicorn

    app = build_app(engine, model_name, engine_thread=False, chat_template_kwargs=chat_template_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=30))

    def http():
        try:
            server.run()  # off the main thread, uvicorn installs no signal handlers: ours below stop it
        finally:  # also when it could not start (e.g. the port is taken)
            app.state.stop_engine.set()
            engine.wakeup.set()

    def shut_down(*_):
        server.should_exit = True

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    thread = threading.Thread(target=http, name="dflash-http")
    thread.start()
    engine.run_forever(app.state.stop_engine)
    thread.join()
    if not server.started:
        sys.exit(1)
