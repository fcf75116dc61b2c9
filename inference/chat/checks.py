"""Stage 3, checks before the guard: the prompt the model will read, and what refuses it outright.

The mode's additions go into the prompt first (a docs feature's passages, the JSON instruction),
so the input limit, the guard and the ledger all count the prompt the model will read. Then the
feature must be switched on, its weights served by some worker, and the input within its limit:
by size before tokenizing (a huge paste is never tokenized), then by the exact count. A refusal
here is logged as the guard's are, with the same codes.

The local engine's prompt is counted exactly with its tokenizer. A remote's is estimated from
everything sent to it, tools and tool results included (budgets/estimates.py): its ids stay
empty, and its count is an upper bound the guard reserves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial

import redis
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from budgets import estimates
from budgets.actions import do_log_refusal
from budgets.models import Feature, RetrievalFacts
from inference import retrieval, variants
from inference.web import modes
from inference.web.frames import ChatFrame
from inference.web.tokenizer import (
    chat_prompt_ids,
    count_text_tokens,
    input_too_long_by_count,
    input_too_long_by_size,
    model_name,
)

from .events import GUARD_UNAVAILABLE, refused
from .route import Route, is_remote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrievedContext:
    """What a docs feature's retrieval put into the prompt: the ledger's facts and the passages' sources."""

    facts: RetrievalFacts
    sources: list[dict]


@dataclass(frozen=True)
class Checked:
    """A request that passed the checks: its frame as the model will read it, and its prompt's tokens."""

    frame: ChatFrame
    prompt_ids: list[int]
    prompt_tokens: int
    retrieved: RetrievedContext | None = None

    @property
    def facts(self) -> RetrievalFacts | None:
        return self.retrieved.facts if self.retrieved else None


async def check(request_id: str, user: AbstractBaseUser, route: Route, frame: ChatFrame) -> Checked | dict:
    """The checked request, or the refusal event decided here rather than by the guard (logged)."""
    frame, retrieved = await with_mode_prompt(route, user, frame)
    feature, facts = route.feature, retrieved.facts if retrieved else None
    if not feature.enabled:
        message = f"The feature {feature.name!r} is switched off by the operators."
        await log_refusal(request_id, user, feature, "feature_disabled", message, 0, frame.max_tokens, facts)
        return refused("feature_disabled", message)
    variant = variants.variant_of(feature)
    if variant != variants.default_variant() and not await sync_to_async(variants.is_served, thread_sensitive=False)(variant):
        # Queued, it would wait for the first-token timeout in a queue nobody reads.
        message = variants.unavailable_message(feature.name, variant)
        await log_refusal(request_id, user, feature, "variant_unavailable", message, 0, frame.max_tokens)
        return refused("variant_unavailable", message)
    counted = await _counted_prompt(request_id, user, feature, frame, facts)
    if isinstance(counted, dict):
        return counted
    prompt_ids, prompt_tokens = counted
    return Checked(frame, prompt_ids, prompt_tokens, retrieved)


async def with_mode_prompt(route: Route, user: AbstractBaseUser, frame: ChatFrame) -> tuple[ChatFrame, RetrievedContext | None]:
    """The frame with what the mode adds to its prompt: passages the user may read, or the JSON instruction."""
    if route.mode.retrieves:
        messages, retrieved = await retrieve_into_prompt(route.feature, user, frame.messages)
        return replace(frame, messages=messages), retrieved
    if route.mode.collects_json:
        return replace(frame, messages=modes.schema_messages(frame.messages, route.mode.schema)), None
    return frame, None


async def _counted_prompt(request_id, user, feature: Feature, frame: ChatFrame,
                          facts: RetrievalFacts | None) -> tuple[list[int], int] | dict:
    """(token ids, count) within the input limit, or the refusal (logged)."""
    limit = min(feature.max_input_tokens, settings.CEILING_MAX_INPUT_TOKENS)
    prompt_ids: list[int] = []
    if is_remote(feature):
        try:
            prompt_tokens = await sync_to_async(remote_prompt_tokens, thread_sensitive=False)(feature, frame)
        except redis.RedisError as exc:
            log.warning("could not read the prompt estimate of %s: %s", feature.name, exc)
            await log_refusal(request_id, user, feature, "guard_unavailable", GUARD_UNAVAILABLE, 0, frame.max_tokens, facts)
            return refused("guard_unavailable", GUARD_UNAVAILABLE, 30)
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
        return refused("max_input_tokens", refusal, limit=limit, prompt_tokens=prompt_tokens)
    return prompt_ids, prompt_tokens


def remote_prompt_tokens(feature: Feature, frame: ChatFrame) -> int:
    """A remote feature's prompt as the guard reserves it: everything sent, at this provider's learned ratio."""
    return estimates.prompt_estimate(feature.provider_id, model_name(feature), frame.messages, frame.params.stored(),
                                     count_text_tokens)


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
