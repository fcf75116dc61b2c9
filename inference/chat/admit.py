"""Stage 5, admit: the budget guard decides (budgets/guard.py): every ceiling that applies at once,
with the feature's fallback offered when a cost cap would refuse it. Then `accepted` and its notices."""

from __future__ import annotations

import asyncio
from functools import partial

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from budgets.guard import Decision, Fallback, LoopLimits
from budgets.models import Feature
from inference import variants
from inference.actions import do_admit_request
from inference.bus.trace import mark
from inference.web.frames import ChatFrame, has_tool_turns
from inference.web.tokenizer import chat_prompt_ids, model_name
from project import tracing

from .checks import Checked, remote_prompt_tokens
from .events import refused
from .route import is_remote
from .settle import close_when_admitted


async def admit(request_id: str, user: AbstractBaseUser, feature: Feature, checked: Checked, max_tokens: int) -> Decision:
    """Ask the guard; if our caller goes away meanwhile, an admitted request is closed as cancelled.

    The guard runs in a thread that cancelling cannot stop, so without the shield a request
    admitted just after its client left would hold its reservation until reconciliation fails it.
    """
    frame = checked.frame
    loop = LoopLimits(frame.loop_id, settings.CEILING_LOOP_MAX_CALLS, settings.CEILING_LOOP_MAX_COST_MICRO_USD) if frame.loop_id else None
    admission = asyncio.ensure_future(admit_request(request_id, user, feature, frame, checked.prompt_ids,
                                                    checked.prompt_tokens, max_tokens, loop, checked.facts))
    try:
        return await asyncio.shield(admission)
    except asyncio.CancelledError:
        close_when_admitted(admission)
        raise


# Admissions run side by side in the event loop's thread pool (not the one thread-sensitive thread):
# the guard is built for concurrent admissions (tests/test_guard*.py), and 64 chats arriving together
# otherwise queue one behind another for their ~12 ledger queries each.
@partial(database_sync_to_async, thread_sensitive=False)
def admit_request(request_id, user, feature, frame: ChatFrame, prompt_ids, prompt_tokens, max_tokens, loop, facts=None) -> Decision:
    fallback = fallback_for(feature, frame, prompt_tokens)
    prompt_ids, prompt_tokens = prompt_for_fallback(feature, fallback, frame, prompt_ids, prompt_tokens)
    with tracing.span("guard", request_id, prompt_tokens=prompt_tokens, max_tokens=max_tokens) as span:
        decision = do_admit_request(
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
        tracing.annotate(span, admitted=decision.admitted, code=decision.code or None,
                         fell_back_to=decision.fell_back_to.name if decision.fell_back_to else None)
    if decision.admitted:
        mark(request_id, "admitted")
    return decision


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


def worker_params(feature: Feature, frame: ChatFrame) -> dict:
    """What the worker generates with (Transcript.params): the request's own values over the feature's
    defaults. A JSON answer (extract mode, response_format) keeps the request's alone: a penalty on
    repeated tokens would punish the quotes and braces every JSON object repeats."""
    stored = frame.params.stored()
    if frame.params.json_mode or feature.mode == Feature.Mode.EXTRACT:
        return stored
    return feature.generation_defaults() | stored


def refused_event(decision: Decision) -> dict:
    return refused(decision.code, decision.message, decision.retry_after_s)


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
