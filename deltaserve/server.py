"""OpenAI-compatible HTTP API over the engine.

The engine runs in one background thread that steps while there is work; each HTTP request registers an
asyncio queue and receives its updates through it. The socket opens at once, but /health answers 503 and
every API route refuses with 503 until the model is loaded and warmed, so no user request pays for warmup.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .engine import Engine, RequestError, Update
from .metrics import Metrics
from .sampling import SamplingParams

# ---- errors ----------------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None,
           check: Callable[[Any], bool] = lambda v: True, rule: str = "") -> Any:
    """body[name] if it is of `kinds` and passes `check` (JSON true/false never counts as a number)."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) or not check(value):
        raise APIError(400, f"'{name}': {json.dumps(value)[:100]} is invalid{': ' + rule if rule else ''}", param=name)
    return value


# ---- the engine thread -------------------------------------------------------------------------------------


class EngineThread:
    """Owns the engine in one thread: loads it (weights, warmup), then steps it and routes each update to the
    asyncio queue of its request. Loading, warmup and serving share the thread on purpose: torch's CPU thread
    pool belongs to the thread that first used it, and stepping from another thread measured ~1.6x slower."""

    def __init__(self, load: Callable[[], Engine], on_error: Callable[[BaseException], None] = lambda e: None):
        self._load, self._on_error = load, on_error
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._main, name="deltaserve-engine", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to the caller, which decides to exit
            self._on_error(e)
            return
        self.ready.set()
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - e.g. a tensor-parallel rank died: the server cannot go on
            self._on_error(e)

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        request_id = secrets.token_hex(12)
        queue: asyncio.Queue = asyncio.Queue()
        self.routes[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt, params, request_id)
        except RequestError:
            del self.routes[request_id]
            raise
        self.wake.set()
        return request_id, queue

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.wake.set()

    def _run(self) -> None:
        while not self.stopping:
            if not self.engine.has_work():
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            for update in self.engine.step():
                route = self.routes.get(update.request.id)
                if route is None:
                    continue
                loop, queue = route
                if update.finished:
                    del self.routes[update.request.id]
                loop.call_soon_threadsafe(queue.put_nowait, update)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()


