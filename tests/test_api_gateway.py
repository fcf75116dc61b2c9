"""The gateway existing clients expect (#20), with the official `openai` client against the real stack.

Routing by `model` (aliases, the served model, a 404 in OpenAI's shape), OpenAI's sampling and
shaping parameters on the local engine (temperature, seed, stop, response_format, logprobs, n,
tools), the end user's id beside the ledger row, and the x-ratelimit-* headers.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from django.conf import settings
from openai import OpenAI

from accounts.actions import do_create_api_key
from budgets.models import Feature, Quota, TokenLog
from inference.models import ModelAlias, Transcript

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = settings.CEILING_MODEL_NAME
STORY = [{"role": "user", "content": "Write a short story about a fox who finds a key in the forest."}]
PARIS = [{"role": "user", "content": 'Return a JSON object with keys "city" and "country" for Paris.'}]


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def client(live_stack, alice) -> OpenAI:
    key = do_create_api_key(alice, "tests")[1]
    # No retries: a test must see the first answer, not the SDK's second try.
    return OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def support(transactional_db) -> Feature:
    feature = Feature.objects.create(name="support", description="Support answers")
    ModelAlias.objects.create(name="support-bot", feature=feature)
    ModelAlias.objects.create(name="gpt-4o-mini", feature=feature)
    return feature


def row_of(completion) -> TokenLog:
    return TokenLog.objects.get(request_id=completion.id.removeprefix("chatcmpl-"))


def answer(client: OpenAI, **fields) -> str:
    completion = client.chat.completions.create(**{"model": MODEL, "messages": STORY, "max_tokens": 24, **fields})
    return completion.choices[0].message.content


# --- routing by model ------------------------------------------------------------------------------


def test_the_models_list_has_the_served_model_and_each_usable_alias(client, chat_feature, support):
    hidden = Feature.objects.create(name="old", enabled=False)
    ModelAlias.objects.create(name="old-bot", feature=hidden)
    jobs = Feature.objects.create(name="nightly", mode=Feature.Mode.BATCH)
    ModelAlias.objects.create(name="nightly-bot", feature=jobs)

    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL, "gpt-4o-mini", "support-bot", "all-MiniLM-L6-v2"]
    assert [m.feature for m in models] == ["chat", "support", "support", "chat"]  # the last: /v1/embeddings


def test_the_model_selects_the_feature_and_an_unknown_model_is_a_404(client, chat_feature, support):
    by_alias = client.chat.completions.create(model="support-bot", messages=STORY, max_tokens=4)
    assert by_alias.model == "support-bot" and row_of(by_alias).feature == support
    by_name = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4)
    assert row_of(by_name).feature == chat_feature
    # "feature" in the body still wins, whatever the model says.
    both = client.chat.completions.create(model="no-such-model", messages=STORY, max_tokens=4, extra_body={"feature": "support"})
    assert row_of(both).feature == support

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5-turbo", messages=STORY, max_tokens=4)
    error = missing.value
    assert error.status_code == 404 and error.code == "model_not_found" and error.type == "invalid_request_error"
    assert error.body["param"] is None and "`gpt-5-turbo` does not exist" in error.body["message"]
    assert TokenLog.objects.count() == 3


def test_langchains_chat_model_reaches_a_feature_by_its_alias(live_stack, alice, chat_feature, support):
    from langchain_openai import ChatOpenAI

    key = do_create_api_key(alice, "langchain")[1]
    llm = ChatOpenAI(model="support-bot", base_url=f"{live_stack.http_url}/v1", api_key=key, max_tokens=8,
                     temperature=0, max_retries=0)
    reply = llm.invoke("What is the capital of France?")
    assert reply.content and TokenLog.objects.get().feature == support


# --- sampling on the local engine ------------------------------------------------------------------


def test_temperature_zero_is_the_same_answer_every_time(client, chat_feature):
    assert answer(client, temperature=0) == answer(client, temperature=0) == answer(client)


def test_a_seed_makes_a_sampled_answer_reproducible(client, chat_feature):
    first = answer(client, temperature=1.2, seed=1)
    second = answer(client, temperature=1.2, seed=2)
    assert first != second
    assert answer(client, temperature=1.2, seed=1) == first
    assert answer(client, temperature=1.2, seed=2) == second
    assert Transcript.objects.filter(params={"temperature": 1.2, "seed": 1}).count() == 2


def test_a_stop_string_ends_the_answer_before_it(client, chat_feature):
    whole = answer(client, max_tokens=40)
    word = whole.split()[4]
    cut = whole[: whole.index(word)]

    completion = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=40, stop=[word, "zzzz"])
    assert completion.choices[0].message.content == cut
    assert completion.choices[0].finish_reason == "stop"
    row = row_of(completion)
    assert row.status == TokenLog.Status.OK and row.finish_reason == "stop"
    assert row.transcript.response_text == cut and row.completion_tokens < 40

    stream = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=40, stop=word, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_logprobs_are_the_engines_own(client, chat_feature):
    completion = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, logprobs=True, top_logprobs=2)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    assert "".join(e.token for e in entries).strip() == completion.choices[0].message.content.strip()
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the likeliest one.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2).choices[0].logprobs is None


# --- shapes: JSON, n, tools, user ------------------------------------------------------------------


def test_json_object_is_parseable_json(client, chat_feature):
    completion = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=48, response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content), dict)

    stream = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=48, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_an_answer_that_breaks_the_json_schema_is_a_502(client, chat_feature):
    schema = {"type": "object", "properties": {"code": {"const": "never-said-7f3a"}}, "required": ["code"]}
    with pytest.raises(openai.InternalServerError) as broken:
        client.chat.completions.create(
            model=MODEL, messages=PARIS, max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": schema}},
        )
    assert broken.value.status_code == 502 and broken.value.code == "invalid_json"
    # A 135M model's JSON may not parse at all; either way the answer is not the schema's (the
    # schema's own sentence is tests/test_api_params.py's).
    message = broken.value.body["message"]
    assert "does not match the requested schema" in message or "is not a JSON object" in message
    assert message.endswith("tokens it used are still counted.")
    assert TokenLog.objects.get().status == TokenLog.Status.OK  # the tokens it used still count


def test_more_than_one_choice_and_tools_on_the_local_engine_are_400s(client, chat_feature):
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4, n=2)
    assert many.value.code == "unsupported_value" and many.value.param == "n"
    assert "'n' must be 1, not 2" in many.value.body["message"]

    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4, tools=[tool])
    assert tools.value.code == "tools_unsupported" and tools.value.param == "tools"
    assert "runs on the local engine" in tools.value.body["message"]

    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model=MODEL, messages=STORY, temperature=3)
    assert hot.value.code == "decimal_above_max_value" and hot.value.param == "temperature"
    assert not TokenLog.objects.exists()


def test_the_end_users_id_is_kept_beside_the_ledger_row(client, chat_feature):
    completion = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, user="customer-4711")
    assert Transcript.objects.get(log=row_of(completion)).end_user == "customer-4711"


# --- rate-limit headers ----------------------------------------------------------------------------


RESET = re.compile(r"^(\d+h)?(\d+m)?\d+s$")


def limits(headers) -> tuple[int, int, int, int]:
    assert RESET.match(headers["x-ratelimit-reset-requests"]) and RESET.match(headers["x-ratelimit-reset-tokens"])
    return (int(headers["x-ratelimit-limit-requests"]), int(headers["x-ratelimit-remaining-requests"]),
            int(headers["x-ratelimit-limit-tokens"]), int(headers["x-ratelimit-remaining-tokens"]))


def test_the_rate_limit_headers_count_down_from_the_tightest_cap(client, alice, chat_feature):
    Quota.objects.create(period="month", max_requests=100, max_tokens=100_000)
    Quota.objects.create(period="day", max_requests=3, max_tokens=5_000)  # tighter on both: today's
    Quota.objects.create(user=alice, feature=chat_feature, period="day", max_tokens=2_000)  # tighter on tokens

    assert limits(client.models.with_raw_response.list().headers) == (3, 3, 5_000, 5_000)  # no feature yet
    seen = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=STORY, max_tokens=4)
        seen.append(limits(raw.headers))
    used = [row.prompt_tokens + row.completion_tokens for row in TokenLog.objects.order_by("created_at")]
    assert [(r, left) for r, left, _, _ in seen] == [(3, 2), (3, 1)]
    assert [(t, left) for _, _, t, left in seen] == [(2_000, 2_000 - used[0]), (2_000, 2_000 - used[0] - used[1])]

    # A stream's headers go out once it is admitted: its reservation (prompt + max_tokens) is counted.
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=STORY, max_tokens=4, stream=True) as streamed:
        _, left, _, tokens_left = limits(streamed.headers)
        assert left == 0 and tokens_left <= seen[-1][3] - 4
        streamed.read()

    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4)
    assert limits(refused.value.response.headers)[:2] == (3, 0)
