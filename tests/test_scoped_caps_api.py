"""Tags and API key caps over the wire: `metadata.tags` / `extra_body.tags` on /v1, `tags` on the chat
socket, validated with a clear 400 or error frame, recorded on the ledger row, capped by the guard."""

from __future__ import annotations

import asyncio

import openai
import pytest
from django.conf import settings
from openai import OpenAI

from accounts.actions import do_create_api_key
from budgets.models import TagQuota, TokenLog
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = settings.CEILING_MODEL_NAME
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def key_and_client(live_stack, alice):
    key, plaintext = do_create_api_key(alice, "ci")
    return key, OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=plaintext, max_retries=0, timeout=120)


def test_extra_body_tags_are_recorded_on_the_ledger_row(key_and_client, chat_feature):
    key, client = key_and_client
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                                extra_body={"tags": ["support", "beta"]})
    row = TokenLog.objects.get(request_id=completion.id.removeprefix("chatcmpl-"))
    assert (row.tags, row.tag_list, row.api_key_id) == (",support,beta,", ["support", "beta"], key.pk)


def test_a_tag_cap_refuses_over_the_api_with_a_429(key_and_client, chat_feature):
    _, client = key_and_client
    TagQuota.objects.create(tag="support", max_cost_micro_usd=0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                       extra_body={"metadata": {"tags": ["support"]}})
    assert refused.value.code == "tag_cost_per_month"
    assert "The tag 'support' has used $0.00 of its $0.00 for this month" in refused.value.message
    assert TokenLog.objects.get(refusal_code="tag_cost_per_month").tags == ",support,"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tags": ["Support Team"]}, "'support team' is not a tag name"),
        ({"tags": [f"t{i}" for i in range(9)]}, "at most 8"),
        ({"tags": "support"}, "must be a list of tag names"),
        ({"tags": ["a"], "metadata": {"tags": ["b"]}}, "Send \"tags\" once"),
    ],
)
def test_bad_tags_are_a_400_that_says_why(key_and_client, chat_feature, body, message):
    _, client = key_and_client
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body=body)
    assert bad.value.code == "bad_tags" and message in bad.value.message
    assert not TokenLog.objects.exists()


def test_a_keys_own_daily_cap_refuses_it_and_not_its_users_other_keys(key_and_client, live_stack, alice, chat_feature):
    key, client = key_and_client
    key.max_requests_per_day = 1
    key.save()
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2)
    # The key's cap is the tightest: the rate-limit headers count it.
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert refused.value.code == "key_requests_per_day"
    assert "This API key ('ci') has made 1 of its 1 requests for today." in refused.value.message
    other = OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=do_create_api_key(alice, "other")[1], max_retries=0)
    assert other.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices


def test_tags_on_the_chat_socket_are_recorded_and_bad_ones_are_an_error_frame(live_stack, alice, chat_feature):
    cookie = session_cookie(alice)
    frames = asyncio.run(chat(live_stack, cookie, chat_frame("Say hello.", 2, tags=["support"])))
    assert frames[-1]["type"] == "done"
    assert TokenLog.objects.get(request_id=frames[-1]["request_id"]).tags == ",support,"
    [error] = asyncio.run(chat(live_stack, cookie, chat_frame("Say hello.", 2, tags=["no spaces"])))
    assert error["type"] == "error" and error["code"] == "bad_tags" and "'no spaces' is not a tag name" in error["message"]
