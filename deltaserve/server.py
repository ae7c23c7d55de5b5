"""OpenAI-compatible HTTP API over the engine.

The engine runs in one background thread that steps while there is work; each HTTP request registers an
asyncio queue and receives its updates through it. The socket opens at once, but /health answers 503 and
every API route refuses with 503 until the model is loaded and warmed, so no user request pays for warmup.
Parsing, chat templates and tokenizing run in worker threads, so one huge request never stalls the event loop.
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
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .chat import ChatTemplateError
from .chat_page import chat_page
from .engine import Engine, RequestError, Update
from .guard import RequestGuard, RequestLimits
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, RequestInvalid, parse
from .sampling import SamplingParams

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
        except BaseException as e:  # noqa: BLE001 - the model's forward failed (e.g. a dead rank): cannot go on
            self._on_error(e)

    def submit(self, prompt: list[int], params: SamplingParams, cache_salt: str | None) -> tuple[str, asyncio.Queue]:
        request_id = secrets.token_hex(12)
        queue: asyncio.Queue = asyncio.Queue()
        self.routes[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt, params, request_id, cache_salt)
        except RequestError:
            del self.routes[request_id]
            raise
        self.wake.set()
        return request_id, queue

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.wake.set()

    def abort_all(self) -> None:
        for request_id in list(self.routes):
            self.abort(request_id)

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
    api_keys: tuple[str, ...] = ()      # several keys: each is a tenant with a prefix cache of its own
    limits: RequestLimits = field(default_factory=RequestLimits)
    llm: Any = None                     # deltaserve.LLM once loaded and warm
    runner: EngineThread | None = None
    metrics: Metrics = field(default_factory=Metrics)
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    stopping: bool = False              # a signal arrived: no new requests

    @property
    def ready(self) -> bool:
        return self.runner is not None and self.runner.ready.is_set()


BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, limits=state.limits)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = {404: f"there is no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return APIError(e.status_code, message, type_=kind, headers=e.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[0].get("msg", e))).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}", type_="internal_server_error").response()

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return chat_page()          # no key needed: the page asks for one and sends it with each API call

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "stopping" if state.stopping else "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        _tenant(state, request)
        engine = state.llm.engine if state.ready else None
        return PlainTextResponse(state.metrics.render(engine), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        _tenant(state, request)
        return JSONResponse(_openapi(app))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _tenant(state, request)
        data = [{"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "deltaserve",
                 "max_model_len": state.llm.max_model_len if state.ready else None}]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        tenant = _admit(state, request)
        body, prompt = await run_in_threadpool(_prepare_chat, state, await request.body())
        return await _complete(state, request, tenant, body, prompt, chat=True)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        tenant = _admit(state, request)
        body, prompt = await run_in_threadpool(_prepare_completion, state, await request.body())
        return await _complete(state, request, tenant, body, prompt, chat=False)

    return app


def _body_schema(model: type) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes plus the request models, which the routes parse themselves (off the loop)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _tenant(state: ServerState, request: Request) -> int | None:
    """The index of the API key the request carries; None when the server has no keys. 401 otherwise."""
    if not state.api_keys:
        return None
    sent = request.headers.get("authorization", "").encode("latin-1")
    for i, key in enumerate(state.api_keys):
        if secrets.compare_digest(sent, f"Bearer {key}".encode()):
            return i
    raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")


def _admit(state: ServerState, request: Request) -> int | None:
    tenant = _tenant(state, request)
    _check_open(state)
    return tenant


def _check_open(state: ServerState) -> None:
    if not state.ready:
        raise APIError(503, "the model is still loading", type_="service_unavailable")
    if state.stopping:
        raise APIError(503, "the server is shutting down", type_="service_unavailable", code="shutting_down")


def _parse(kind: type, state: ServerState, body: bytes) -> Any:
    try:
        request = parse(kind, body)
    except RequestInvalid as e:
        state.metrics.count("rejected_invalid")
        raise APIError(400, str(e), param=e.param) from None
    if request.model is not None and request.model != state.model_name:
        raise APIError(404, f"the model '{request.model}' does not exist; this server serves '{state.model_name}'",
                       type_="not_found_error", param="model", code="model_not_found")
    return request


def _prepare_chat(state: ServerState, body: bytes) -> tuple[ChatCompletionRequest, list[int]]:
    """Parse, render and tokenize (in a worker thread). Special-token text in messages stays plain text."""
    request = _parse(ChatCompletionRequest, state, body)
    contents = [m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
                for m in request.messages]
    _refuse_if_surely_too_long(state, sum(map(len, contents)), "messages")
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    try:
        prompt = state.llm.template.render_ids(state.llm.tokenizer, messages, True, request.tools)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    return request, prompt


def _prepare_completion(state: ServerState, body: bytes) -> tuple[CompletionRequest, list[int]]:
    """Parse and tokenize (in a worker thread). A text prompt is raw: special-token text in it is special."""
    request = _parse(CompletionRequest, state, body)
    prompt = request.single_prompt
    if isinstance(prompt, list):
        return request, prompt
    if state.llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
    _refuse_if_surely_too_long(state, len(prompt), "prompt")
    return request, state.llm.encode(prompt)


def _refuse_if_surely_too_long(state: ServerState, text_chars: int, param: str) -> None:
    fewest = state.llm.tokenizer.fewest_tokens(text_chars) if state.llm.tokenizer else 0
    if fewest >= state.llm.max_model_len:
        raise APIError(400, f"the prompt has at least {fewest} tokens ({text_chars} characters), but the context is "
                            f"{state.llm.max_model_len}", param=param, code="context_length_exceeded")


def _cache_salt(state: ServerState, tenant: int | None, salt: str | None) -> str | None:
    """With several API keys, each key's requests share prefixes only among themselves, whatever salt they send."""
    return f"key{tenant}:{salt or ''}" if len(state.api_keys) > 1 else salt


