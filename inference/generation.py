"""Run one admitted request through the engine and stream it to the web process that waits for it.

Called by the Celery task with a request id and the waiting process's inbox (inference/bus.py).
The ledger is settled here, before the final frame is sent, so it never depends on the stream
(which is at-most-once). A request whose
provider is a remote OpenAI-compatible server streams from it instead (inference/remote.py) and
ends through the same _finish, with the token counts the remote reported.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from budgets.models import Provider, TokenLog, unique_row

from . import bus, remote
from .actions import do_finish_request, settle_reservation
from .engine import FINISH_CANCELLED, FINISH_ERROR, EngineError, get_engine

log = logging.getLogger(__name__)


class IncrementalDecoder:
    """Token ids → text pieces in O(1) per token, holding back an incomplete UTF-8 character.

    Decoding the whole answer at every token costs O(n) each, O(n²) per answer. As vLLM does, only a
    short window is decoded: the text of ids[prefix:] minus that of ids[prefix:read] is what the new
    ids added (a byte-level BPE decodes a window exactly as it does inside the whole answer; a test
    checks the pieces add up to the full decode).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window starts here: context for the ids being decoded
        self.read_offset = 0  # ids before this have been sent as text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        known = self._decode(self.prefix_offset, self.read_offset)
        extended = self._decode(self.prefix_offset, len(self.ids))
        if len(extended) <= len(known) or extended.endswith("\ufffd"):
            return ""  # nothing printable yet, or a character still incomplete: wait for more ids
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return extended[len(known) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True) if end > start else ""