# ---- the app -----------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    model_name: str
    max_queued_requests: int = 64
    api_key: str | None = None
    llm: Any = None                 # deltaserve.LLM once loaded and warm
    runner: EngineThread | None = None
    metrics: Metrics = field(default_factory=Metrics)
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)

    @property
    def ready(self) -> bool:
        return self.runner is not None and self.runner.ready.is_set()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        engine = state.llm.engine if state.ready else None
        return PlainTextResponse(state.metrics.render(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _check_auth(state, request)
        data = [{"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "deltaserve",
                 "max_model_len": state.llm.max_model_len if state.ready else None}]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(state, request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages': must be a non-empty list of messages", param="messages")
        tools = _field(body, "tools", list)
        try:
            text = state.llm.template.render(messages, add_generation_prompt=True, tools=tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return await _complete(state, request, body, state.llm.encode(text), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(state, request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = state.llm.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise APIError(400, "'prompt': must be a non-empty string or list of token ids (one prompt per request)",
                           param="prompt")
        return await _complete(state, request, body, ids, chat=False)

    return app


def _check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
        raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")


async def _body(state: ServerState, request: Request) -> dict[str, Any]:
    _check_auth(state, request)
    if not state.ready:
        raise APIError(503, "the model is still loading", type_="service_unavailable")
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       type_="not_found_error", param="model", code="model_not_found")
    return body


def _sampling_params(body: dict[str, Any]) -> tuple[SamplingParams, bool]:
    n = _field(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "'n': only n = 1 is supported", param="n")
    # Refuse rather than silently ignore what would change the answer's form.
    for name in ("logprobs", "top_logprobs", "echo"):
        if body.get(name):
            raise APIError(400, f"'{name}' is not supported", param=name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise APIError(400, "'response_format': only {\"type\": \"text\"} is supported", param="response_format")
    positive = lambda v: v >= 1
    max_tokens = _field(body, "max_completion_tokens", int, None, positive, "must be >= 1")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, None, positive, "must be >= 1")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise APIError(400, "'stop': must be a string or a list of at most 16 non-empty strings", param="stop")
    stream_options = _field(body, "stream_options", dict, {})
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be in [0, 2]")),
        top_p=float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")),
        top_k=_field(body, "top_k", int, 0, lambda v: v >= 0, "must be >= 0 (0 = off)"),
        seed=_field(body, "seed", int, None),
        stop=stop,
        ignore_eos=_field(body, "ignore_eos", bool, False),
    )
    return params, bool(stream_options.get("include_usage"))


async def _complete(state: ServerState, request: Request, body: dict[str, Any], prompt: list[int],
                    chat: bool) -> Response:
    params, include_usage = _sampling_params(body)
    stream = _field(body, "stream", bool, False)
    engine = state.llm.engine
    if len(engine.waiting) >= state.max_queued_requests:
        state.metrics.count("rejected_overloaded")
        raise APIError(503, f"the server is overloaded: {len(engine.waiting)} requests are already waiting",
                       type_="service_unavailable", code="overloaded")
    try:
        request_id, queue = state.runner.submit(prompt, params)
    except RequestError as e:
        state.metrics.count("rejected_invalid")
        raise APIError(400, str(e), param="messages" if chat else "prompt",
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    log = RequestLog(state, request.url.path, len(prompt))
    common = {"id": response_id, "created": created, "model": state.model_name}

    def usage(r: Any) -> dict[str, Any]:
        return {"prompt_tokens": len(prompt), "completion_tokens": len(r.output),
                "total_tokens": len(prompt) + len(r.output),
                "prompt_tokens_details": {"cached_tokens": r.num_cached_tokens}}

    if not stream:
        text, last = "", None
        try:
            while True:
                last = await queue.get()
                log.token(last)
                text += last.text
                if last.finished:
                    break
        except asyncio.CancelledError:
            state.runner.abort(request_id)
            log.disconnected()
            raise
        r = last.request
        log.done(r)
        choice = {"index": 0, "finish_reason": r.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return JSONResponse({**common, "object": kind, "choices": [choice], "usage": usage(r)})

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else {"content": delta_text or ""}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return event({**common, "object": "chat.completion.chunk", "choices": [choice]})
        choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        return event({**common, "object": "text_completion", "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        finished = False
        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                update: Update = await queue.get()
                log.token(update)
                # one event per token, even while its text is held back (a partial character or a possible
                # stop string): clients see steady progress, and a closed connection is noticed within a step
                r = update.request
                yield chunk(update.text, r.finish_reason if update.finished else None)
                if update.finished:
                    finished = True
                    break
            r = update.request
            log.done(r)
            if include_usage:
                yield event({**common, "object": "chat.completion.chunk" if chat else "text_completion",
                             "choices": [], "usage": usage(r)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:          # the client went away: stop generating and free the slot
                state.runner.abort(request_id)
                log.disconnected()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class RequestLog:
    """One stderr line per request, like the seed's: cached + new prompt tokens, speeds, output, total time."""

    def __init__(self, state: ServerState, path: str, prompt_tokens: int):
        self.state, self.path, self.prompt_tokens = state, path, prompt_tokens
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def token(self, update: Update) -> None:
        """Times come from the engine thread, so bursts read late by the event loop do not distort them."""
        now = update.time
        if not update.token_ids:
            return
        if self.first is None:
            self.first = now
            self.state.metrics.ttft.observe(now - self.start)
        elif self.last is not None:
            self.state.metrics.itl.observe(now - self.last)
        self.last = now

    def _line(self, r: Any, tail: str) -> str:
        cached = r.num_cached_tokens
        new = self.prompt_tokens - cached
        prefill = new / (self.first - self.start) if self.first and self.first > self.start else 0.0
        n = len(r.output)
        gen = (n - 1) / (self.last - self.first) if n > 1 and self.last and self.last > self.first else 0.0
        return (f"{self.path}  --  in: {cached:5d} + {new:5d}  --  prefill: {prefill:6.0f} tok/s  --  "
                f"gen: {gen:5.0f} tok/s  --  out: {n:5d}  --  total: {time.perf_counter() - self.start:6.2f}s{tail}")

    def done(self, r: Any) -> None:
        m = self.state.metrics
        m.count("finished")
        m.prompt_tokens += self.prompt_tokens
        m.generation_tokens += len(r.output)
        m.cached_tokens += r.num_cached_tokens
        self.state.log(self._line(r, ""))

    def disconnected(self) -> None:
        self.state.metrics.count("client_disconnected")
        self.state.log(f"{self.path}  --  client disconnected after {time.perf_counter() - self.start:.2f}s; "
                       "generation stopped, slot freed")


def start_engine(state: ServerState, make_llm: Callable[[], Any], on_error: Callable[[BaseException], None]) -> None:
    """Load the model and warm every serving path in the engine thread; the server turns ready after that."""
    def load() -> Engine:
        t0 = time.perf_counter()
        llm = make_llm()
        llm.engine.warmup()
        state.llm = llm
        state.log(f"deltaserve: model '{state.model_name}' loaded and warm in {time.perf_counter() - t0:.2f}s; ready")
        return llm.engine
    state.runner = EngineThread(load, on_error)
