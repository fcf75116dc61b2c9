"""Run one admitted request and stream it to the web process that waits for it.

Called by the Celery task with a request id and the waiting process's inbox (inference/bus/inbox.py).
The generation is the local engine's or a remote server's (worker/handles.py: one interface for
both); its pieces of text become token frames here, and its outcome settles the ledger here, before
the final frame is sent, so the ledger never depends on the stream (which is at-most-once).
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from budgets.alerts import raise_overshoot_alert
from budgets.models import TokenLog, unique_row
from inference.actions import do_finish_request, settle_reservation
from inference.bus.cancel import is_cancel_requested
from inference.bus.outbox import channel_sender
from inference.bus.ownership import claim_request, release_claim
from inference.bus.trace import mark
from inference.engine import FINISH_CANCELLED, FINISH_ERROR
from inference.worker.handles import GenerationError, Outcome, open_generation, running
from project import tracing

log = logging.getLogger(__name__)


class FrameBuffer:
    """Answer text waiting for its frame: the first piece goes at once, then a frame once `interval`
    tokens and `frame_ms` milliseconds have gathered since the last one.

    Every delivered frame costs CPU in the worker's streaming thread, Redis and daphne, which share
    the engine's cores: a lone chat through `make run` on a 2-core Intel Xeon took ~8.5 ms a token
    with a frame per token and 5.8-7.4 with one per four (~25 ms). A held piece waits at most for
    the next step's tokens (one time per token); TTFT is never delayed, and the end goes out at once.
    """

    def __init__(self, interval: int, frame_ms: float = 0.0, clock=time.monotonic) -> None:
        self.interval = interval
        self.frame_s = frame_ms / 1000
        self.clock = clock
        self.text = ""
        self.tokens = 0  # generated since the last frame, including ids the decoder still holds back
        self.logprobs: list = []  # OpenAI logprobs entries of those tokens, when the request asked
        self.sent_any = False
        self.last_frame_at = 0.0
        self.taken_logprobs: list = []  # those of the text the last take() returned

    def add(self, piece: str, tokens: int, logprobs: list | None = None) -> str:
        """What to send now ("" to hold it back for now); its tokens' logprobs are in taken_logprobs."""
        self.text += piece
        self.tokens += tokens
        self.logprobs.extend(logprobs or ())
        if not self.text:
            return ""
        if self.sent_any and (self.tokens < self.interval or self.clock() - self.last_frame_at < self.frame_s):
            return ""
        return self.take()

    def take(self) -> str:
        """Everything held back (the end of the answer goes out whatever the interval)."""
        text, self.taken_logprobs = self.text, self.logprobs
        self.text, self.tokens, self.logprobs = "", 0, []
        self.sent_any = self.sent_any or bool(text)
        self.last_frame_at = self.clock()
        return text


def run_generation(request_id: str, reply_to: str = "") -> None:
    """Generate, settle the ledger, and always settle the guard's reservation (in the finally).

    reply_to is the inbox of the web process waiting for the frames (bus/inbox.py); "" when
    nobody waits (batch jobs): the answer goes only to the ledger.
    """
    try:
        _generate(request_id, reply_to)
    finally:
        settle_reservation(request_id)


def _generate(request_id: str, reply_to: str) -> None:
    mark(request_id, "picked")
    log_row = unique_row(TokenLog.objects.select_related("transcript", "provider", "feature").filter(request_id=request_id))
    if log_row is None:
        log.warning("generate: unknown request %s", request_id)
        return
    if log_row.status != TokenLog.Status.RUNNING:
        return  # settled already: a redelivered task changes nothing
    if is_cancel_requested(request_id):
        _finish(log_row, reply_to, Outcome(FINISH_CANCELLED), None)
        return
    # From here on, a web process that hears nothing can check whether this worker is still alive.
    claim_request(request_id, settings.CEILING_RESERVATION_TTL_S, inbox=reply_to)
    # Everything below reads the row and its select_related parts only; _finish checks a connection out again.
    release_database_connection()
    stream = TokenStream(log_row, reply_to)
    started_ns = time.time_ns()
    with running(open_generation(log_row)) as generation:
        try:
            generation.start(stream.on_text)
        except GenerationError as exc:
            _finish(log_row, reply_to, Outcome(FINISH_ERROR, str(exc)), None)
            return
        if is_cancel_requested(request_id):  # the cancel may have landed between the check and the start
            generation.cancel()
        outcome = generation.wait()
    stream.close()
    trace_generation(request_id, started_ns, stream.first_token_ns, time.time_ns(), outcome)
    _finish(log_row, reply_to, outcome, stream.ttft_ms, frames=stream.seq)