async def _complete(state: ServerState, request: Request, tenant: int | None,
                    body: ChatCompletionRequest | CompletionRequest, prompt: list[int], chat: bool) -> Response:
    params = body.sampling_params()
    engine = state.llm.engine
    _check_open(state)                           # again: the body was parsed in a worker thread meanwhile
    if len(engine.waiting) >= state.max_queued_requests:
        state.metrics.count("rejected_overloaded")
        raise APIError(503, f"the server is overloaded: {len(engine.waiting)} requests are already waiting",
                       type_="service_unavailable", code="overloaded")
    try:
        request_id, queue = state.runner.submit(prompt, params, _cache_salt(state, tenant, body.cache_salt))
    except RequestError as e:
        state.metrics.count("rejected_invalid")
        raise APIError(400, str(e), param="messages" if chat else "prompt",
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    log = RequestLog(state, request.url.path, len(prompt), response_id)
    common = {"id": response_id, "created": created, "model": state.model_name}

    def usage(r: Any) -> dict[str, Any]:
        return {"prompt_tokens": len(prompt), "completion_tokens": len(r.output),
                "total_tokens": len(prompt) + len(r.output),
                "prompt_tokens_details": {"cached_tokens": r.num_cached_tokens}}

    if not body.stream:
        collected = await _collect(state, request, request_id, queue, log)
        if collected is None:
            return Response(status_code=204)               # nobody is listening
        text, r = collected
        if r.finish_reason == "error":
            return log.failed(r).response()
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
                if update.finished and r.finish_reason == "error":
                    finished = True
                    yield event(log.failed(r).body())
                    yield "data: [DONE]\n\n"
                    return
                yield chunk(update.text, r.finish_reason if update.finished else None)
                if update.finished:
                    finished = True
                    break
            log.done(r)
            if body.include_usage:
                yield event({**common, "object": "chat.completion.chunk" if chat else "text_completion",
                             "choices": [], "usage": usage(r)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:          # the client went away: stop generating and free the slot
                state.runner.abort(request_id)
                log.disconnected()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(state: ServerState, request: Request, request_id: str, queue: asyncio.Queue,
                   log: RequestLog) -> tuple[str, Any] | None:
    """Wait for a non-streamed request's updates: (its text, the finished request), or None if the client left,
    in which case the request was aborted (within one engine step) and its slot freed."""
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda task: task.cancelled() or state.runner.abort(request_id))
    text, finished = "", False
    try:
        while not finished:
            update = await queue.get()
            log.token(update)
            text += update.text
            finished = update.finished
    finally:
        gone.cancel()
        if not finished:                     # this task was cancelled (the server is stopping)
            state.runner.abort(request_id)
    if gone.done() and not gone.cancelled():
        log.disconnected()
        return None
    return text, update.request


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed its connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def stop_admitting(state: ServerState, signal_name: str, timeout: float) -> None:
    """On a signal (on the event loop): refuse new requests, give running ones `timeout` seconds, then abort
    them, which ends each stream with a final event carrying finish_reason "abort"."""
    state.stopping = True
    running = len(state.runner.routes) if state.ready else 0
    state.log(f"deltaserve: {signal_name}: stopping; {running} running requests get up to {timeout:g} s to finish")
    if state.ready:
        asyncio.get_running_loop().call_later(timeout, state.runner.abort_all)


def stop_engine(state: ServerState, timeout: float = 10.0) -> bool:
    """Stop the engine thread and the model's worker processes; False if the thread is still busy (loading)."""
    if state.runner is None:
        return True
    state.runner.stop()
    state.runner.thread.join(timeout)
    if state.llm is not None:
        state.llm.close()
    return not state.runner.thread.is_alive()


class RequestLog:
    """One stderr line per request, like the seed's: cached + new prompt tokens, speeds, output, total time."""

    def __init__(self, state: ServerState, path: str, prompt_tokens: int, response_id: str):
        self.state, self.path, self.prompt_tokens, self.response_id = state, path, prompt_tokens, response_id
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
        m.count("finished" if r.finish_reason != "abort" else "aborted")
        m.prompt_tokens += self.prompt_tokens
        m.generation_tokens += len(r.output)
        m.cached_tokens += r.num_cached_tokens
        self.state.log(self._line(r, ""))

    def failed(self, r: Any) -> APIError:
        """The request failed inside the engine (the others went on): log it once, and the error for the client."""
        self.state.metrics.count("error")
        self.state.log(f"{self.path}  --  {self.response_id} failed: {r.error}")
        return APIError(500, f"internal error while generating {self.response_id}; other requests are unaffected",
                        type_="internal_server_error")

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
