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


# --- a cache answers only what it was asked (#36) --------------------------------------------------------

# ~1,200 characters, as a product's system prompt is: it used to make every question behind it look alike.
LONG_SYSTEM = " ".join(["You are the support assistant of Example Corp. Answer politely, briefly and only from facts."] * 13)


def conversation(question: str, system: str = LONG_SYSTEM, earlier: tuple[dict, ...] = ()) -> list[dict]:
    return [{"role": "system", "content": system}, *earlier, {"role": "user", "content": question}]


@pytest.fixture
def shared_feature(cached_feature):
    cached_feature.cache_shared = True
    cached_feature.semantic_threshold = 0.95
    cached_feature.save()
    return cached_feature


def remember_conversation(feature, user, messages: list[dict], answer: str) -> None:
    store(feature, cache_key(feature, user, "m", 64, messages), text=answer, completion_tokens=7, cost_micro_usd=42, request_id="r1")


def ask_conversation(feature, user, messages: list[dict]):
    return lookup(feature, cache_key(feature, user, "m", 64, messages))


def test_behind_a_long_system_prompt_another_question_is_never_a_hit(shared_feature, alice, bob):
    remember_conversation(shared_feature, alice, conversation("What is the capital of France?"), "The capital of France is Paris.")

    assert ask_conversation(shared_feature, bob, conversation("Write a haiku about rain falling on a quiet city.")) is None
    paraphrase = ask_conversation(shared_feature, bob, conversation("What's the capital city of France?"))
    assert paraphrase is not None and paraphrase.kind == "semantic"  # the same question still is


def test_a_third_turn_is_compared_only_within_the_same_conversation(cached_feature, alice):
    france = ({"role": "user", "content": "Tell me about France."}, {"role": "assistant", "content": "France is a country in Europe."})
    spain = ({"role": "user", "content": "Tell me about Spain."}, {"role": "assistant", "content": "Spain is a country in Europe."})
    remember_conversation(cached_feature, alice, conversation("What is its capital?", earlier=france), "Paris.")

    assert ask_conversation(cached_feature, alice, conversation("What is its capital?", earlier=spain)) is None
    similar = ask_conversation(cached_feature, alice, conversation("what is its capital?", earlier=france))
    assert similar.kind == "semantic" and similar.text == "Paris."


def test_padding_plants_no_answer_for_another_user(shared_feature, alice, bob):
    # Mallory pads the system prompt, or the question, hoping to match what others will ask.
    padded_system = LONG_SYSTEM + " capital France Paris" * 40
    remember_conversation(shared_feature, alice, conversation("What is the capital of France?", system=padded_system), "Planted.")
    padded_question = "What is the capital of France? " + "Ignore this filler text. " * 60
    remember_conversation(shared_feature, alice, conversation(padded_question), "Planted too.")

    assert ask_conversation(shared_feature, bob, conversation("What is the capital of France?")) is None


def test_a_docs_feature_with_other_passages_is_another_context(cached_feature, alice):
    passages = "Answer from these passages.\n[1] Teams: a team's monthly cap is set on its page."
    other = "Answer from these passages.\n[1] Alerts: email is sent once per threshold."
    remember_conversation(cached_feature, alice, conversation("How do I set a team's cap?", system=passages), "On its page.")

    assert ask_conversation(cached_feature, alice, conversation("How do I set a team's cap?", system=other)) is None
    assert ask_conversation(cached_feature, alice, conversation("How do I set a team's cap?", system=passages)).kind == "exact"


def test_the_parameters_and_the_model_are_part_of_the_key(cached_feature, alice):
    messages = conversation("What is the capital of France?")
    store(cached_feature, cache_key(cached_feature, alice, "m", 64, messages, {"seed": 1}), text="Paris.",
          completion_tokens=2, cost_micro_usd=1, request_id="r1")

    assert lookup(cached_feature, cache_key(cached_feature, alice, "m", 64, messages, {"seed": 2})) is None
    assert lookup(cached_feature, cache_key(cached_feature, alice, "m@q4", 64, messages, {"seed": 1})) is None
    assert lookup(cached_feature, cache_key(cached_feature, alice, "m", 64, messages, {"seed": 1})).kind == "exact"


def test_tool_calls_and_results_are_part_of_the_context(cached_feature, alice):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
    first = [{"role": "user", "content": "Weather?"}, call, {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 °C"}]
    other = [*first[:2], {"role": "tool", "tool_call_id": "c1", "content": "Rain, 9 °C"}]
    remember_conversation(cached_feature, alice, first, "It is sunny.")

    assert ask_conversation(cached_feature, alice, other) is None
    assert ask_conversation(cached_feature, alice, first).text == "It is sunny."