def trace_generation(request_id: str, started_ns: int, first_token_ns: int | None, ended_ns: int, outcome: Outcome) -> None:
    """The prefill and decode spans, from the times measured (project/tracing.py; nothing when off).

    One span each per request, never one per engine step: prefill runs from the hand-over to the
    engine (or the remote server) to the first token, so it includes waiting for a place in the
    running batch; decode from the first token to the end.
    """
    if not tracing.enabled():
        return
    error = outcome.error if outcome.finish_reason == FINISH_ERROR else ""
    if first_token_ns is None:  # failed or cancelled before any token
        tracing.record("prefill", request_id, started_ns, ended_ns, error=error, finish_reason=outcome.finish_reason)
        return
    tracing.record("prefill", request_id, started_ns, first_token_ns)
    tracing.record("decode", request_id, first_token_ns, ended_ns, error=error, finish_reason=outcome.finish_reason,
                   completion_tokens=len(outcome.completion_ids) if outcome.completion_tokens is None else outcome.completion_tokens)


class TokenStream:
    """One request's pieces of text → token frames → its web process.

    For the local engine, the engine's pump thread calls on_text for every request it routes, so a
    step costs one thread's work, not a wake-up of every request's task thread (with 20-60 requests
    a step, those wake-ups and their turns at the GIL preempted the engine's two compute threads on
    a 2-core machine). The frames go to the process's sender, which bundles a step's frames into
    one push.
    """

    def __init__(self, log_row: TokenLog, reply_to: str) -> None:
        self.log_row = log_row
        self.reply_to = reply_to
        self.sender = channel_sender()
        self.frames = FrameBuffer(settings.CEILING_STREAM_INTERVAL, settings.CEILING_STREAM_FRAME_MS)
        self.ttft_ms: int | None = None
        self.first_token_ns: int | None = None  # wall clock, for the trace's prefill and decode spans
        self.seq = 0  # token frames sent
        self.tokens_so_far = 0
        self._lock = threading.Lock()  # the pump's on_text against the task thread's close
        self._closed = False

    def on_text(self, piece: str, new_tokens: int, tokens_so_far: int, logprobs: list | None = None) -> None:
        """Count the new tokens and send what is due (in the engine's pump thread, or the task's)."""
        with self._lock:
            if self._closed:
                return
            if new_tokens and self.ttft_ms is None:
                self.ttft_ms = _ms_since(self.log_row.created_at)
                self.first_token_ns = time.time_ns()
            self.tokens_so_far = tokens_so_far
            text = self.frames.add(piece, new_tokens, logprobs)
            if text:
                self._send(text, self.frames.taken_logprobs)

    def close(self) -> None:
        """In the task thread, after the end: send what was held back; nothing is sent after this."""
        with self._lock:
            self._closed = True
            rest = self.frames.take()
            if rest:
                self._send(rest, self.frames.taken_logprobs)

    def _send(self, text: str, logprobs: list) -> None:
        # Its progress is recorded before it is sent: if this worker dies, the ledger counts every
        # token a user saw. The hand-over does not wait; _finish's frame goes out after it.
        request_id = self.log_row.request_id
        token = {"type": "chat.token", "request_id": request_id, "text": text, "seq": self.seq}
        if logprobs:
            token["logprobs"] = logprobs  # only API requests that asked for them
        if self.seq == 0:
            mark(request_id, "first_frame")
        self.sender.send_frame(self.reply_to, request_id, token, tokens_streamed=self.tokens_so_far)
        self.seq += 1


def _finish(log_row: TokenLog, reply_to: str, outcome: Outcome, ttft_ms: int | None, *, frames: int = 0) -> None:
    """Settle the ledger and tell the user. A remote outcome carries its token counts (no local ids)."""
    status = {
        FINISH_CANCELLED: TokenLog.Status.CANCELLED,
        FINISH_ERROR: TokenLog.Status.FAILED,
    }.get(outcome.finish_reason, TokenLog.Status.OK)
    error = outcome.error
    with tracing.span("settle", log_row.request_id, status=status):
        settled = _settle(log_row, outcome, status, ttft_ms)
    if settled is None:
        return
    sender = channel_sender()
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
        if outcome.tool_calls:
            message["tool_calls"] = outcome.tool_calls  # a remote's, passed on as it sent them
    sender.send_frame(reply_to, settled.request_id, message, wait=True)


def _settle(log_row: TokenLog, outcome: Outcome, status: str, ttft_ms: int | None) -> TokenLog | None:
    """The ledger row, then the guard's reservation; None when the row was settled already (by a sweep)."""
    settled = _with_database_retry(
        do_finish_request,
        log_row.request_id,
        status=status,
        prompt_tokens=log_row.prompt_tokens if outcome.prompt_tokens is None else outcome.prompt_tokens,
        completion_ids=outcome.completion_ids,
        completion_tokens=outcome.completion_tokens,
        text=outcome.text,
        finish_reason="" if status == TokenLog.Status.FAILED else outcome.finish_reason,
        ttft_ms=ttft_ms,
        error=outcome.error,
        admitted=log_row,
    )
    release_claim(log_row.request_id)
    if settled is None:
        return None
    raise_overshoot_alert(settled)  # a remote billed past its reservation: once per provider and day
    # Release the reservation before telling the user, so their next request sees the freed room.
    settle_reservation(settled.request_id)
    return settled


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