class FrameBuffer:
    """Answer text waiting for its frame: the first piece goes at once, then one frame per `interval` tokens.

    With interval 1 every piece goes out as it comes. A longer interval trades smoothness for the
    CPU each delivered frame costs (SGLang's --stream-interval); TTFT is never delayed.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.text = ""
        self.tokens = 0  # generated since the last frame, including ids the decoder still holds back
        self.sent_any = False

    def add(self, piece: str, tokens: int) -> str:
        """What to send now ("" to hold it back for now)."""
        self.text += piece
        self.tokens += tokens
        if not self.text or (self.sent_any and self.tokens < self.interval):
            return ""
        return self.take()

    def take(self) -> str:
        """Everything held back (the end of the answer goes out whatever the interval)."""
        text, self.text, self.tokens = self.text, "", 0
        self.sent_any = self.sent_any or bool(text)
        return text


def run_generation(request_id: str, reply_to: str = "") -> None:
    """Generate, settle the ledger, and always settle the guard's reservation (in the finally).

    reply_to is the inbox of the web process waiting for the frames (bus.StreamInbox); "" when
    nobody waits (batch jobs, refinement loops): the answer goes only to the ledger.
    """
    try:
        _generate(request_id, reply_to)
    finally:
        settle_reservation(request_id)


def _generate(request_id: str, reply_to: str) -> None:
    log_row = unique_row(TokenLog.objects.select_related("transcript", "provider", "feature").filter(request_id=request_id))
    if log_row is None:
        log.warning("generate: unknown request %s", request_id)
        return
    if log_row.status != TokenLog.Status.RUNNING:
        return  # settled already: a redelivered task changes nothing
    if bus.is_cancel_requested(request_id):
        _finish(log_row, reply_to, [], "", FINISH_CANCELLED, None)
        return
    # From here on, a web process that hears nothing can check whether this worker is still alive.
    bus.claim_request(request_id, settings.CEILING_RESERVATION_TTL_S)
    # Everything below reads the row and its select_related parts only; _finish checks a connection out again.
    release_database_connection()
    if log_row.provider is not None and log_row.provider.kind == Provider.Kind.OPENAI_COMPATIBLE:
        _generate_remote(log_row, reply_to)
        return
    prompt_ids = log_row.transcript.prompt_ids
    try:
        # The feature's weight variant (Feature.quantization); a worker loads a variant at its first request.
        engine = get_engine(log_row.feature.quantization if log_row.feature else None)
        stream = TokenStream(engine.tokenizer, log_row, reply_to)
        handle = engine.submit(request_id, prompt_ids, log_row.max_tokens, ignore_eos=settings.CEILING_IGNORE_EOS,
                               listener=stream.on_event)
    except EngineError as exc:
        _finish(log_row, reply_to, [], "", FINISH_ERROR, None, error=str(exc))
        return
    if bus.is_cancel_requested(request_id):  # the cancel may have landed between the check and submit
        engine.cancel(request_id)
    finish_reason, error = _wait_for_the_end(engine, handle)
    stream.close()
    _finish(log_row, reply_to, handle.tokens, stream.decoder.text(), finish_reason, stream.ttft_ms, error=error,
            frames=stream.seq)


class TokenStream:
    """One request's tokens → text frames → its web process, run by the engine's pump thread.

    The pump calls on_event for every request it routes, so an engine step costs one thread's
    work, not a wake-up of every request's task thread (with 20-60 requests a step, those wake-ups
    and their turns at the GIL preempted the engine's two compute threads on a 2-core machine).
    The frames go to the process's sender, which bundles a step's frames into one push.
    """

    def __init__(self, tokenizer, log_row: TokenLog, reply_to: str) -> None:
        self.log_row = log_row
        self.reply_to = reply_to
        self.sender = bus.channel_sender()
        self.decoder = IncrementalDecoder(tokenizer)
        self.frames = FrameBuffer(settings.CEILING_STREAM_INTERVAL)
        self.ttft_ms: int | None = None
        self.seq = 0  # token frames sent
        self._lock = threading.Lock()  # the pump's on_event against the task thread's close
        self._closed = False

    def on_event(self, event) -> None:
        """In the pump thread: decode the new tokens and send what is due."""
        with self._lock:
            if self._closed:
                return
            if event.new_tokens and self.ttft_ms is None:
                self.ttft_ms = _ms_since(self.log_row.created_at)
            text = self.frames.add(self.decoder.push(event.new_tokens), len(event.new_tokens))
            if text:
                self._send(text)

    def close(self) -> None:
        """In the task thread, after the end: send what was held back; nothing is sent after this."""
        with self._lock:
            self._closed = True
            rest = self.frames.take()
            if rest:
                self._send(rest)

    def _send(self, text: str) -> None:
        # Its progress is recorded before it is sent: if this worker dies, the ledger counts every
        # token a user saw. The hand-over does not wait; _finish's frame goes out after it.
        request_id = self.log_row.request_id
        token = {"type": "chat.token", "request_id": request_id, "text": text, "seq": self.seq}
        self.sender.send_frame(self.reply_to, request_id, token, tokens_streamed=len(self.decoder.ids))
        self.seq += 1


def _wait_for_the_end(engine, handle) -> tuple[str, str]:
    """(finish reason, error) of a listened-to request, enforcing the engine's idle and total limits."""
    idle_limit = settings.CEILING_ENGINE_FIRST_TOKEN_S
    deadline = time.monotonic() + settings.CEILING_ENGINE_DEADLINE_S
    error = ""
    while True:
        now = time.monotonic()
        idle_left = idle_limit - (now - handle.last_output_at)
        if idle_left <= 0:
            engine.cancel(handle.request_id)
            return FINISH_ERROR, f"the engine produced nothing for {idle_limit:.0f} s"
        if not error and now > deadline:
            engine.cancel(handle.request_id)  # its cancelled end follows at once
            error = f"the answer took longer than {settings.CEILING_ENGINE_DEADLINE_S:.0f} s"
        wait = idle_left if error else min(idle_left, deadline - now)
        end = handle.wait_end(timeout=max(wait, 0.01))
        if end is None:
            continue
        if error and end.finish_reason == FINISH_CANCELLED:
            return FINISH_ERROR, error  # our own deadline cancelled it: a failure, not the user's cancel
        return end.finish_reason, end.error or error


