"""The OpenAI-compatible API, driven by the official `openai` client against the real stack."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from email.message import Message

import openai
import psycopg
import pytest
from django.conf import settings
from openai import OpenAI

from accounts.actions import do_create_api_key, do_revoke_api_key
from budgets.models import Feature, Quota, TokenLog
from inference.api import error_event_response, refusal_response, refusal_status
from inference.models import Transcript
from tests.conftest import _test_database_url, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def alice_key(alice) -> str:
    return do_create_api_key(alice, "tests")[1]


def client_for(live_stack, key: str) -> OpenAI:
    # No retries: a test must see the first answer, not the SDK's second try.
    return OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def request_id_of(completion_id: str) -> str:
    assert completion_id.startswith("chatcmpl-")
    return completion_id.removeprefix("chatcmpl-")


def post_raw(live_stack, body: bytes, key: str | None) -> tuple[int, Message, bytes]:
    """A POST to /v1/chat/completions with exactly these bytes: (status, headers, body)."""
    request = urllib.request.Request(
        f"{live_stack.http_url}/v1/chat/completions", data=body, method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def test_a_completion_is_one_object_that_matches_the_ledger(live_stack, alice, alice_key, chat_feature):
    completion = client_for(live_stack, alice_key).chat.completions.create(
        model=MODEL, messages=ask("What is the capital of France?"), max_tokens=24
    )

    assert completion.object == "chat.completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    log = TokenLog.objects.get(request_id=request_id_of(completion.id))
    assert log.status == TokenLog.Status.OK and log.user == alice and log.feature == chat_feature
    assert choice.finish_reason == log.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens == log.prompt_tokens > 0
    assert completion.usage.completion_tokens == log.completion_tokens > 0
    assert completion.usage.total_tokens == log.prompt_tokens + log.completion_tokens
    assert Transcript.objects.get(log=log).response_text == choice.message.content


def test_a_streamed_completion_sends_chunks_then_usage_when_asked(live_stack, alice, alice_key, chat_feature):
    summaries = Feature.objects.create(name="summaries", description="Summaries")
    stream = client_for(live_stack, alice_key).chat.completions.create(
        model="any-name-is-echoed", messages=ask("Name three colours."), max_completion_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"feature": "summaries"},
    )
    chunks = list(stream)

    first, *middle, finish, last = chunks
    assert all(c.object == "chat.completion.chunk" and c.model == "any-name-is-echoed" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert first.choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in [first, *middle])
    assert text.strip() and all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert all(c.usage is None for c in [first, *middle, finish])
    assert last.choices == [] and last.usage is not None

    log = TokenLog.objects.get(request_id=request_id_of(first.id))
    assert log.status == TokenLog.Status.OK and log.user == alice and log.feature == summaries
    assert finish.choices[0].finish_reason == log.finish_reason
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (log.prompt_tokens, log.completion_tokens)
    assert last.usage.total_tokens == log.prompt_tokens + log.completion_tokens
    assert Transcript.objects.get(log=log).response_text == text


def test_the_stream_is_server_sent_events_ending_with_done(live_stack, alice_key, chat_feature):
    body = json.dumps({"model": MODEL, "messages": ask("Say hi."), "max_tokens": 4, "stream": True}).encode()
    status, headers, raw = post_raw(live_stack, body, alice_key)

    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in chunk for chunk in chunks)  # not asked for: OpenAI sends none either
    assert headers["X-Request-Id"] == chunks[0]["id"].removeprefix("chatcmpl-")


def test_the_readme_loop_runs_over_a_plain_stream(live_stack, alice_key, chat_feature):
    stream = client_for(live_stack, alice_key).chat.completions.create(
        model=MODEL, messages=ask("Name a colour."), max_tokens=8, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)  # no IndexError at the end
    assert text.strip()


def test_stream_options_need_a_stream(live_stack, alice_key, chat_feature):
    for extra, code in ((False, "invalid_value"), ({"include_usage": "yes"}, "invalid_type")):
        stream = extra is not False
        options = extra if stream else {"include_usage": True}
        body = json.dumps({"messages": ask("hi"), "stream": stream, "stream_options": options}).encode()
        status, headers, raw = post_raw(live_stack, body, alice_key)
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["param"][:14]) == (400, code, "stream_options")
        assert headers["x-should-retry"] == "false" and headers["x-request-id"]
    assert not TokenLog.objects.exists()


def test_the_models_list_names_the_served_model(live_stack, alice_key):
    models = list(client_for(live_stack, alice_key).models.list())
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        (settings.CEILING_MODEL_NAME, "model", "ceiling"), ("all-MiniLM-L6-v2", "model", "ceiling")]


def test_a_too_long_prompt_is_context_length_exceeded_in_openai_words(live_stack, alice_key, chat_feature):
    chat_feature.max_input_tokens = 20
    chat_feature.save(update_fields=["max_input_tokens"])
    messages = ask("Tell me everything about lighthouses, their keepers, their lamps and their history, please.")

    with pytest.raises(openai.BadRequestError) as refused:
        client_for(live_stack, alice_key).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)

    error = refused.value
    assert error.code == "context_length_exceeded" and error.type == "invalid_request_error"
    log = TokenLog.objects.get()
    assert log.refusal_code == "max_input_tokens"  # the ledger (and the chat page) keep the guard's code
    assert error.body["message"] == (
        f"This model's maximum context length is 20 tokens. However, your messages resulted in {log.prompt_tokens} tokens. "
        "Please reduce the length of the messages. (context_length_exceeded)"
    )
    assert error.response.headers["x-request-id"] == log.request_id
    assert error.response.headers["x-should-retry"] == "false"


def test_langchain_sees_a_too_long_prompt_as_a_context_overflow(live_stack, alice_key, chat_feature):
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    chat_feature.max_input_tokens = 20
    chat_feature.save(update_fields=["max_input_tokens"])
    llm = ChatOpenAI(base_url=f"{live_stack.http_url}/v1", api_key=alice_key, model=MODEL, max_retries=0, max_tokens=4)

    with pytest.raises(ContextOverflowError):
        llm.invoke("Tell me everything about lighthouses, their keepers, their lamps and their history, please.")


def test_a_far_429_is_not_retried_by_the_client(live_stack, alice_key, chat_feature):
    Quota.objects.create(period="month", max_requests=1)
    client = OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=alice_key, max_retries=2, timeout=120)
    client.chat.completions.create(model=MODEL, messages=ask("Say yes."), max_tokens=2)

    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=ask("Say yes."), max_tokens=2)

    headers = refused.value.response.headers
    assert int(headers["Retry-After"]) > 60 and headers["x-should-retry"] == "false"
    refusals = TokenLog.objects.filter(status=TokenLog.Status.REFUSED)
    assert refusals.count() == 1  # one try, not three
    assert headers["x-request-id"] == refusals.get().request_id


@pytest.mark.parametrize(
    ("event", "retry_after", "should_retry"),
    [
        ({"code": "user_requests_per_day", "retry_after_s": 3600}, "3600", "false"),
        ({"code": "user_requests_per_day", "retry_after_s": 30}, "30", None),
        ({"code": "guard_unavailable", "retry_after_s": 30}, "30", None),
        ({"code": "provider_spend", "retry_after_s": None}, None, "false"),
        ({"code": "feature_disabled", "retry_after_s": None}, None, "false"),
        ({"code": "variant_unavailable", "retry_after_s": None}, None, "false"),
    ],
)
def test_a_refusal_says_whether_a_retry_can_help(event, retry_after, should_retry):
    response = refusal_response({"type": "refused", "message": "No.", **event})
    assert (response.get("Retry-After"), response.get("x-should-retry")) == (retry_after, should_retry)


def test_a_bad_json_answer_is_not_worth_a_retry():
    response = error_event_response({"type": "error", "code": "invalid_json", "message": "No JSON object."})
    assert response.status_code == 502 and response["x-should-retry"] == "false"
    failed = error_event_response({"type": "error", "code": "engine_failed", "message": "It broke."})
    assert failed.status_code == 503 and "x-should-retry" not in failed


def test_every_answer_has_a_request_id(live_stack, alice_key, chat_feature):
    answers = [
        post_raw(live_stack, b"{}", key=None),
        post_raw(live_stack, b"not json", alice_key),
        post_raw(live_stack, json.dumps({"model": "no-such-model", "messages": ask("hi")}).encode(), alice_key),
    ]
    ids = [headers["x-request-id"] for _, headers, _ in answers]
    assert [status for status, _, _ in answers] == [401, 400, 404]
    assert all(len(i) == 32 for i in ids) and len(set(ids)) == 3
    assert all(headers["x-should-retry"] == "false" for _, headers, _ in answers)


def test_a_spent_cap_is_a_429_with_the_guards_sentence(live_stack, alice_key, chat_feature):
    Quota.objects.create(period="day", max_requests=1)
    client = client_for(live_stack, alice_key)
    client.chat.completions.create(model=MODEL, messages=ask("Say yes."), max_tokens=2)

    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=ask("Say yes."), max_tokens=2, stream=True)

    error = refused.value
    assert error.status_code == 429 and error.code == "user_requests_per_day" and error.type == "rate_limit_exceeded"
    assert error.body["message"].startswith("You have made 1 of your 1 requests for today.")
    assert 0 < int(error.response.headers["Retry-After"]) <= 86400
    assert TokenLog.objects.filter(status=TokenLog.Status.REFUSED, refusal_code="user_requests_per_day").count() == 1


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("user_requests_per_day", 429, "rate_limit_exceeded"),
        ("feature_tokens_per_month", 429, "rate_limit_exceeded"),
        ("loop_calls", 429, "rate_limit_exceeded"),
        ("user_cost_per_day", 429, "insufficient_quota"),
        ("provider_spend", 429, "insufficient_quota"),
        ("loop_spend", 429, "insufficient_quota"),
        ("max_input_tokens", 400, "invalid_request_error"),
        ("feature_disabled", 403, "permission_error"),
        ("guard_unavailable", 503, "server_error"),
    ],
)
def test_each_refusal_has_its_status_and_type(code, status, kind):
    assert refusal_status(code) == (status, kind)


def test_a_missing_bad_or_revoked_key_is_a_401(live_stack, alice, chat_feature):
    key, plaintext = do_create_api_key(alice, "soon revoked")
    body = json.dumps({"messages": ask("hi")}).encode()

    status, headers, raw = post_raw(live_stack, body, key=None)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(raw)["error"]["type"] == "authentication_error"
    assert json.loads(raw)["error"]["code"] == "missing_api_key"

    for bad in ("ck_not-a-real-key", "sk-" + plaintext[3:]):
        with pytest.raises(openai.AuthenticationError) as denied:
            client_for(live_stack, bad).chat.completions.create(model=MODEL, messages=ask("hi"))
        assert denied.value.code == "invalid_api_key" and denied.value.type == "authentication_error"

    client_for(live_stack, plaintext).models.list()
    do_revoke_api_key(key)
    with pytest.raises(openai.AuthenticationError):
        client_for(live_stack, plaintext).models.list()
    assert not TokenLog.objects.exists()


BAD_BODIES = [
    (b"not json", "bad_json", None),
    (b"[1, 2]", "bad_json", None),
    (json.dumps({"model": MODEL}), "bad_messages", "messages"),
    (json.dumps({"messages": "hello"}), "bad_messages", "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "bad_role", "messages"),
    (json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}), "bad_role", "messages"),
    (json.dumps({"messages": [{"role": "user", "content": " "}]}), "empty_content", "messages"),
    (json.dumps({"messages": ask("hi"), "max_tokens": 0}), "bad_max_tokens", "max_tokens"),
    (json.dumps({"messages": ask("hi"), "max_completion_tokens": "16"}), "bad_max_tokens", "max_tokens"),
    (json.dumps({"messages": ask("hi"), "stream": "yes"}), "bad_stream", "stream"),
    (json.dumps({"messages": ask("hi"), "model": 7}), "bad_model", "model"),
    (json.dumps({"messages": ask("hi"), "feature": 7}), "bad_feature", "feature"),
    (json.dumps({"messages": ask("hi"), "feature": "no-such-feature"}), "unknown_feature", "feature"),
]


def test_bad_input_is_a_400_that_costs_nothing(live_stack, alice_key, chat_feature):
    for body, code, param in BAD_BODIES:
        status, _, raw = post_raw(live_stack, body if isinstance(body, bytes) else body.encode(), alice_key)
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["param"]) == (400, code, param), body
        assert error["type"] == "invalid_request_error" and error["message"]

    with pytest.raises(openai.BadRequestError) as bad:
        client_for(live_stack, alice_key).chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=10**9)
    assert bad.value.code == "bad_max_tokens"
    assert not TokenLog.objects.exists()
    assert "Traceback" not in live_stack.daphne_output()


def test_openai_message_shapes_are_understood(live_stack, alice_key, chat_feature):
    messages = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]},
    ]
    completion = client_for(live_stack, alice_key).chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    transcript = Transcript.objects.get(log__request_id=request_id_of(completion.id))
    assert transcript.messages == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]


def test_a_body_over_the_limit_is_a_413(live_stack, alice_key, chat_feature):
    body = json.dumps({"messages": ask("x" * 100_000)}).encode()
    status, _, raw = post_raw(live_stack, body, alice_key)

    error = json.loads(raw)["error"]
    assert status == 413 and error["code"] == "request_too_large"
    assert f"{len(body):,} bytes" in error["message"] and "65,536" in error["message"]
    assert not TokenLog.objects.exists()


def _settled(request_id: str) -> TokenLog | None:
    log = TokenLog.objects.filter(request_id=request_id).first()
    return log if log is not None and log.status != TokenLog.Status.RUNNING else None


def test_closing_a_stream_early_cancels_the_generation(live_stack, alice_key, chat_feature):
    stream = client_for(live_stack, alice_key).chat.completions.create(
        model=MODEL, messages=ask("Write a very long story about a lighthouse keeper."), max_tokens=400, stream=True
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            break
    stream.close()
    closed_at = time.time()

    log = wait_for(lambda: _settled(request_id_of(chunks[0].id)), timeout=10)
    assert log.status == TokenLog.Status.CANCELLED and log.finish_reason == "cancelled"
    assert log.finished_at.timestamp() - closed_at < 2.0
    assert 3 <= log.completion_tokens < 400


def raw_request(key: str, data: dict) -> bytes:
    """An HTTP/1.1 request as bytes, for tests that hang up on the server from a plain socket."""
    body = json.dumps(data).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_a_client_that_goes_away_before_the_answer_cancels_it(live_stack, alice_key, chat_feature):
    with socket.create_connection((live_stack.host, live_stack.port)) as conn:
        conn.sendall(raw_request(alice_key, {"messages": ask("Write a very long story about a lighthouse keeper."), "max_tokens": 400}))
        started = wait_for(lambda: TokenLog.objects.filter(status=TokenLog.Status.RUNNING).first(), timeout=30)
        wait_for(lambda: Transcript.objects.filter(log=started).exists(), timeout=10)
        time.sleep(0.5)  # a few tokens in
    closed_at = time.time()

    log = wait_for(lambda: _settled(started.request_id), timeout=10)
    assert log.status == TokenLog.Status.CANCELLED
    assert log.finished_at.timestamp() - closed_at < 2.0
    assert log.completion_tokens < 400


def _admission_is_blocked() -> bool:
    with psycopg.connect(_test_database_url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO \"budgets_tokenlog\"%%'"
        ).fetchone()
    return row[0] > 0


def test_a_client_that_leaves_while_the_guard_decides_holds_nothing(live_stack, alice_key, chat_feature):
    Quota.objects.create(period="day", max_tokens=10_000)  # so that admission reserves something
    # Hold the ledger so that admission is caught mid-way, then let the client go.
    with psycopg.connect(_test_database_url()) as conn:
        conn.execute("LOCK TABLE budgets_tokenlog IN EXCLUSIVE MODE")
        try:
            with socket.create_connection((live_stack.host, live_stack.port)) as client:
                client.sendall(raw_request(alice_key, {"messages": ask("Write a long story."), "max_tokens": 400}))
                wait_for(_admission_is_blocked, timeout=30)
            time.sleep(0.5)  # daphne tells Django the client is gone; the view is cancelled
        finally:
            conn.rollback()

    log = wait_for(lambda: TokenLog.objects.exclude(status=TokenLog.Status.RUNNING).first(), timeout=10)
    assert TokenLog.objects.count() == 1
    assert log.status == TokenLog.Status.CANCELLED and log.admitted
    assert log.completion_tokens == 0 and log.counter_keys
    wait_for(lambda: TokenLog.objects.get(pk=log.pk).counters_settled, timeout=5)


# --- the other endpoints clients call --------------------------------------------------------------


def test_a_model_is_retrieved_by_its_id(live_stack, alice_key, chat_feature):
    client = client_for(live_stack, alice_key)
    model = client.models.retrieve(settings.CEILING_MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (settings.CEILING_MODEL_NAME, "model", "ceiling")

    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.response.headers["x-request-id"]


def call(live_stack, method: str, path: str, key: str | None) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(f"{live_stack.http_url}{path}", method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/no-such-thing", 404, "unknown_url"),
        ("POST", "/v1/assistants", 404, "unknown_url"),
        ("GET", "/v1", 404, "unknown_url"),
        ("GET", "/v1/chat/completions/", 404, "unknown_url"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("POST", f"/v1/models/{MODEL}", 405, "method_not_allowed"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("POST", "/v1/openapi.json", 405, "method_not_allowed"),
    ],
)
def test_other_paths_and_methods_are_json_errors(live_stack, alice_key, method, path, status, code):
    answered, headers, raw = call(live_stack, method, path, alice_key)
    assert answered == status and headers["Content-Type"] == "application/json"
    error = json.loads(raw)["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    assert headers["x-request-id"] and headers["x-should-retry"] == "false"
    if status == 405:
        assert headers["Allow"] in ("GET", "POST")


def test_a_legacy_completion_goes_through_the_same_guard_and_ledger(live_stack, alice, alice_key, chat_feature):
    client = client_for(live_stack, alice_key)
    completion = client.completions.create(model=MODEL, prompt="What is the capital of France?", max_tokens=24)

    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    log = TokenLog.objects.get(request_id=completion.id.removeprefix("cmpl-"))
    assert log.status == TokenLog.Status.OK and log.user == alice and "Paris" in completion.choices[0].text
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (log.prompt_tokens, log.completion_tokens)
    assert completion.choices[0].finish_reason == log.finish_reason

    chunks = list(client.completions.create(model=MODEL, prompt=["Name a colour."], max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks).strip() and chunks[-1].choices[0].finish_reason
    assert TokenLog.objects.filter(status=TokenLog.Status.OK).count() == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Once upon", "suffix": "the end."}, "suffix"),
        ({"prompt": "Once upon", "echo": True}, "echo"),
        ({"prompt": "Once upon", "logprobs": 2}, "logprobs"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": " "}, "prompt"),
        ({"messages": ask("hi")}, "messages"),
    ],
)
def test_a_legacy_completion_refuses_what_it_cannot_do_with_a_sentence(live_stack, alice_key, chat_feature, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client_for(live_stack, alice_key).post("/completions", body=body, cast_to=object)
    assert refused.value.param == param and len(refused.value.body["message"]) > 20
    assert not TokenLog.objects.exists()
