"""One chat request from a parsed frame to its last event: the stages of inference/chat/, in order.

    async with aclosing(run_chat(user, frame)) as events:
        async for event in events:      # wire-protocol events (docs/protocol.md)
            ...

The events are exactly the server → client frames of /ws/chat/: `accepted`, `notice`, `token`…,
then one terminal event (`done`, `refused` or `error`). Refusals are logged before they are
yielded. Whoever stops iterating early (a closed socket, a dropped HTTP stream, a cancelled task)
cancels the generation: the `finally` below tells the worker to stop, and the request is settled at
the tokens actually generated.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError

from inference import variants
from inference.bus.cancel import arequest_cancel
from inference.bus.inbox import stream_inbox
from inference.web.frames import ChatFrame
from project import tracing
from project.logs import request_id_var

from .admit import admit, admitted_events, refused_event
from .cache import cache_key, cached_events, remember_answer
from .checks import Checked, check, with_sources
from .dispatch import dispatch_generation
from .events import DATABASE_UNAVAILABLE, INTERNAL_ERROR, LOGGED_EVENTS, TERMINAL
from .relay import collect_json, relay
from .route import Route, route

log = logging.getLogger(__name__)


async def run_chat(user: AbstractBaseUser, frame: ChatFrame, request_id: str | None = None) -> AsyncIterator[dict]:
    """Admit one chat request and yield its events; an unexpected failure ends with an `internal` error.

    request_id: the ledger row's id, when the caller has already named the request (the HTTP API
    sends it in x-request-id, refusals and errors included); else a new one.
    """
    request_id = request_id or uuid.uuid4().hex
    # Every line logged about this request names it (project/logs.py), in this task and in the
    # threads its sync_to_async calls run in. Set again after each event: the caller's context is
    # the one in force between two of them (a streamed HTTP answer is iterated after its view returned).
    request_id_var.set(request_id)
    # The chat's trace (project/tracing.py): None, and nothing recorded, unless tracing is on. Current
    # in the same places as the request id, so the guard's and the dispatch's spans are its children.
    span = tracing.start_chat(request_id, frame.feature)
    tracing.enter(span)
    last: dict | None = None
    try:
        async with aclosing(_stages(request_id, user, frame)) as events:
            async for last in events:
                if last["type"] in LOGGED_EVENTS:
                    log.info("chat %s%s", last["type"], f" ({last['code']})" if last.get("code") else "")
                yield last
                request_id_var.set(request_id)
                if span is not None:
                    tracing.enter(span)
    except DatabaseError as exc:
        # Before admission nothing was written; a row admitted just before the outage is settled
        # by the worker (it retries its ledger write) or, failing that, by reconciliation.
        log.warning("chat request %s: database unavailable: %s", request_id, exc)
        yield (last := dict(DATABASE_UNAVAILABLE))
    except Exception:
        log.exception("chat request %s failed", request_id)
        yield (last := dict(INTERNAL_ERROR))
    finally:
        tracing.end_chat(span, last)


async def _stages(request_id: str, user: AbstractBaseUser, frame: ChatFrame) -> AsyncIterator[dict]:
    """route → checks → cache → admit → dispatch → relay; a stage that ends the request yields its event."""
    routed = await route(frame)
    if isinstance(routed, dict):
        yield routed
        return
    checked = await check(request_id, user, routed, frame)
    if isinstance(checked, dict):
        yield checked
        return
    events = _answer(request_id, user, routed, checked)
    if routed.mode.collects_json:
        events = collect_json(events, routed.mode.schema)
    async with aclosing(events):
        async for event in events:
            yield event


async def _answer(request_id: str, user: AbstractBaseUser, routed: Route, checked: Checked) -> AsyncIterator[dict]:
    """The answer of a checked request: from the cache, else admitted, dispatched and relayed."""
    feature = routed.feature
    max_tokens = min(checked.frame.max_tokens, feature.max_output_tokens)
    key = cache_key(feature, user, checked, max_tokens)
    hit = await cached_events(request_id, user, feature, checked, max_tokens, key)
    if hit is not None:
        for event in hit:
            yield with_sources(event, checked.retrieved)
        return
    inbox = stream_inbox()
    frames = inbox.open(request_id)  # before the worker can send the first frame
    ended = False  # nothing left to stop: the worker finished it, or the guard refused it
    try:
        decision = await admit(request_id, user, feature, checked, max_tokens)
        if not decision.admitted:
            ended = True
            yield refused_event(decision)
            return
        # Dispatched before it is announced: from here on, stopping early only needs a cancel.
        await dispatch_generation(request_id, inbox.key, variants.variant_of(decision.fell_back_to or feature))
        for event in admitted_events(decision, decision.log.prompt_tokens):
            yield with_sources(event, checked.retrieved)
        if decision.fell_back_to is not None:
            key = None  # the fallback's answer is not the one this feature's cache should hand out later
        async for event in relay(frames, request_id, decision.log.prompt_tokens):
            ended = event["type"] in TERMINAL
            if key is not None and event["type"] == "done" and event.get("finish_reason") == "stop":
                await remember_answer(feature, key, request_id)  # before `done`: a caller may stop right after it
            yield event
    finally:
        try:
            if not ended:
                # Cancelled, closed early or failed half-way: the engine must not keep generating.
                await arequest_cancel(request_id)
        finally:
            inbox.close(request_id)
