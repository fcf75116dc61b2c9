"""Stage 4, cache: an answer already given to this question, served free (inference/web/caches.py).

Only a greedy answer is one a cache holds for these messages: a sampled or shaped one is not; the
feature's own defaults are, while they decode greedily (a penalty keeps the answer deterministic).
They are part of the key, so an answer stored under other defaults is not reused.
"""

from __future__ import annotations

from dataclasses import replace

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from budgets.actions import do_log_cache_hit
from budgets.models import Feature, RetrievalFacts, TokenLog
from inference import retrieval
from inference.web import caches
from inference.web.tokenizer import model_name

from .checks import Checked


def cache_key(feature: Feature, user: AbstractBaseUser, checked: Checked, max_tokens: int) -> caches.CacheKey | None:
    """The key this request's answer is looked up and stored under; None when it must not be cached."""
    frame = checked.frame
    if not (feature.cache_ttl_s and frame.params.cacheable and feature.temperature == 0):
        return None
    key = caches.cache_key(feature, user, model_name(feature), max_tokens, frame.messages,
                           {**feature.generation_defaults(), **frame.params.stored()})
    if checked.retrieved is not None:
        # An answer drawn from a staff document is never reused for someone who may not read it,
        # not even as a semantic near-match of a shared feature.
        key = replace(key, scope=f"{key.scope}:{'+'.join(retrieval.audiences_for(user))}")
    return key


async def cached_events(request_id: str, user: AbstractBaseUser, feature: Feature, checked: Checked, max_tokens: int,
                        key: caches.CacheKey | None) -> list[dict] | None:
    """The events of a cache hit (logged at cost 0), or None: ask the model."""
    if key is None:
        return None
    hit = await sync_to_async(caches.lookup, thread_sensitive=False)(feature, key)
    if hit is None:
        return None
    return await serve_cached(request_id, user, feature, checked.prompt_tokens, max_tokens, hit, checked.facts)


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


@sync_to_async(thread_sensitive=False)
def remember_answer(feature, key: caches.CacheKey, request_id: str) -> None:
    """Store a complete answer (finish_reason stop) as the ledger holds it, for the next who asks."""
    from django.db import close_old_connections

    close_old_connections()
    row = TokenLog.objects.select_related("transcript").filter(request_id=request_id).first()
    if row is None or row.status != TokenLog.Status.OK:
        return
    caches.store(
        feature, key, text=row.transcript.response_text, completion_tokens=row.completion_tokens,
        cost_micro_usd=row.cost_micro_usd, request_id=request_id,
    )
