"""What the server checks before a request reaches a handler: its API key, the size of its body
and how long the client takes to send it; and the request id every log line about it carries.

Plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which interferes with streaming and
disconnects), so a refused request costs no parsing. Errors are OpenAI-shaped JSON.
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid

from uvicorn.protocols.http.h11_impl import H11Protocol

from atom_like.entrypoints.protocol import ErrorInfo, ErrorResponse

OPEN_PATHS = ("/health",)  # what --api-key leaves open (plus /metrics with --public-metrics)


async def send_error(send, status: int, message: str, code: str | None = None, param: str | None = None,
                     request_id: str | None = None, type: str = "invalid_request_error",
                     close: bool = True) -> None:
    """`close=False` for refusals sent before the client has finished uploading its body: closing
    a socket with unread bytes makes the kernel send a reset, which can destroy the response the
    client has not read yet. Kept open, uvicorn discards the rest of the body and the connection
    serves the next request; TimedH11Protocol bounds that drain by the header timeout."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Per HTTP request: a request id (scope["state"]["request_id"], echoed as X-Request-Id);
    the API key (one well-formed `Authorization: Bearer KEY` header, on every path but
    OPEN_PATHS); then the whole body, read here within `read_timeout` seconds of the request's
    start and at most `max_body_bytes` long (413 as soon as it is known to be longer, from
    Content-Length or while reading), and handed to the app in one piece."""

    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...], max_body_bytes: int,
                 read_timeout: float):
        self.app, self.max_body_bytes, self.read_timeout = app, max_body_bytes, read_timeout
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        refusal = self._check_auth(scope)
        if refusal is not None:
            return await send_error(send, 401, refusal, "invalid_api_key", request_id=request_id, close=False)
        lengths = [v for k, v in scope["headers"] if k == b"content-length"]
        if lengths and (len(lengths) > 1 or not lengths[0].isdigit()):
            return await send_error(send, 400, "one Content-Length header with a decimal length is allowed",
                                    request_id=request_id)
        if lengths and int(lengths[0]) > self.max_body_bytes:
            return await self._too_large(send, request_id)
        chunks, size = [], 0
        try:
            while True:
                remaining = self.read_timeout - (time.monotonic() - start)
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
                if message["type"] == "http.disconnect":
                    return  # gone before sending its request: nobody to answer
                size += len(message.get("body", b""))
                if size > self.max_body_bytes:
                    return await self._too_large(send, request_id)
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {self.read_timeout:g} s "
                                               "(--read-timeout)", "request_timeout", request_id=request_id)
        body = b"".join(chunks)
        replayed = False

        async def receive_replayed():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect is left to come

        await self.app(scope, receive_replayed, send_with_id)

    def _check_auth(self, scope) -> str | None:
        if self.expected is None or scope["path"] in self.open_paths:
            return None
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if not given:
            return "missing API key: send 'Authorization: Bearer <key>'"
        if len(given) > 1:
            return "more than one Authorization header: send exactly one"
        if not given[0].startswith(b"Bearer ") or len(given[0].split()) != 2:
            return "malformed Authorization header: expected 'Bearer <key>'"
        if not secrets.compare_digest(given[0], self.expected):
            return "invalid API key"
        return None

    async def _too_large(self, send, request_id: str) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_body_bytes} bytes "
                                    "(--max-request-bytes)", "request_too_large", request_id=request_id,
                         close=False)


class TimedH11Protocol(H11Protocol):
    """uvicorn closes idle keep-alive connections, but a connection whose request headers stop
    arriving half-way is held forever. This one closes any connection that has not started a
    request `header_timeout` seconds after it opened or after its previous response. (The body
    has its own deadline in RequestGuard.)"""

    header_timeout = 30.0  # set by the server from --read-timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        waiting_after = self.cycle
        self.loop.call_later(self.header_timeout, self._expire, waiting_after)

    def _expire(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():  # no new request since
            self.transport.close()
