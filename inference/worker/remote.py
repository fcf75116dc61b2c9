"""Stream an answer from a remote OpenAI-compatible server: vLLM, TGI, a hosted API, another Ceiling.

A Feature whose provider has kind "openai-compatible" is served by this instead of the local engine:
worker/handles.py wraps it in the same Generation interface as the engine, so the worker treats
both alike:

    stream = open_stream(request_id, provider, model, messages, max_tokens)
    for event in stream.events(first_token_s, deadline_s):   # RemoteEvent(text, finished, …)
        ...
    stream.prompt_tokens, stream.completion_tokens             # as the remote reported them

- One reader thread per request does the HTTP (POST {base_url}/chat/completions, stream=true,
  `stream_options.include_usage`) and parses the server-sent events into a queue; the worker's
  thread reads that queue. Every request of a worker process goes through one pooled client
  (shared_client), so a request reuses a kept-alive connection and the client's setup is paid
  once: a new client per request cost ~60 ms of CPU each (its TLS context), under the GIL, and a
  24-request burst queued ~0.5 s behind it (docs/benchmarks.md, "Through the gateway to a remote"). So a cancel or a timeout ends the request at once, whatever the socket
  is doing; the reader notices at its next line and closes the connection, which tells the remote
  to stop generating (a remote Ceiling logs its side cancelled).
- Cancellation arrives two ways: the worker's cancel listener calls cancel(request_id) for every
  broadcast cancel (the registry below), and events() also polls is_cancel_requested, which
  covers a cancel published before this stream was registered.
- Timeouts are layered: connecting within CONNECT_TIMEOUT_S, the first piece of text within the
  engine's first-token limit, the end within the engine's deadline.
- Usage is what the remote reports in its final usage chunk. A server that sends none is counted
  at the larger of one token per text chunk and the text's size at three bytes a token, never more
  than max_tokens (what was reserved), and the prompt keeps its reservation's estimate
  (budgets/estimates.py).
- Output is bounded by max_tokens even when a remote ignores it: every text chunk holds at least one
  token, so a chunk past max_tokens ends the answer (finish_reason length) and hangs up.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import httpx2 as httpx
import redis

from budgets.estimates import text_estimate
from budgets.models import API_KEY_ENV_PREFIX, Provider, allowed_key_env
from budgets.outbound import PROVIDER, OutboundRefused, error_excerpt, policy_client
from budgets.vault import SecretsUnavailable, unseal
from inference.bus.cancel import is_cancel_requested
from inference.bus.trace import mark
from inference.engine import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)

# The request fields a client's completion may carry on to the remote server, unchanged.
PASSED_THROUGH = (
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
)
REMOTE_FINISH = {"length": FINISH_LENGTH, "tool_calls": "tool_calls"}  # anything else ended it as a stop

CONNECT_TIMEOUT_S = 5.0
# Connections the shared client keeps open between requests (per worker process): a burst's worth,
# so the next burst finds them open. No cap on connections in use: the worker's thread count caps them.
KEEPALIVE_CONNECTIONS = 64
DRAIN_LINES = 8  # lines read after [DONE] for the body's end before the connection is given up
CANCEL_POLL_S = 0.25  # how often events() looks at the cancel key in Redis while it waits
ERROR_DETAIL_CHARS = 200


@dataclass
class RemoteEvent:
    """A piece of the answer, and maybe its end (finish_reason stop|length|cancelled|error)."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None  # the remote's logprobs.content entries of this piece, as it sent them
    # The remote could not take the request (429, 5xx, no connection, no first token in time): another
    # provider may (worker/handles.py fails over when nothing reached the client yet).
    retryable: bool = False


class RemoteConfigError(RuntimeError):
    """The provider cannot be called from this worker; the message is safe to show to a user."""


_CANCELLED = object()  # pushed into a stream's queue by cancel()
_READER_DONE = object()  # the reader thread has nothing more to say


