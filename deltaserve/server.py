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
from importlib.metadata import PackageNotFoundError, version as package_version
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .chat_page import chat_page
from .choices import ChatChoice, CompletionChoice, TokenText
from .engine import Engine, Request as EngineRequest, RequestError, Update
from .guard import RequestGuard, RequestLimits
from .metrics import Metrics
from .prepare import Group, Job, prepare_chat, prepare_completion, refuse_if_surely_too_long, render_chat
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestInvalid,
                       TokenizeRequest, parse)

try:
    VERSION = package_version("deltaserve")
except PackageNotFoundError:            # run from a source tree that was never installed
    VERSION = "0.1.0"

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

    def submit(self, groups: list[Group], cache_salt: str | None) -> tuple[list[EngineRequest], asyncio.Queue]:
        """Queue every choice of every prompt, all or none (RequestError); their updates arrive on one queue."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        made = [self.engine.make_requests(g.prompt, g.params, [secrets.token_hex(12) for _ in g.params], cache_salt,
                                          g.grammars) for g in groups]          # all checked before any is queued
        for choices in made:
            for r in choices:
                self.routes[r.id] = (loop, queue)
            self.engine.queue(choices)
        self.wake.set()
        return [r for choices in made for r in choices], queue

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
                request_id = update.request.id
                route = self.routes.pop(request_id, None) if update.finished else self.routes.get(request_id)
                if route is not None:
                    loop, queue = route
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
    reasoning_parser: str = "auto"      # how chat output is split into reasoning_content and content
    defaults: dict[str, Any] = field(default_factory=dict)   # sampling defaults (the checkpoint's generation_config)
    llm: Any = None                     # deltaserve.LLM once loaded and warm
    runner: EngineThread | None = None
    metrics: Metrics = field(default_factory=Metrics)
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    stopping: bool = False              # a signal arrived: no new requests

    @property
    def ready(self) -> bool:
        return self.runner is not None and self.runner.ready.is_set()


BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


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
        return PlainTextResponse(state.metrics.render(engine, state.model_name),
                                 media_type="text/plain; version=0.0.4")

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

    @app.get("/version")
    async def version(request: Request) -> Response:
        _tenant(state, request)
        return JSONResponse({"version": VERSION})

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        tenant = _admit(state, request)
        job = await run_in_threadpool(_prepare_chat, state, await request.body())
        return await _complete(state, request, tenant, job)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        tenant = _admit(state, request)
        job = await run_in_threadpool(_prepare_completion, state, await request.body())
        return await _complete(state, request, tenant, job)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        _admit(state, request)
        tokens = await run_in_threadpool(_tokenize, state, await request.body())
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.llm.max_model_len})

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        _admit(state, request)
        return JSONResponse({"prompt": await run_in_threadpool(_detokenize, state, await request.body())})

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


def _prepare_chat(state: ServerState, body: bytes) -> Job:
    """Parse, render, tokenize and compile constraints (in a worker thread)."""
    request = _parse(ChatCompletionRequest, state, body)
    _check_choice_count(state, request.choices)
    return prepare_chat(state.llm, request, state.defaults, state.reasoning_parser)


def _prepare_completion(state: ServerState, body: bytes) -> Job:
    """Parse, tokenize and compile constraints (in a worker thread). Text prompts are raw: special-token text in
    them is special."""
    request = _parse(CompletionRequest, state, body)
    _check_choice_count(state, request.choices * len(request.prompts))
    return prepare_completion(state.llm, request, state.defaults)


def _check_choice_count(state: ServerState, count: int) -> None:
    """Before any work: a request with more choices than the queue holds could never be admitted."""
    if count > max(1, state.max_queued_requests):
        raise APIError(400, f"this request asks for {count} choices (n times prompts), more than this server "
                            f"queues ({state.max_queued_requests}, --max-queued-requests)", param="n")


def _tokenize(state: ServerState, body: bytes) -> list[int]:
    """vLLM's POST /tokenize: a raw prompt's ids, or exactly the ids a chat request with these fields prefills."""
    request = _parse(TokenizeRequest, state, body)
    llm = state.llm
    if llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="prompt")
    if request.prompt is not None:
        refuse_if_surely_too_long(llm, len(request.prompt), "prompt")
        return llm.encode(request.prompt)
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    return render_chat(llm, messages, request.tool_dicts, request.add_generation_prompt is not False,
                       request.chat_template_kwargs)


def _detokenize(state: ServerState, body: bytes) -> str:
    """vLLM's POST /detokenize: the text of these ids, special tokens as their text."""
    request = _parse(DetokenizeRequest, state, body)
    vocab = state.llm.cfg.vocab_size
    if any(t >= vocab for t in request.tokens):
        raise APIError(400, f"'tokens': token ids must lie in [0, {vocab})", param="tokens")
    if state.llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    return state.llm.tokenizer.decode(request.tokens, skip_special_tokens=False)


