"""Stage 7, relay: the worker's frames as the protocol's events, until done or failed, within the
first-token and total timeouts.

Frames come back through this process's stream inbox (inference/bus/): the request opens its queue
there before it is dispatched, so it needs no consumer around it. The stream is at-most-once (a
message can be dropped under load), the ledger is not: when nothing has arrived for LEDGER_CHECK_S,
the TokenLog row is read, and a request the worker has already settled ends from the ledger, its
missing text taken from the stored transcript. A request whose worker died (its heartbeat expired)
is settled here as failed, with the tokens that worker recorded as streamed. On a timeout the
request is settled here as failed (its reservation released): a worker that is down or stalled may
never settle it, and one that wakes up later finds it settled and skips it.

An extract feature (or response_format) adds one thing: the tokens are collected, not sent, and
`done` carries the parsed object (collect_json).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError

from budgets.models import TokenLog
from inference.actions import WORKER_LOST_ERROR, do_fail_lost_request, worker_lost_event
from inference.bus.cancel import arequest_cancel
from inference.bus.ownership import lost_request_progress
from inference.models import Transcript
from inference.web import modes

from .settle import finish_undispatched

LEDGER_CHECK_S = 5.0


async def relay(inbox: asyncio.Queue, request_id: str, prompt_tokens: int) -> AsyncIterator[dict]:
    """The worker's frames as events until done/failed, within the timeouts, recovered from the ledger."""
    started = time.monotonic()
    first_token_seen = False
    streamed: list[str] = []
    while True:
        limit = settings.CEILING_TOTAL_TIMEOUT_S if first_token_seen else settings.CEILING_FIRST_TOKEN_TIMEOUT_S
        left = limit - (time.monotonic() - started)
        if left <= 0:
            async for event in _time_out(request_id, prompt_tokens, first_token_seen):
                yield event
            return
        try:
            message = await asyncio.wait_for(inbox.get(), timeout=min(left, LEDGER_CHECK_S))
        except TimeoutError:
            try:
                recovered = await recover_from_ledger(request_id, "".join(streamed), len(streamed))
            except DatabaseError:
                continue  # the database is away for a moment: keep waiting, the timeouts still hold
            if not recovered:
                recovered = await fail_if_worker_lost(request_id, prompt_tokens, "".join(streamed))
            if recovered:
                for event in recovered:
                    yield event
                return
            continue
        if message.get("request_id") != request_id:
            continue
        event = dict(message)
        kind = event.pop("type")
        if kind == "chat.token":
            first_token_seen = True
            streamed.append(event.get("text", ""))
            yield {"type": "token", **event}
        elif kind == "chat.done":
            yield {"type": "done", **event, "cache": "miss"}
            return
        elif kind == "chat.failed":
            yield {"type": "error", **event}
            return


async def collect_json(events: AsyncIterator[dict], schema: dict | None = None) -> AsyncIterator[dict]:
    """An extract feature's events: tokens collected, not sent; `done` carries the parsed JSON object.

    With a schema (response_format json_schema) the object must also hold to it, else `invalid_json`.
    """
    parts: list[str] = []
    async with aclosing(events):
        async for event in events:
            if event["type"] == "token":
                parts.append(event["text"])
                continue
            if event["type"] == "done":
                try:
                    event = {**event, "result": modes.check_schema(modes.extract_json("".join(parts)), schema)}
                except modes.InvalidJSON as exc:
                    # The request itself succeeded and stays in the ledger with the tokens it used.
                    used = event["usage"]["completion_tokens"]
                    event = {"type": "error", "code": "invalid_json", "message": f"{exc} The {used} tokens it used are still counted."}
            yield event


async def _time_out(request_id: str, prompt_tokens: int, first_token_seen: bool) -> AsyncIterator[dict]:
    await arequest_cancel(request_id)
    event = _timeout_event(first_token_seen)
    await sync_to_async(finish_undispatched, thread_sensitive=False)(
        request_id, TokenLog.Status.FAILED, prompt_tokens, "", event["message"]
    )
    yield event


def _timeout_event(first_token_seen: bool) -> dict:
    what = "The answer did not finish" if first_token_seen else "The model did not start answering"
    limit = settings.CEILING_TOTAL_TIMEOUT_S if first_token_seen else settings.CEILING_FIRST_TOKEN_TIMEOUT_S
    return {"type": "error", "code": "timeout", "message": f"{what} within {limit:.0f} s; please try again."}


@database_sync_to_async
def recover_from_ledger(request_id: str, streamed_text: str, next_seq: int) -> list[dict]:
    """The end of a request the worker settled but whose last frames were lost; [] while it runs.

    Most checks find the request still running (64 chats arriving together wait over 5 s for their
    first token here), so the transcript, with its prompt's messages and token ids as JSON, is read
    only once the request has ended, and then only its answer's text.
    """
    row = TokenLog.objects.filter(request_id=request_id).first()
    if row is None or row.status == TokenLog.Status.RUNNING:
        return []
    if row.status == TokenLog.Status.FAILED:
        lost = re.fullmatch(WORKER_LOST_ERROR.format(tokens=r"(\d+)"), row.error)
        if lost:  # settled by a worker that swept its dead owner, whose frame did not reach us
            return [worker_lost_event(request_id, int(lost[1]))]
        return [{"type": "error", "request_id": request_id, "code": "engine_failed",
                 "message": f"The model could not finish this answer: {row.error or 'unknown error'}."}]
    events = []
    text = Transcript.objects.filter(log=row).values_list("response_text", flat=True).first() or ""
    if text.startswith(streamed_text) and len(text) > len(streamed_text):
        events.append({"type": "token", "request_id": request_id, "text": text[len(streamed_text):], "seq": next_seq})
    events.append({
        "type": "done", "request_id": request_id, "usage": row.usage(), "cost_usd": row.cost_usd,
        "ttft_ms": row.ttft_ms, "total_ms": row.total_ms, "finish_reason": row.finish_reason, "cache": "miss",
    })
    return events


@sync_to_async(thread_sensitive=False)
def fail_if_worker_lost(request_id: str, prompt_tokens: int, streamed_text: str) -> list[dict]:
    """[] while the request's worker is alive (or unknown); else settle it failed and say so.

    The ledger records the tokens the dead worker reported as streamed (inference/bus/,
    ChannelSender.send_frame), not what this process happened to receive, and the reservation is
    released at once instead of after CEILING_RESERVATION_TTL_S. A settle that loses the race to
    the worker changes nothing.
    """
    from django.db import close_old_connections

    tokens = lost_request_progress(request_id)
    if tokens is None:
        return []
    close_old_connections()
    if do_fail_lost_request(request_id, tokens=tokens, text=streamed_text, prompt_tokens=prompt_tokens) is None:
        return []  # settled meanwhile (by its worker or a sweeping one): the next ledger check ends it
    return [worker_lost_event(request_id, tokens)]
