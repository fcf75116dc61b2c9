"""POST /v1/embeddings on the embedding model Ceiling ships, through the same guard and ledger as a chat."""

from __future__ import annotations

import math
from datetime import timedelta

import openai
import pytest
from django.utils import timezone
from openai import OpenAI

from accounts.actions import do_create_api_key
from budgets.models import Feature, ModelPrice, Provider, Quota, TokenLog
from inference.models import Transcript

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def client(live_stack, alice, chat_feature) -> OpenAI:
    return OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=do_create_api_key(alice, "emb")[1], max_retries=0, timeout=120)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_come_back_in_openais_shape_and_are_logged(client, alice, chat_feature):
    texts = ["How do I reset my password?", "I forgot my password, how can I change it?", "The cat sat on the mat."]
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=texts, encoding_format="float")
    answer = raw.parse()

    assert [d.index for d in answer.data] == [0, 1, 2] and all(len(d.embedding) == 384 for d in answer.data)
    vectors = [d.embedding for d in answer.data]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])  # the meaning, not the words
    row = TokenLog.objects.get(request_id=raw.headers["x-request-id"])
    assert (row.status, row.user, row.feature, row.model) == (TokenLog.Status.OK, alice, chat_feature, MODEL)
    assert row.prompt_tokens == answer.usage.prompt_tokens == answer.usage.total_tokens > 3 * 2
    assert row.completion_tokens == 0
    assert [m["content"] for m in Transcript.objects.get(log=row).messages] == texts


def test_the_clients_default_base64_gives_the_same_vector_as_floats(client, chat_feature):
    as_floats = client.embeddings.create(model=MODEL, input="Hello there", encoding_format="float").data[0].embedding
    as_base64 = client.embeddings.create(model=MODEL, input="Hello there").data[0].embedding  # the client asks base64
    assert as_base64 == pytest.approx(as_floats, abs=1e-6)


def test_langchains_openai_embeddings_work_against_it(live_stack, alice, chat_feature):
    from langchain_openai import OpenAIEmbeddings

    key = do_create_api_key(alice, "lc")[1]
    embedder = OpenAIEmbeddings(base_url=f"{live_stack.http_url}/v1", api_key=key, model=MODEL,
                                check_embedding_ctx_length=False, max_retries=0)
    vectors = embedder.embed_documents(["one document", "another document"])
    assert len(vectors) == 2 and len(vectors[0]) == 384 and len(embedder.embed_query("a question")) == 384


def test_embeddings_are_priced_and_capped_by_the_guard(client, alice, chat_feature):
    local = Provider.default()
    ModelPrice.objects.create(provider=local, model=MODEL, input_per_million_micro_usd=1_000_000,
                              effective_from=timezone.now() - timedelta(days=1))
    Quota.objects.create(period="month", max_requests=1)

    first = client.embeddings.with_raw_response.create(model=MODEL, input="Priced words.", encoding_format="float")
    row = TokenLog.objects.get(request_id=first.headers["x-request-id"])
    assert row.cost_micro_usd == row.prompt_tokens  # $1 per million tokens

    with pytest.raises(openai.RateLimitError) as refused:
        client.embeddings.create(model=MODEL, input="One more.", encoding_format="float")
    assert refused.value.code == "user_requests_per_month"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert TokenLog.objects.get(request_id=refused.value.response.headers["x-request-id"]).status == TokenLog.Status.REFUSED


def test_an_input_longer_than_the_model_reads_is_context_length_exceeded(client, chat_feature):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=["short", "word " * 400], encoding_format="float")
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens. However, input[1] resulted in 402 tokens" in refused.value.body["message"]
    row = TokenLog.objects.get()
    assert row.status == TokenLog.Status.REFUSED and row.refusal_code == "max_input_tokens"  # as a chat's


def test_a_switched_off_feature_and_an_unknown_model_are_refused(client, chat_feature):
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert missing.value.code == "model_not_found"
    Feature.objects.filter(pk=chat_feature.pk).update(enabled=False)
    with pytest.raises(openai.PermissionDeniedError) as off:
        client.embeddings.create(model=MODEL, input="hi")
    assert off.value.code == "feature_disabled"
    assert TokenLog.objects.get().refusal_code == "feature_disabled"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [" "]}, "input"),
        ({"model": MODEL, "input": [[101, 2023]]}, "input"),
        ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "hi", "dimensions": 128}, "dimensions"),
    ],
)
def test_bad_bodies_are_a_400_that_costs_nothing(client, chat_feature, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/embeddings", body=body, cast_to=object)
    assert bad.value.param == param and bad.value.response.headers["x-should-retry"] == "false"
    assert not TokenLog.objects.exists()
