"""One chat request from a validated frame to its last event, shared by the websocket and the HTTP API.

    async with aclosing(run_chat(user, frame)) as events:
        async for event in events:      # wire-protocol events (docs/protocol.md)
            ...

The events are exactly the server → client frames of /ws/chat/: `accepted`, `notice`, `token`…,
then one terminal event (`done`, `refused` or `error`). Refusals are logged before they are
yielded. Whoever stops iterating early (a closed socket, a dropped HTTP stream, a cancelled task)
cancels the generation: the generator's `finally` tells the worker to stop, and the request is
settled at the tokens actually generated.

Frames come back from the worker through this process's stream inbox (inference/bus/): the
dispatch names it, and the request opens its own queue there before it is dispatched, so it needs
no consumer around it.

The feature's mode (inference/web/modes.py) shapes the events: an `extract` feature asks the model for
JSON and yields no tokens, only a `done` with the parsed `result` (or an `invalid_json` error); a
`batch` feature refuses interactive chat with a `batch_only` error.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial

import redis
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError

from budgets import estimates
from budgets.actions import do_log_cache_hit, do_log_refusal
from budgets.guard import Decision, Fallback, LoopLimits
from budgets.models import Feature, Provider, RetrievalFacts, TokenLog, unique_row
from inference import retrieval, variants
from inference.actions import (
    WORKER_LOST_ERROR,
    do_admit_request,
    do_fail_lost_request,
    do_finish_request,
    settle_reservation,
    worker_lost_event,
)
from inference.bus.cancel import arequest_cancel
from inference.bus.inbox import stream_inbox
from inference.bus.ownership import lost_request_progress
from inference.bus.trace import mark
from inference.models import Transcript
from inference.web import caches, modes
from inference.web.frames import ChatFrame, has_tool_turns
from inference.web.tokenizer import (
    chat_prompt_ids,
    count_text_tokens,
    input_too_long_by_count,
    input_too_long_by_size,
    model_name,
)
from project import tracing
from project.logs import request_id_var

log = logging.getLogger(__name__)

TERMINAL = frozenset({"done", "refused", "error"})
LOGGED_EVENTS = TERMINAL | {"accepted"}  # one line each in the web process's log
INTERNAL_ERROR = {"type": "error", "code": "internal", "message": "Something went wrong on our side; please try again."}
DATABASE_UNAVAILABLE = {
    "type": "error", "code": "database_unavailable",
    "message": "The service cannot reach its database right now, so this request was not taken. Please try again in a minute.",
}

# Admissions whose caller went away while the guard was deciding; kept referenced until they finish.
_abandoned: set[asyncio.Task] = set()


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
        async with aclosing(_admit_and_stream(request_id, user, frame)) as events:
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


async def _admit_and_stream(request_id: str, user: AbstractBaseUser, frame: ChatFrame) -> AsyncIterator[dict]:
    feature = await get_feature(frame.feature)
    if feature is None:
        yield {"type": "error", "code": "unknown_feature", "message": f"There is no feature named {frame.feature!r}."}
        return
    if feature.mode == Feature.Mode.BATCH:
        yield {"type": "error", "code": "batch_only", "message": modes.batch_only_message(feature.name)}
        return
    if (frame.params.tools or has_tool_turns(frame.messages)) and not is_remote(feature):
        yield {"type": "error", "code": "tools_unsupported", "message": modes.tools_unsupported_message(feature.name)}
        return
    if feature.mode == Feature.Mode.DOCS:
        # The passages go into the prompt before its tokens are counted: the input limit, the guard
        # and the ledger all see the prompt the model will read.
        messages, retrieved = await retrieve_into_prompt(feature, user, frame.messages)
        events = _answer(request_id, user, feature, replace(frame, messages=messages), retrieved)
    elif feature.mode == Feature.Mode.EXTRACT:
        frame = replace(frame, messages=modes.extract_messages(frame.messages))
        events = _answer_once(_answer(request_id, user, feature, frame))
    elif frame.params.json_mode:
        # response_format: the extract mode's JSON guarantee, and the schema checked when one is given.
        schema = frame.params.json_schema
        frame = replace(frame, messages=modes.schema_messages(frame.messages, schema))
        events = _answer_once(_answer(request_id, user, feature, frame), schema)
    else:
        events = _answer(request_id, user, feature, frame)
    async with aclosing(events):
        async for event in events:
            yield event


def is_remote(feature: Feature) -> bool:
    return feature.provider is not None and feature.provider.kind == Provider.Kind.OPENAI_COMPATIBLE


async def _answer_once(events: AsyncIterator[dict], schema: dict | None = None) -> AsyncIterator[dict]:
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


async def _answer(request_id: str, user: AbstractBaseUser, feature: Feature, frame: ChatFrame,
                  retrieved: RetrievedContext | None = None) -> AsyncIterator[dict]:
    facts = retrieved.facts if retrieved else None
    prompt_ids, prompt_tokens, refusal = await _check_before_guard(request_id, user, feature, frame, facts)
    if refusal is not None:
        yield refusal
        return
    max_tokens = min(frame.max_tokens, feature.max_output_tokens)
    # A sampled or shaped answer is not the one a cache holds for these messages; the feature's own
    # defaults are, while they decode greedily (a penalty keeps the answer deterministic). They are
    # part of the key, so an answer stored under other defaults is not reused.
    cacheable = feature.cache_ttl_s and frame.params.cacheable and feature.temperature == 0
    key = caches.cache_key(feature, user, model_name(feature), max_tokens, frame.messages,
                           {**feature.generation_defaults(), **frame.params.stored()}) if cacheable else None
    if key is not None and retrieved is not None:
        # An answer drawn from a staff document is never reused for someone who may not read it,
        # not even as a semantic near-match of a shared feature.
        key = replace(key, scope=f"{key.scope}:{'+'.join(retrieval.audiences_for(user))}")
    if key is not None:
        hit = await sync_to_async(caches.lookup, thread_sensitive=False)(feature, key)
        if hit is not None:
            for event in await serve_cached(request_id, user, feature, prompt_tokens, max_tokens, hit, facts):
                yield with_sources(event, retrieved)
            return
    inbox = stream_inbox()
    # Open the request's queue before the worker can send the first frame.
    frames = inbox.open(request_id)
    ended = False  # nothing left to stop: the worker finished it, or the guard refused it
    try:
        loop = LoopLimits(frame.loop_id, settings.CEILING_LOOP_MAX_CALLS, settings.CEILING_LOOP_MAX_COST_MICRO_USD) if frame.loop_id else None
        decision = await _admit_shielded(request_id, user, feature, frame, prompt_ids, prompt_tokens, max_tokens, loop, facts)
        if not decision.admitted:
            ended = True
            yield {"type": "refused", "code": decision.code, "message": decision.message, "retry_after_s": decision.retry_after_s}
            return
        # Dispatch before announcing it: from here on, stopping early only needs a cancel.
        # To the queue of the weight variant that serves it: the fallback's, when the guard chose it.
        await dispatch_generation(request_id, inbox.key, variants.variant_of(decision.fell_back_to or feature))
        for event in admitted_events(decision, decision.log.prompt_tokens):
            yield with_sources(event, retrieved)
        # The fallback's answer is not the one this feature's cache should hand out later.
        if decision.fell_back_to is not None:
            key = None
        async for event in _relay(frames, request_id, decision.log.prompt_tokens):
            ended = event["type"] in TERMINAL
            if key is not None and event["type"] == "done" and event.get("finish_reason") == "stop":
                # Stored before `done` is yielded: a caller may stop iterating right after it.
                await sync_to_async(remember_answer, thread_sensitive=False)(feature, key, request_id)
            yield event
    finally:
        try:
            if not ended:
                # Cancelled, closed early or failed half-way: the engine must not keep generating.
                await arequest_cancel(request_id)
        finally:
            inbox.close(request_id)


def admitted_events(decision: Decision, prompt_tokens: int) -> list[dict]:
    """`accepted`, then the notices: served by the fallback (`fell_back`), a cap nearly used (`nearing_cap`).

    `accepted` names the fallback too, so that the HTTP API can set its header before the body.
    """
    accepted = {"type": "accepted", "request_id": decision.request_id, "prompt_tokens": prompt_tokens,
                "max_tokens": decision.max_tokens}
    events = [accepted]
    if decision.fell_back_to is not None:
        served = {"feature": decision.fell_back_to.name, "model": decision.fallback_model}
        accepted["fallback"] = served
        events.append({"type": "notice", "code": "fell_back", "message": decision.fallback_notice, **served})
    if decision.warning:
        events.append({"type": "notice", "code": "nearing_cap", "message": decision.warning})
    return events


def worker_params(feature: Feature, frame: ChatFrame) -> dict:
    """What the worker generates with (Transcript.params): the request's own values over the feature's
    defaults. A JSON answer (extract mode, response_format) keeps the request's alone: a penalty on
    repeated tokens would punish the quotes and braces every JSON object repeats."""
    stored = frame.params.stored()
    if frame.params.json_mode or feature.mode == Feature.Mode.EXTRACT:
        return stored
    return feature.generation_defaults() | stored


def fallback_for(feature: Feature, frame: ChatFrame, prompt_tokens: int) -> Fallback | None:
    """The feature's fallback, when it could serve this request at all; whether it fits is the guard's call.

    A switched-off fallback, one whose input limit the prompt passes, one on the local engine for a
    request with tools, or one on weights no worker serves is no fallback for it. Its own fallback is
    not followed (one hop, no loops).
    """
    fallback = feature.fallback
    if fallback is None or not fallback.enabled:
        return None
    if prompt_tokens > min(fallback.max_input_tokens, settings.CEILING_MAX_INPUT_TOKENS):
        return None
    if (frame.params.tools or has_tool_turns(frame.messages)) and not is_remote(fallback):
        return None
    if not variants.is_served(variants.variant_of(fallback)):
        return None  # its weights have no worker: it would wait in a queue nobody reads
    return Fallback(fallback, model_name(fallback), min(frame.max_tokens, fallback.max_output_tokens))


async def _check_before_guard(
    request_id: str, user: AbstractBaseUser, feature: Feature, frame: ChatFrame, facts: RetrievalFacts | None = None
) -> tuple[list[int], int, dict | None]:
    """(the prompt's token ids, its token count, None), or the refusal decided here rather than by the guard (logged).

    The local engine's prompt is counted exactly with its tokenizer. A remote's is estimated from
    everything sent to it, tools and tool results included (budgets/estimates.py): its ids stay
    empty, and its count is an upper bound the guard reserves.
    """
    if not feature.enabled:
        message = f"The feature {feature.name!r} is switched off by the operators."
        await log_refusal(request_id, user, feature, "feature_disabled", message, 0, frame.max_tokens, facts)
        return [], 0, {"type": "refused", "code": "feature_disabled", "message": message, "retry_after_s": None}
    variant = variants.variant_of(feature)
    if variant != variants.default_variant() and not await sync_to_async(variants.is_served, thread_sensitive=False)(variant):
        # Queued, it would wait for the first-token timeout in a queue nobody reads.
        message = variants.unavailable_message(feature.name, variant)
        await log_refusal(request_id, user, feature, "variant_unavailable", message, 0, frame.max_tokens)
        return [], 0, {"type": "refused", "code": "variant_unavailable", "message": message, "retry_after_s": None}
    limit = min(feature.max_input_tokens, settings.CEILING_MAX_INPUT_TOKENS)
    prompt_ids: list[int] = []
    if is_remote(feature):
        try:
            prompt_tokens = await sync_to_async(remote_prompt_tokens, thread_sensitive=False)(feature, frame)
        except redis.RedisError as exc:
            log.warning("could not read the prompt estimate of %s: %s", feature.name, exc)
            await log_refusal(request_id, user, feature, "guard_unavailable", GUARD_UNAVAILABLE, 0, frame.max_tokens, facts)
            return [], 0, {"type": "refused", "code": "guard_unavailable", "message": GUARD_UNAVAILABLE, "retry_after_s": 30}
        refusal = input_too_long_by_count(prompt_tokens, limit, estimated=True)
    else:
        refusal = input_too_long_by_size(frame.messages, limit)
        if refusal is None:
            prompt_ids = await sync_to_async(chat_prompt_ids, thread_sensitive=False)(frame.messages)
            refusal = input_too_long_by_count(len(prompt_ids), limit)
        prompt_tokens = len(prompt_ids)
    if refusal is not None:
        await log_refusal(request_id, user, feature, "max_input_tokens", refusal, prompt_tokens, frame.max_tokens, facts)
        # The numbers too, so that the HTTP API can say it in OpenAI's words (context_length_exceeded);
        # prompt_tokens is 0 when the size alone refused it, before tokenizing.
        return prompt_ids, prompt_tokens, {"type": "refused", "code": "max_input_tokens", "message": refusal,
                                           "retry_after_s": None, "limit": limit, "prompt_tokens": prompt_tokens}
    return prompt_ids, prompt_tokens, None


GUARD_UNAVAILABLE = "The budget guard cannot be reached right now, so no request can be admitted. Please try again in a minute."


def remote_prompt_tokens(feature: Feature, frame: ChatFrame) -> int:
    """A remote feature's prompt as the guard reserves it: everything sent, at this provider's learned ratio."""
    return estimates.prompt_estimate(feature.provider_id, model_name(feature), frame.messages, frame.params.stored(),
                                     count_text_tokens)


def prompt_for_fallback(feature: Feature, fallback: Fallback | None, frame: ChatFrame, prompt_ids: list[int],
                        prompt_tokens: int) -> tuple[list[int], int]:
    """(token ids, count) one reservation must cover when the guard may serve the fallback instead.

    A fallback counts its prompt its own way (a remote estimates, the local engine counts exactly)
    and the guard reserves one count for either, so it reserves the larger. A local fallback of a
    remote feature also needs the ids its engine will run.
    """
    if fallback is None or is_remote(fallback.feature) == is_remote(feature):
        return prompt_ids, prompt_tokens
    if is_remote(fallback.feature):
        return prompt_ids, max(prompt_tokens, remote_prompt_tokens(fallback.feature, frame))
    ids = chat_prompt_ids(frame.messages)
    return ids, max(prompt_tokens, len(ids))


async def _admit_shielded(request_id, user, feature, frame, prompt_ids, prompt_tokens, max_tokens, loop, facts=None) -> Decision:
    """Ask the guard; if our caller goes away meanwhile, an admitted request is closed as cancelled.

    The guard runs in a thread that cancelling cannot stop, so without this a request admitted just
    after its client left would hold its reservation until reconciliation fails it.
    """
    admission = asyncio.ensure_future(admit_request(request_id, user, feature, frame, prompt_ids, prompt_tokens, max_tokens, loop, facts))
    try:
        return await asyncio.shield(admission)
    except asyncio.CancelledError:
        task = asyncio.ensure_future(_close_if_admitted(admission))
        _abandoned.add(task)
        task.add_done_callback(_abandoned.discard)
        raise


async def _close_if_admitted(admission: asyncio.Future) -> None:
    try:
        decision = await admission
    except Exception:
        log.exception("an abandoned admission failed")
        return
    if decision.admitted:
        # Not thread-sensitive: the HTTP request this came from may be over, and its thread with it.
        await sync_to_async(finish_undispatched, thread_sensitive=False)(
            decision.request_id, TokenLog.Status.CANCELLED, decision.log.prompt_tokens, "cancelled", ""
        )


async def _relay(inbox: asyncio.Queue, request_id: str, prompt_tokens: int) -> AsyncIterator[dict]:
    """The worker's frames as events until done/failed, within the first-token and total timeouts.

    The stream is at-most-once (a message can be dropped under load), the ledger is not: when
    nothing has arrived for LEDGER_CHECK_S, the TokenLog row is read, and a request the worker has
    already settled ends from the ledger, its missing text taken from the stored transcript. A
    request whose worker died (its heartbeat expired) is settled here as failed, with the tokens
    that worker recorded as streamed.
    On a timeout the request is settled here as failed (its reservation released): a worker that is
    down or stalled may never settle it, and one that wakes up later finds it settled and skips it.
    """
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


LEDGER_CHECK_S = 5.0


async def _time_out(request_id: str, prompt_tokens: int, first_token_seen: bool) -> AsyncIterator[dict]:
    await arequest_cancel(request_id)
    event = _timeout_event(first_token_seen)
    await sync_to_async(finish_undispatched, thread_sensitive=False)(
        request_id, TokenLog.Status.FAILED, prompt_tokens, "", event["message"]
    )
    yield event


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


def _timeout_event(first_token_seen: bool) -> dict:
    what = "The answer did not finish" if first_token_seen else "The model did not start answering"
    limit = settings.CEILING_TOTAL_TIMEOUT_S if first_token_seen else settings.CEILING_FIRST_TOKEN_TIMEOUT_S
    return {"type": "error", "code": "timeout", "message": f"{what} within {limit:.0f} s; please try again."}


# --- database and broker helpers -------------------------------------------------------------------


# Off the one thread-sensitive thread, as admit_request below: 64 chats arriving together queued
# there for this lookup alone, ~470 ms for the median chat before its admission could start.
@partial(database_sync_to_async, thread_sensitive=False)
def get_feature(name: str) -> Feature | None:
    return unique_row(Feature.objects.select_related("provider", "fallback__provider").filter(name=name))


# Admissions run side by side in the event loop's thread pool (not the one thread-sensitive thread):
# the guard is built for concurrent admissions (tests/test_guard*.py), and 64 chats arriving together
# otherwise queue one behind another for their ~12 ledger queries each.
@partial(database_sync_to_async, thread_sensitive=False)
def admit_request(request_id, user, feature, frame: ChatFrame, prompt_ids, prompt_tokens, max_tokens, loop, facts=None) -> Decision:
    fallback = fallback_for(feature, frame, prompt_tokens)
    prompt_ids, prompt_tokens = prompt_for_fallback(feature, fallback, frame, prompt_ids, prompt_tokens)
    with tracing.span("guard", request_id, prompt_tokens=prompt_tokens, max_tokens=max_tokens) as span:
        decision = _admit(request_id, user, feature, frame, prompt_ids, prompt_tokens, max_tokens, loop, fallback, facts)
        tracing.annotate(span, admitted=decision.admitted, code=decision.code or None,
                         fell_back_to=decision.fell_back_to.name if decision.fell_back_to else None)
    if decision.admitted:
        mark(request_id, "admitted")
    return decision


def _admit(request_id, user, feature, frame: ChatFrame, prompt_ids, prompt_tokens, max_tokens, loop, fallback, facts) -> Decision:
    return do_admit_request(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model_name(feature),
        messages=frame.messages,
        prompt_ids=prompt_ids,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        loop=loop,
        params=worker_params(feature, frame),
        end_user=frame.params.end_user,
        fallback=fallback,
        retrieved=facts,
        api_key=frame.api_key,
        tags=frame.tags,
        team=frame.team,
    )


@database_sync_to_async
def log_refusal(request_id, user, feature, code, message, prompt_tokens, max_tokens, facts=None) -> None:
    do_log_refusal(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model_name(feature),
        code=code,
        message=message,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        retrieval=facts,
    )


@database_sync_to_async
def serve_cached(request_id, user, feature, prompt_tokens: int, max_tokens: int, hit: caches.CachedAnswer,
                 facts: RetrievalFacts | None = None) -> list[dict]:
    """A cache hit: logged at cost 0 with what it saved, then the protocol's frames for it."""
    row = do_log_cache_hit(
        request_id=request_id, user=user, feature=feature, model=model_name(feature), prompt_tokens=prompt_tokens,
        completion_tokens=hit.completion_tokens, max_tokens=max_tokens, kind=hit.kind, saved_micro_usd=hit.cost_micro_usd,
        retrieval=facts,
    )
    return [
        {"type": "accepted", "request_id": request_id, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens},
        {"type": "token", "request_id": request_id, "text": hit.text, "seq": 0},
        {
            "type": "done", "request_id": request_id, "usage": row.usage(), "cost_usd": row.cost_usd,
            "ttft_ms": row.ttft_ms, "total_ms": row.total_ms, "finish_reason": "stop", "cache": hit.kind,
        },
    ]


@dataclass(frozen=True)
class RetrievedContext:
    """What a docs feature's retrieval put into the prompt: the ledger's facts and the passages' sources."""

    facts: RetrievalFacts
    sources: list[dict]


@partial(database_sync_to_async, thread_sensitive=False)
def retrieve_into_prompt(feature: Feature, user: AbstractBaseUser, messages: list[dict]) -> tuple[list[dict], RetrievedContext]:
    """The conversation with the passages the user may read in its system prompt, and what they added.

    retrieved_tokens counts the passages' block in the served model's tokenizer, as the prompt holds it.
    """
    found = retrieval.retrieve(feature, user, retrieval.last_question(messages))
    tokens = retrieval.model_token_counter()(retrieval.context_text(found.chunks)) if found.chunks else 0
    facts = RetrievalFacts(retrieved_tokens=tokens, retrieval_ms=found.ms, retrieval_cache=found.cache,
                           retrieval_saved_ms=found.saved_ms)
    sources = [{"n": n, "document": c.document, "heading": c.heading, "score": c.score}
               for n, c in enumerate(found.chunks, start=1)]
    return retrieval.docs_messages(messages, found.chunks), RetrievedContext(facts, sources)


def with_sources(event: dict, retrieved: RetrievedContext | None) -> dict:
    """`accepted` of a docs answer names the passages its prompt holds (the numbers the answer cites)."""
    if retrieved is None or event["type"] != "accepted":
        return event
    facts = retrieved.facts
    return {**event, "retrieval": {"retrieved_tokens": facts.retrieved_tokens, "retrieval_ms": facts.retrieval_ms,
                                   "cache": facts.retrieval_cache, "sources": retrieved.sources}}


def remember_answer(feature, key: caches.CacheKey, request_id: str) -> None:
    from django.db import close_old_connections

    close_old_connections()
    row = TokenLog.objects.select_related("transcript").filter(request_id=request_id).first()
    if row is None or row.status != TokenLog.Status.OK:
        return
    caches.store(
        feature, key, text=row.transcript.response_text, completion_tokens=row.completion_tokens,
        cost_micro_usd=row.cost_micro_usd, request_id=request_id,
    )


@sync_to_async(thread_sensitive=False)
def dispatch_generation(request_id: str, reply_to: str, variant: str | None = None) -> None:
    from inference.tasks import generate

    queue = variants.variant_queue(variant or variants.default_variant())
    # Stamped before the publish: a free worker can start the task before apply_async returns here.
    publishing_at = time.time()
    try:
        # The trace context goes in the task's headers (Celery's instrumentation), with the publish time.
        generate.apply_async(args=[request_id, reply_to], queue=queue, retry=False, headers=tracing.enqueue_headers())
    except Exception as exc:
        # Never leave an admitted request holding its reservation because the broker was away.
        fail_undispatched(request_id, str(exc))
        raise
    mark(request_id, "dispatched", at=publishing_at)


def fail_undispatched(request_id: str, error: str) -> None:
    finish_undispatched(request_id, TokenLog.Status.FAILED, 0, "", f"could not reach the workers: {error}")


def finish_undispatched(request_id: str, status: str, prompt_tokens: int, finish_reason: str, error: str) -> None:
    """Settle an admitted request that never reached a worker, and release its reservation."""
    from django.db import close_old_connections

    close_old_connections()
    with tracing.span("settle", request_id, status=status):
        do_finish_request(
            request_id, status=status, prompt_tokens=prompt_tokens, completion_ids=[], text="",
            finish_reason=finish_reason, ttft_ms=None, error=error,
        )
        settle_reservation(request_id)
