"""The HTTP server around the app: uvicorn on a socket bound before anything is announced, with a deadline for
each request's headers, a cap on open connections, repeated errors logged at most once a second, and a graceful
stop on SIGINT / SIGTERM.

uvicorn alone has none of the first three: its keep-alive timer is cancelled by the first byte a client sends and
is not armed at all on a new connection, so a client that sends its headers slowly (or nothing) holds a connection,
and a file descriptor, for as long as it likes; past the open-file limit, asyncio logs every failed accept with a
traceback, thousands of times a second.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

FD_RESERVE = 64         # open files kept for everything but connections: checkpoint shards, logs, TP sockets


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0        # seconds for a request's headers to arrive, on a new or kept-alive connection
    keep_alive_timeout: float = 5.0     # idle seconds before a kept-alive connection is closed
    max_connections: int = 1024         # connections beyond this are closed as soon as they are accepted


class ListenError(Exception):
    pass


def connection_capacity() -> int:
    """How many connections the open-file limit leaves room for, after raising the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    except (ValueError, OSError):           # e.g. an unlimited hard limit, which Linux does not take as a soft one
        pass
    return soft - FD_RESERVE


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port, or ListenError saying why not (in one line)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ListenError(f"--host {host}: cannot resolve it ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class RateLimited:
    """Lets each kind of message through at most once per `interval` seconds, and says how many it held back."""

    def __init__(self, write: Callable[[str], None], interval: float = 1.0):
        self.write, self.interval = write, interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, kind: str) -> int | None:
        """None if a message of this kind is to be dropped; else how many were dropped since the last one."""
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._held.pop(kind, 0)

    def __call__(self, kind: str, line: str) -> None:
        held = self.allow(kind)
        if held is not None:
            self.write(line + (f" ({held} more like this held back)" if held else ""))

    def loop_exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message, error = context.get("message", "error"), context.get("exception")
        self(message, f"deltaserve: {message}" + (f": {error!r}" if error is not None else ""))

    def log_filter(self, record: logging.LogRecord) -> bool:
        held = self.allow(str(record.msg))
        if held:
            record.msg = f"{record.msg} ({held} more like this held back)"
        return held is not None


class LimitedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers and a cap on open connections."""
    limits: ConnectionLimits = ConnectionLimits()
    log: RateLimited
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.log("connections", f"deltaserve: closed a new connection: {self.limits.max_connections} are open "
                                    "(--max-connections)")
            transport.abort()
            return
        self._await_headers()

    def _await_headers(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self._deadline is not None:      # a request's headers are in
            self._deadline.cancel()
            self._deadline = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_headers()                    # armed before the parent starts any pipelined request
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on the first SIGINT / SIGTERM it calls `on_stop(signal name)` on the event loop, and once
    stopped it returns instead of re-raising the signal, so a graceful stop exits 0."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[str], None], log: RateLimited):
        super().__init__(config)
        self.on_stop, self.log = on_stop, log
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(self.log.loop_exception_handler)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if first and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_stop, signal.Signals(sig).name)


def serve(app: Any, sock: socket.socket, limits: ConnectionLimits, grace: float, on_stop: Callable[[str], None],
          write: Callable[[str], None]) -> None:
    """Serve `app` on `sock` until a signal; `grace`: seconds the stop waits for running requests."""
    log = RateLimited(write)
    logging.getLogger("uvicorn.error").addFilter(log.log_filter)
    protocol = type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits, "log": log})
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", log_level="warning",
                            timeout_keep_alive=limits.keep_alive_timeout, timeout_graceful_shutdown=grace)
    GracefulServer(config, on_stop, log).run(sockets=[sock])