class RemoteStream:
    """One request streaming from a remote server; iterate events() to read it."""

    def __init__(self, request_id: str, url: str, headers: dict[str, str], body: dict, label: str) -> None:
        self.request_id = request_id
        self.url = url
        self.headers = headers
        self.body = body
        self.label = label  # how errors name the server: "the remote provider 'gpu-farm'"
        self.outputs: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.prompt_tokens: int | None = None  # from the remote's usage chunk, when it sends one
        self.reported_completion_tokens: int | None = None
        self.chunks = 0  # text chunks received: the count when the remote reports no usage
        self.max_tokens = int(body.get("max_tokens") or 0)
        self.cut_off = False  # the remote went past max_tokens and we hung up
        self.text = ""
        # Tool calls by index, merged from the remote's deltas (the reader writes them before the end).
        self._tool_calls: dict[int, dict] = {}
        self._reader: threading.Thread | None = None

    def tool_calls(self) -> list | None:
        """The remote's tool calls, whole and in order, as its deltas built them; None when it made none."""
        return [self._tool_calls[index] for index in sorted(self._tool_calls)] or None

    @property
    def completion_tokens(self) -> int:
        """The remote's count; without one, an upper estimate within what was reserved (max_tokens)."""
        if self.reported_completion_tokens is not None:
            return self.reported_completion_tokens
        return min(self.max_tokens, max(self.chunks, text_estimate(self.text)))

    # --- the worker's side ----------------------------------------------------------------------

    def start(self, read_timeout_s: float) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(read_timeout_s,), name=f"remote-{self.request_id[:8]}", daemon=True
        )
        self._reader.start()

    def cancel(self) -> None:
        self.stop.set()
        self.outputs.put(_CANCELLED)

    def events(self, first_token_s: float, deadline_s: float) -> Iterator[RemoteEvent]:
        """Yield pieces of text until the end, which is always the last event (finished=True)."""
        started = time.monotonic()
        next_cancel_poll = started
        first_seen = False
        try:
            while True:
                now = time.monotonic()
                if now >= next_cancel_poll:
                    next_cancel_poll = now + CANCEL_POLL_S
                    if cancel_requested(self.request_id):
                        yield RemoteEvent("", finished=True, finish_reason=FINISH_CANCELLED)
                        return
                if not first_seen and now - started > first_token_s:
                    yield _failed(f"{self.label} produced nothing for {first_token_s:.0f} s", retryable=True)
                    return
                if now - started > deadline_s:
                    yield _failed(f"the answer took longer than {deadline_s:.0f} s")
                    return
                try:
                    item = self.outputs.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    continue
                if item is _CANCELLED:
                    yield RemoteEvent("", finished=True, finish_reason=FINISH_CANCELLED)
                    return
                if item is _READER_DONE:  # the reader always sends an end first; this is a safety net
                    yield _failed(f"{self.label} ended the stream without finishing the answer")
                    return
                if not item.finished:
                    first_seen = True  # a tool call's delta is progress too, though it has no text
                if item.text:
                    self.text += item.text
                yield item
                if item.finished:
                    return
        finally:
            # Whatever ended it (the end, a cancel, a timeout, a caller that stopped reading), the
            # reader must hang up so the remote stops generating.
            self.stop.set()

    # --- the reader thread: the only code that touches the connection ----------------------------

    def _read(self, read_timeout_s: float) -> None:
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s, write=10.0, pool=CONNECT_TIMEOUT_S)
        try:
            mark(self.request_id, "sent")
            with shared_client().stream("POST", self.url, json=self.body, headers=self.headers, timeout=timeout) as response:
                mark(self.request_id, "connected")
                if response.status_code >= 300:  # a redirect is not followed: it is an error like a 4xx
                    response.read()
                    status = response.status_code
                    self._put(_failed(http_error_message(self.label, status, response.text), retryable=retryable_status(status)))
                    return
                lines = response.iter_lines()
                end = self._parse(lines)
                if end is not None and end.finish_reason != FINISH_ERROR and not self.cut_off:
                    self._drain(lines)
                self._put(end)
        except OutboundRefused as exc:  # the outbound policy, checked at connect time
            self._put(_failed(f"{label_refused(self.label)}: {exc}"))
        except httpx.ConnectTimeout:
            self._put(_failed(f"{self.label} did not accept a connection within {CONNECT_TIMEOUT_S:.0f} s", retryable=True))
        except httpx.ConnectError as exc:
            self._put(_failed(f"could not connect to {self.label} ({_reason(exc)})", retryable=True))
        except httpx.ReadTimeout:
            self._put(_failed(f"{self.label} stopped sending for {read_timeout_s:.0f} s"))
        except httpx.HTTPError as exc:
            self._put(_failed(f"the connection to {self.label} failed ({_reason(exc)})"))
        except Exception as exc:  # noqa: BLE001 - whatever happens here, the worker must hear of an end
            log.exception("remote stream %s failed", self.request_id)
            self._put(_failed(f"the answer from {self.label} could not be read ({type(exc).__name__})"))
        finally:
            self.outputs.put(_READER_DONE)

    def _drain(self, lines: Iterator[str]) -> None:
        """Read what follows [DONE] (the body's end, at once from a well-behaved server), so the
        connection goes back to the pool; one that goes on sending is closed instead."""
        try:
            for count, _ in enumerate(lines):
                if count >= DRAIN_LINES or self.stop.is_set():
                    return
        except httpx.HTTPError:
            pass  # the answer is whole; only this connection is not reused

    def _put(self, event: RemoteEvent | None) -> None:
        if event is not None and not self.stop.is_set():
            self.outputs.put(event)

    def _parse(self, lines: Iterator[str]) -> RemoteEvent | None:
        """Queue each text piece; return the end (None when we stopped reading first)."""
        finish_reason: str | None = None
        for line in lines:
            if self.stop.is_set():
                return None
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" and "id:" fields
            data = line[5:].strip()
            if data == "[DONE]":
                return RemoteEvent("", finished=True, finish_reason=finish_reason or FINISH_STOP)
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                return _failed(f"{self.label} sent something that is not a JSON chunk")
            if not isinstance(chunk, dict):
                return _failed(f"{self.label} sent something that is not a JSON chunk")
            if chunk.get("error"):
                return _failed(f"{self.label} failed mid-answer: {_error_text(chunk['error'])}")
            self._read_usage(chunk.get("usage"))
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                logprobs = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
                if text or logprobs:
                    if self.max_tokens and self.chunks >= self.max_tokens:
                        # Each chunk is a token at least: this remote is past max_tokens. Stop paying.
                        self.cut_off = True
                        return RemoteEvent("", finished=True, finish_reason=FINISH_LENGTH)
                    if not self.chunks:
                        mark(self.request_id, "first_byte")
                    self.chunks += 1
                    self.outputs.put(RemoteEvent(text, logprobs=logprobs or None))
                if isinstance(delta.get("tool_calls"), list):
                    self._merge_tool_calls(delta["tool_calls"])
                    self.outputs.put(RemoteEvent(""))
                if choice.get("finish_reason"):
                    finish_reason = REMOTE_FINISH.get(choice["finish_reason"], FINISH_STOP)
        if self.stop.is_set():
            return None
        if finish_reason is not None:  # some servers close without [DONE]
            return RemoteEvent("", finished=True, finish_reason=finish_reason)
        return _failed(f"{self.label} closed the stream before the answer ended")

    def _merge_tool_calls(self, deltas: list) -> None:
        """OpenAI streams a tool call in pieces: id, type and name once, the arguments' text in parts."""
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index", len(self._tool_calls))
            call = self._tool_calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            for name in ("id", "type"):
                if delta.get(name):
                    call[name] = delta[name]
            function = delta.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""

    def _read_usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and prompt >= 0:
            self.prompt_tokens = prompt
        if isinstance(completion, int) and completion >= 0:
            self.reported_completion_tokens = completion


