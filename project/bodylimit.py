"""A request-body size limit at the ASGI edge, before Django reads a byte of the body.

Django's ASGI handler reads the whole body (into a spooled file) before any view or middleware
runs, so a view's size check came after the upload was stored: anyone, without an API key, could
send a body of any size. This middleware runs first:

- a declared Content-Length over the limit: 413 at once, nothing read;
- a body without one (chunked): counted as it arrives and cut off at the limit with the same 413;
- else the body (at most the limit) is handed to Django unchanged.

The limit is CEILING_MAX_BODY_BYTES, and for /v1/ and the management API (/manage/v1/) the smaller
CEILING_MAX_FRAME_BYTES (an API body is one chat request, a management body one change); /v1 answers
in OpenAI's error shape, /manage/v1/ in its own JSON shape, other paths in plain text.

daphne's Twisted side stores a request's whole body before it calls the application at all, so
limit_daphne_bodies() applies the same limits inside daphne, as the bytes arrive (see there); the
middleware is what holds under another ASGI server (uvicorn).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from django.conf import settings

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_PREFIX = "/v1/"
MANAGE_PREFIX = "/manage/v1/"


def limit_for(path: str) -> int:
    if path.startswith((API_PREFIX, MANAGE_PREFIX)):
        return min(settings.CEILING_MAX_FRAME_BYTES, settings.CEILING_MAX_BODY_BYTES)
    return settings.CEILING_MAX_BODY_BYTES


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header as a number; None without one; -1 when it is not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else -1
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = limit_for(scope.get("path", ""))
        declared = declared_length(scope)
        if declared is not None and declared < 0:
            await answer(scope, send, 400, "bad_request", "The Content-Length header is not a number.")
            return
        if declared is not None and declared > limit:
            await too_large(scope, send, f"{declared:,} bytes", limit)
            return
        body, more, first_other = await read_up_to(receive, limit)
        if more is None:  # over the limit as it arrived
            await too_large(scope, send, f"over {limit:,} bytes", limit)
            return
        if first_other is not None and first_other["type"] == "http.disconnect":
            return  # the client went away mid-body: nobody to answer
        await self.app(scope, replay(body, receive), send)


async def read_up_to(receive: Receive, limit: int) -> tuple[bytes, bool | None, Message | None]:
    """(body, False, None) when the whole body fits; (b"", None, None) past the limit; (…, …, the
    message that ended the body early: a disconnect)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), False, message
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", None, None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False, None


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read here once, then whatever the server sends (a disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def too_large(scope: Scope, send: Send, size: str, limit: int) -> None:
    await answer(scope, send, 413, "request_too_large", f"The request body is {size}; the limit is {limit:,} bytes.")


async def answer(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    body, content_type = error_body(scope.get("path", ""), code, message)
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_body(path: str, code: str, message: str) -> tuple[bytes, bytes]:
    """(body, content type) of a refusal: OpenAI's error shape under /v1/, the management API's under
    /manage/v1/ (control/http.py), a plain sentence elsewhere."""
    if path.startswith(MANAGE_PREFIX):
        return json.dumps({"error": {"code": code, "message": message, "field": None}}).encode(), b"application/json"
    if path.startswith(API_PREFIX):
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        return json.dumps({"error": error}).encode(), b"application/json"
    return (message + "\n").encode(), b"text/plain; charset=utf-8"


def limit_daphne_bodies() -> None:
    """Make daphne (Twisted) refuse an over-limit body as it arrives, instead of storing it first; idempotent.

    Twisted reads a request's whole body (into memory, or a temp file when large) before daphne
    calls the application, so the middleware alone would answer only after the upload. Here, a
    Content-Length over the path's limit is answered 413 the moment the headers are read, and a
    chunked body the moment its count passes the limit; what follows is read off the socket and
    dropped (so the client, still sending, can read the answer), and the connection closed when the
    body ends. The application never sees such a request.
    """
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "ceiling_limited", False):
        return
    got_length, content_chunk, process = WebRequest.gotLength, WebRequest.handleContentChunk, WebRequest.process

    def gotLength(self, length):  # noqa: N802 - Twisted's names
        path = _request_path(self)
        self.ceiling_limit, self.ceiling_received, self.ceiling_refused = limit_for(path), 0, False
        if length is not None and length > self.ceiling_limit:
            _refuse(self, path, f"{length:,} bytes")
            length = 0  # keep nothing
        got_length(self, length)

    def handleContentChunk(self, data):  # noqa: N802
        if self.ceiling_refused:
            return  # dropped: the answer went out already
        self.ceiling_received += len(data)
        if self.ceiling_received > self.ceiling_limit:
            _refuse(self, _request_path(self), f"over {self.ceiling_limit:,} bytes")
            return
        content_chunk(self, data)

    def process_unless_refused(self):
        if getattr(self, "ceiling_refused", False):
            self.channel.transport.loseConnection()  # answered already; the body has ended
            return None
        return process(self)

    WebRequest.ceiling_limited = True
    WebRequest.gotLength = gotLength
    WebRequest.handleContentChunk = handleContentChunk
    WebRequest.process = process_unless_refused


def _request_path(request) -> str:
    # Twisted sets request.path only once the body is in; the channel has the request line already.
    raw = getattr(request.channel, "_path", b"") or b""
    return raw.split(b"?", 1)[0].decode("latin-1")


def _refuse(request, path: str, size: str) -> None:
    request.ceiling_refused = True
    body, content_type = error_body(path, "request_too_large",
                                    f"The request body is {size}; the limit is {request.ceiling_limit:,} bytes.")
    head = (b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: " + content_type
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    request.channel.transport.write(head + body)
