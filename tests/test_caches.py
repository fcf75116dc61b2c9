"""Answer caches against real Redis and the real embedding model: hits, misses, scopes, TTL."""

from __future__ import annotations

import time

import numpy as np
import pytest

from inference.web.caches import cache_key, embed, lookup, normalise, store

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_cache(redis_db):
    for key in redis_db.scan_iter(match="ceiling:cache:*"):
        redis_db.delete(key)


@pytest.fixture
def cached_feature(chat_feature):
    chat_feature.cache_ttl_s = 60
    chat_feature.semantic_threshold = 0.9
    chat_feature.save()
    return chat_feature


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def remember(feature, user, text: str, answer: str, max_tokens: int = 64):
    store(feature, cache_key(feature, user, "m", max_tokens, ask(text)), text=answer, completion_tokens=7, cost_micro_usd=42, request_id="r1")


def test_normalising_ignores_spacing_but_not_words():
    assert normalise(ask("  What is   the capital\\nof France? ".replace("\\n", "\n"))) == normalise(ask("What is the capital of France?"))
    assert normalise(ask("capital of France")) != normalise(ask("capital of Spain"))


def test_embeddings_are_unit_length_and_close_for_paraphrases():
    vectors = embed(["What is the capital of France?", "Tell me France's capital city.", "How do I bake bread?"])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.8 > vectors[0] @ vectors[2]


def test_an_exact_hit_and_a_miss(cached_feature, alice):
    remember(cached_feature, alice, "What is the capital of France?", "Paris.")
    hit = lookup(cached_feature, cache_key(cached_feature, alice, "m", 64, ask("what is the capital of France?".replace("what", "What"))))
    assert hit is not None and hit.kind == "exact" and hit.text == "Paris." and hit.cost_micro_usd == 42
    assert lookup(cached_feature, cache_key(cached_feature, alice, "m", 32, ask("What is the capital of France?"))) is None  # other max_tokens


def test_a_semantic_hit_above_the_threshold_and_a_miss_below(cached_feature, alice):
    remember(cached_feature, alice, "What is the capital of France?", "Paris.")
    hit = lookup(cached_feature, cache_key(cached_feature, alice, "m", 64, ask("What's the capital city of France?")))
    assert hit is not None and hit.kind == "semantic" and hit.similarity >= 0.9 and hit.text == "Paris."
    assert lookup(cached_feature, cache_key(cached_feature, alice, "m", 64, ask("How do I bake sourdough bread?"))) is None


def test_a_private_feature_never_shares_answers_across_users(cached_feature, alice, bob):
    remember(cached_feature, alice, "What is my account number?", "It is 12345.")
    assert lookup(cached_feature, cache_key(cached_feature, bob, "m", 64, ask("What is my account number?"))) is None


def test_a_shareable_feature_reuses_answers_across_users(cached_feature, alice, bob):
    cached_feature.cache_shared = True
    cached_feature.save()
    remember(cached_feature, alice, "What is the boiling point of water?", "100 °C at sea level.")
    hit = lookup(cached_feature, cache_key(cached_feature, bob, "m", 64, ask("What is the boiling point of water?")))
    assert hit is not None and hit.text == "100 °C at sea level."


def test_caching_off_and_expiry(chat_feature, alice):
    remember(chat_feature, alice, "Hi", "Hello!")  # cache_ttl_s = 0: nothing stored
    assert lookup(chat_feature, cache_key(chat_feature, alice, "m", 64, ask("Hi"))) is None
    chat_feature.cache_ttl_s = 1
    chat_feature.semantic_threshold = 0.9
    chat_feature.save()
    remember(chat_feature, alice, "Hi", "Hello!")
    assert lookup(chat_feature, cache_key(chat_feature, alice, "m", 64, ask("Hi"))) is not None
    time.sleep(1.2)
    assert lookup(chat_feature, cache_key(chat_feature, alice, "m", 64, ask("Hi"))) is None