# --- opening a stream ----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def shared_client() -> httpx.Client:
    """The worker process's one HTTP client for every remote server (thread-safe, pooled).

    A stream that ends early (a cancel, a timeout) closes its connection rather than return it half
    read, so the remote still hears the hang-up and stops generating.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)
    # Every connection is checked against the outbound policy (budgets/outbound.py) as it is opened.
    return policy_client(PROVIDER, limits=limits, timeout=httpx.Timeout(CONNECT_TIMEOUT_S))


def label_refused(label: str) -> str:
    return f"{label} is refused by the outbound policy"



def open_stream(request_id: str, provider: Provider, model: str, messages: list[dict], max_tokens: int,
                params: dict | None = None) -> RemoteStream:
    """Build the request; start() sends it. `params`: the client's sampling and tool fields, passed on as given."""
    label = f"the remote provider {provider.name!r}"
    if not provider.base_url:
        raise RemoteConfigError(f"{label} has no base URL")
    headers = {"Accept": "text/event-stream"}
    key = provider_api_key(provider, label)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {
        "model": provider.remote_model or model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **{name: value for name, value in (params or {}).items() if name in PASSED_THROUGH},
    }
    return RemoteStream(request_id, provider.base_url.rstrip("/") + "/chat/completions", headers, body, label)