def _generate_remote(log_row: TokenLog, reply_to: str) -> None:
    """Stream from the provider's server; the remote's own token counts go to the ledger."""
    try:
        stream = remote.open_stream(
            log_row.request_id, log_row.provider, log_row.model, log_row.transcript.messages, log_row.max_tokens
        )
    except remote.RemoteConfigError as exc:
        _finish(log_row, reply_to, [], "", FINISH_ERROR, None, error=str(exc), completion_tokens=0)
        return
    try:
        stream.start(read_timeout_s=settings.CEILING_ENGINE_DEADLINE_S)
        sender = bus.channel_sender()
        ttft_ms = None
        seq = 0
        finish_reason, error = FINISH_ERROR, ""
        for event in stream.events(settings.CEILING_ENGINE_FIRST_TOKEN_S, settings.CEILING_ENGINE_DEADLINE_S):
            if event.text:
                if ttft_ms is None:
                    ttft_ms = _ms_since(log_row.created_at)
                token = {"type": "chat.token", "request_id": log_row.request_id, "text": event.text, "seq": seq}
                # The remote's own count comes at the end.
                sender.send_frame(reply_to, log_row.request_id, token, tokens_streamed=seq + 1)
                seq += 1
            if event.finished:
                finish_reason, error = event.finish_reason, event.error or ""
                break
    finally:
        remote.close_stream(stream)
    # Tokenizers differ: the guard admitted on our count of the prompt; the ledger keeps the remote's.
    _finish(
        log_row,
        reply_to,
        [],
        stream.text,
        finish_reason,
        ttft_ms,
        error=error,
        prompt_tokens=stream.prompt_tokens,
        completion_tokens=stream.completion_tokens,
        frames=seq,
    )


def _finish(
    log_row: TokenLog,
    reply_to: str,
    completion_ids: list[int],
    text: str,
    finish_reason: str,
    ttft_ms: int | None,
    error: str = "",
    *,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    frames: int = 0,
) -> None:
    """Settle the ledger and tell the user. A remote request passes its token counts (no local ids)."""
    status = {
        FINISH_CANCELLED: TokenLog.Status.CANCELLED,
        FINISH_ERROR: TokenLog.Status.FAILED,
    }.get(finish_reason, TokenLog.Status.OK)
    settled = _with_database_retry(
        do_finish_request,
        log_row.request_id,
        status=status,
        prompt_tokens=log_row.prompt_tokens if prompt_tokens is None else prompt_tokens,
        completion_ids=completion_ids,
        completion_tokens=completion_tokens,
        text=text,
        finish_reason="" if status == TokenLog.Status.FAILED else finish_reason,
        ttft_ms=ttft_ms,
        error=error,
    )
    bus.release_claim(log_row.request_id)
    if settled is None:
        return
    # Release the reservation before telling the user, so their next request sees the freed room.
    settle_reservation(settled.request_id)
    sender = bus.channel_sender()
    if status == TokenLog.Status.FAILED:
        message = {"type": "chat.failed", "request_id": settled.request_id, "code": "engine_failed", "message": f"The model could not finish this answer: {error}."}
    else:
        message = {
            "type": "chat.done",
            "request_id": settled.request_id,
            "usage": settled.usage(),
            "cost_usd": settled.cost_usd,
            "ttft_ms": settled.ttft_ms,
            "total_ms": settled.total_ms,
            "finish_reason": settled.finish_reason,
            # How many token frames were sent: a client that got fewer lost some (the stream
            # is at-most-once) and fetches the stored transcript instead.
            "frames": frames,
        }
    sender.send_frame(reply_to, settled.request_id, message, wait=True)


# How long the end of a stream waits for a database that went away: a short outage must not leave
# the row "running" (and its reservation held) until reconciliation, 10 minutes later.
DATABASE_RETRY_S = 30.0


def _with_database_retry(write, *args, **kwargs):
    """Run a ledger write; while the database is unreachable, reconnect and try again for a while."""
    deadline = time.monotonic() + DATABASE_RETRY_S
    while True:
        try:
            return write(*args, **kwargs)
        except DatabaseError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("the database is unavailable (%s); retrying the ledger write", exc)
            close_old_connections()  # drops the broken connection; the next try opens a fresh one
            time.sleep(1.0)


def release_database_connection() -> None:
    """Hand this thread's connection back to the pool while the answer streams (for minutes, maybe).

    A worker runs one thread per chat in flight; holding a connection each would need a pool as large
    as the batch. _finish checks one out again to settle the ledger.
    """
    connection.close()


def _ms_since(moment) -> int:
    return max(0, int((timezone.now() - moment).total_seconds() * 1000))