def _cache_salt(state: ServerState, tenant: int | None, salt: str | None) -> str | None:
    """With several API keys, each key's requests share prefixes only among themselves, whatever salt they send."""
    return f"key{tenant}:{salt or ''}" if len(state.api_keys) > 1 else salt


async def _complete(state: ServerState, request: Request, tenant: int | None, job: Job) -> Response:
    body = job.request
    chat = job.chat_output is not None
    engine = state.llm.engine
    _check_open(state)                           # again: the body was parsed in a worker thread meanwhile
    if len(engine.waiting) >= state.max_queued_requests:
        state.metrics.count("rejected_overloaded")
        raise APIError(503, f"the server is overloaded: {len(engine.waiting)} requests are already waiting",
                       type_="service_unavailable", code="overloaded")
    try:
        requests, queue = state.runner.submit(job.groups, _cache_salt(state, tenant, body.cache_salt))
    except RequestError as e:
        state.metrics.count("rejected_invalid")
        raise APIError(400, str(e), param=e.param or ("messages" if chat else "prompt"),
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    response_id = ("chatcmpl-" if chat else "cmpl-") + requests[0].id
    log = RequestLog(state, request.url.path, sum(len(g.prompt) for g in job.groups), response_id)
    tokens = TokenText(state.llm.tokenizer)
    index = iter(range(len(requests)))                 # choices in prompt-major order, as vLLM numbers them
    choices = {r.id: ChatChoice(next(index), tokens, job.chat_output) if chat else
               CompletionChoice(next(index), tokens, g.echo, g.prompt, group[0])
               for g, group in zip(job.groups, _split(requests, job.groups)) for r in group}
    common = {"id": response_id, "created": int(time.time()), "model": state.model_name}
    kind = "chat.completion" if chat else "text_completion"

    def usage() -> dict[str, Any]:
        prompt_tokens = sum(len(g.prompt) for g in job.groups)
        completion = sum(len(r.output) for r in requests)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": _cached(job, requests)}}

    if not body.stream:
        texts = await _collect(state, request, requests, queue, log)
        if texts is None:
            return Response(status_code=204)               # nobody is listening
        failed = next((r for r in requests if r.finish_reason == "error"), None)
        if failed is not None:
            return log.failed(failed).response()
        log.done(job, requests)
        # off the event loop: parsing and log-probability entries can take a while for long outputs
        out = await run_in_threadpool(lambda: [choices[r.id].whole(texts[r.id], r) for r in requests])
        return JSONResponse({**common, "object": kind, "choices": out, "usage": usage()})

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def chunk(parts: list[dict[str, Any]]) -> str:
        return event({**common, "object": "chat.completion.chunk" if chat else "text_completion", "choices": parts})

    async def events() -> AsyncIterator[str]:
        running = {r.id for r in requests}
        # each choice opens with its role (chat, at once) or its echoed prompt (completions, with the prompt's
        # log-probabilities, which the engine computes when it starts the request)
        unopened = {r.id for r in requests} if not chat else set()
        try:
            for r in requests if chat else ():
                yield chunk([choices[r.id].start(r)])
            while running:
                update: Update = await queue.get()
                log.token(update)
                if update.request.id in unopened:
                    unopened.discard(update.request.id)
                    first = choices[update.request.id].start(update.request)
                    if first is not None:
                        yield chunk([first])
                # one event per token, even while its text is held back (a partial character, a possible stop
                # string or marker): clients see steady progress, and a closed connection is noticed within a step
                r = update.request
                if update.finished:
                    running.discard(r.id)
                if update.finished and r.finish_reason == "error":
                    for other in running:
                        state.runner.abort(other)
                    running.clear()
                    yield event(log.failed(r).body())
                    yield "data: [DONE]\n\n"
                    return
                yield chunk(choices[r.id].update(update.text, update.logprobs, r, update.finished))
            log.done(job, requests)
            if body.include_usage:
                yield event({**common, "object": "chat.completion.chunk" if chat else "text_completion",
                             "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
        finally:
            if running:               # the client went away: stop generating and free the slots
                for request_id in running:
                    state.runner.abort(request_id)
                log.disconnected()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _split(requests: list[EngineRequest], groups: list[Group]) -> list[list[EngineRequest]]:
    """The engine requests of each prompt's choices."""
    out, i = [], 0
    for g in groups:
        out.append(requests[i:i + len(g.params)])
        i += len(g.params)
    return out


def _cached(job: Job, requests: list[EngineRequest]) -> int:
    """Prompt tokens reused from the prefix cache: each prompt's first choice's (the others reuse its prefill)."""
    return sum(group[0].num_cached_tokens for group in _split(requests, job.groups))


async def _collect(state: ServerState, request: Request, requests: list[EngineRequest], queue: asyncio.Queue,
                   log: RequestLog) -> dict[str, str] | None:
    """Wait for a non-streamed request's updates: the text of each choice by request id, or None if the client
    left, in which case every choice was aborted (within one engine step) and its slot freed."""
    abort_all = lambda: [state.runner.abort(r.id) for r in requests]
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda task: task.cancelled() or abort_all())
    texts = {r.id: "" for r in requests}
    running = set(texts)
    try:
        while running:
            update = await queue.get()
            log.token(update)
            texts[update.request.id] += update.text
            if update.finished:
                running.discard(update.request.id)
                if update.request.finish_reason == "error":        # the response fails: its siblings stop
                    for request_id in running:
                        state.runner.abort(request_id)
                    running.clear()
    finally:
        gone.cancel()
        if running:                          # this task was cancelled (the server is stopping)
            abort_all()
    if gone.done() and not gone.cancelled():
        log.disconnected()
        return None
    return texts


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
        self.tokens = 0                                  # generated by all choices
        self.last_of: dict[str, float] = {}              # each choice's latest token, for inter-token latency

    def token(self, update: Update) -> None:
        """Times come from the engine thread, so bursts read late by the event loop do not distort them."""
        now = update.time
        if not update.token_ids:
            return
        self.tokens += len(update.token_ids)
        if self.first is None:
            self.first = now
            self.state.metrics.ttft.observe(now - self.start)
        previous = self.last_of.get(update.request.id)
        if previous is not None:
            self.state.metrics.itl.observe(now - previous)
        self.last_of[update.request.id] = self.last = now

    def done(self, job: Job, requests: list[EngineRequest]) -> None:
        """All choices ended: count them and write the line (cached + new prompt tokens, speeds, output)."""
        m = self.state.metrics
        m.count("finished" if all(r.finish_reason != "abort" for r in requests) else "aborted")
        cached, n = _cached(job, requests), sum(len(r.output) for r in requests)
        m.prompt_tokens += self.prompt_tokens
        m.generation_tokens += n
        m.cached_tokens += cached
        new = self.prompt_tokens - cached
        prefill = new / (self.first - self.start) if self.first and self.first > self.start else 0.0
        gen = (self.tokens - 1) / (self.last - self.first) if self.tokens > 1 and self.last > self.first else 0.0
        self.state.log(f"{self.path}  --  in: {cached:5d} + {new:5d}  --  prefill: {prefill:6.0f} tok/s  --  "
                       f"gen: {gen:5.0f} tok/s  --  out: {n:5d}  --  "
                       f"total: {time.perf_counter() - self.start:6.2f}s")

    def failed(self, r: Any) -> APIError:
        """The request failed inside the engine (the others went on): log it once, and the error for the client."""
        self.state.metrics.count("error")
        self.state.log(f"{self.path}  --  {self.response_id} failed: {r.error}")
        if r.error_param is not None:       # its own input (a constraint) broke down mid-output: the client's error
            return APIError(400, r.error, param=r.error_param)
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
        compiled = getattr(llm.runner, "compiled", None)
        how = (f" ({len(compiled.compile_times)} graphs compiled in {sum(compiled.compile_times.values()):.1f}s)"
               if compiled and compiled.compile_times else "")
        state.log(f"deltaserve: model '{state.model_name}' loaded and warm in {time.perf_counter() - t0:.2f}s{how}; "
                  "ready")
        return llm.engine
    state.runner = EngineThread(load, on_error)