def provider_api_key(provider: Provider, label: str) -> str:
    """The key staff stored (decrypted here, at use), else the allowed environment variable's; "" for none.

    The variable's name is checked again here, not only by the form: a row written some other way
    (an old row, the admin, a script) must not make this worker send SECRET_KEY or DATABASE_URL out.
    """
    if provider.api_key_encrypted:
        try:
            return unseal(provider.api_key_encrypted)
        except SecretsUnavailable as exc:
            raise RemoteConfigError(f"{label}'s stored API key cannot be read on this worker: {exc}") from None
    if not provider.api_key_env:
        return ""
    if not allowed_key_env(provider.api_key_env):
        raise RemoteConfigError(
            f"{label} names {provider.api_key_env} for its API key; only variables starting {API_KEY_ENV_PREFIX} "
            "are read (staff: enter the key on the provider's page, or rename the variable)"
        )
    key = os.environ.get(provider.api_key_env)
    if not key:
        raise RemoteConfigError(f"{label} needs an API key, but {provider.api_key_env} is not set on this worker")
    return key


# --- helpers ---------------------------------------------------------------------------------------


def http_error_message(label: str, status: int, body: str) -> str:
    """A sentence for a refused request: who refused, the status, and the server's own words."""
    detail = _error_detail(body)
    if 300 <= status < 400:
        return f"{label} answered with a redirect (HTTP {status}), which is not followed: correct the provider's URL"
    if status in (401, 403):
        what = f"{label} refused our credentials"
    elif status == 429:
        what = f"{label} is rate limiting or out of quota"
    elif status >= 500:
        what = f"{label} failed"
    else:
        what = f"{label} rejected the request"
    return f"{what} (HTTP {status}{': ' + detail if detail else ''})"


def _error_detail(body: str) -> str:
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return error_excerpt(body, ERROR_DETAIL_CHARS)
    if isinstance(parsed, dict) and parsed.get("error"):
        return _error_text(parsed["error"])
    if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        return error_excerpt(parsed["message"], ERROR_DETAIL_CHARS)
    return ""


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        error = error.get("message") or error.get("code") or ""
    return error_excerpt(str(error).rstrip("."), ERROR_DETAIL_CHARS)


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused"
    return text[:ERROR_DETAIL_CHARS] or type(exc).__name__


def retryable_status(status: int) -> bool:
    """Rate limited or failed on the server's side: another server may answer. A 4xx is about the request."""
    return status == 429 or status >= 500


def _failed(error: str, *, retryable: bool = False) -> RemoteEvent:
    return RemoteEvent("", finished=True, finish_reason=FINISH_ERROR, error=error, retryable=retryable)


def cancel_requested(request_id: str) -> bool:
    """Whether a cancel of the request was published; False when Redis cannot say (a cancel also arrives by the listener)."""
    try:
        return is_cancel_requested(request_id)
    except redis.RedisError as exc:
        log.warning("could not check the cancel key of %s: %s", request_id, exc)
        return False
