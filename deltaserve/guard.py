"""ASGI middleware that checks what arrives before the API sees it.

- Host: a server bound to a loopback address answers only requests addressed to it by name (DNS rebinding: a web
  page whose domain now resolves to 127.0.0.1 cannot drive it).
- Content type: POST bodies must be JSON. A browser sends a cross-site `text/plain` or form POST without asking;
  a JSON one needs a CORS preflight, which this server never grants.
- Body: read here, whole, within a size limit (413) and a deadline (408), then handed on; once it is read, the
  API's `receive` reaches the connection again, so it still hears a client leave.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.datastructures import Headers

from .protocol import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 16 << 20
    body_timeout: float = 30.0                      # seconds from the end of the headers to the end of the body
    allowed_hosts: frozenset[str] | None = None     # Host names answered; None: any


class _ClientGone(Exception):
    pass


class RequestGuard:
    def __init__(self, app: ASGIApp, limits: RequestLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        try:
            self._check_headers(scope, headers)
            if scope["method"] != "POST":
                return await self.app(scope, receive, send)
            body = await asyncio.wait_for(self._read(receive, headers), self.limits.body_timeout)
        except APIError as e:
            return await e.response()(scope, receive, send)
        except _ClientGone:
            return
        except asyncio.TimeoutError:                   # the builtin TimeoutError from Python 3.11 on
            error = APIError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                             code="request_timeout", headers={"connection": "close"})
            return await error.response()(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope, headers: Headers) -> None:
        allowed = self.limits.allowed_hosts
        host = _host_name(headers.get("host"))
        if allowed is not None and host is not None and host not in allowed:
            raise APIError(400, f"the Host header {host!r} is not one this server answers to; start it with "
                                f"--allowed-hosts {host} if that name is yours", code="host_not_allowed")
        if scope["method"] != "POST":
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json', not "
                                f"{media or 'no content type'!r}", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise self._too_large()

    async def _read(self, receive: Receive, headers: Headers) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.limits.max_body_bytes} "
                             "bytes (--max-request-bytes)", code="request_too_large", headers={"connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body once, then listens to the connection (for a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()
    return replay


def _host_name(host: str | None) -> str | None:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    if host is None:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host
