"""Every refusal reaches the chat socket as a readable sentence; nearing a cap is announced."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from django.test import Client
from django.utils import timezone

from budgets.models import ModelPrice, Provider, Quota, TokenLog
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, read_until_end, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


def refusal_after(live_stack, cookie, frames_before: int, frame: dict | None = None) -> tuple[list[list[dict]], dict]:
    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            answered = []
            for _ in range(frames_before):
                await send(ws, frame or chat_frame("Say yes.", 2))
                answered.append(await read_until_end(ws))
            await send(ws, frame or chat_frame("Say yes.", 2))
            return answered, await next_frame(ws)

    answered, refused = asyncio.run(scenario())
    assert [frames[-1]["type"] for frames in answered] == ["done"] * frames_before
    return answered, refused


def test_the_daily_request_cap_is_a_sentence_with_numbers(live_stack, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=2)
    answered, refused = refusal_after(live_stack, session_cookie(alice), 2)
    assert [frames[-1]["type"] for frames in answered] == ["done", "done"]
    assert any(f["type"] == "notice" for f in answered[1])  # 100% of the cap after the second
    assert refused["type"] == "refused" and refused["code"] == "user_requests_per_day"
    assert refused["message"].startswith("You have made 2 of your 2 requests for today.")
    assert "resets at 00:00" in refused["message"]
    assert 0 < refused["retry_after_s"] <= 86400
    assert TokenLog.objects.filter(status=TokenLog.Status.REFUSED, refusal_code="user_requests_per_day").count() == 1


def test_done_and_refused_carry_whats_left_today(live_stack, alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_requests=2, max_tokens=5_000)
    answered, refused = refusal_after(live_stack, session_cookie(alice), 2)
    first, second = (frames[-1] for frames in answered)
    # Read after each answer settled: it counts that answer's real tokens, nothing reserved.
    used = TokenLog.objects.filter(user=alice, status=TokenLog.Status.OK).order_by("created_at")
    tokens = [row.prompt_tokens + row.completion_tokens for row in used]
    assert first["allowance"]["requests"] == {"limit": 2, "left": 1}
    assert first["allowance"]["tokens"] == {"limit": 5_000, "left": 5_000 - tokens[0]}
    assert second["allowance"]["requests"] == {"limit": 2, "left": 0}
    assert second["allowance"]["tokens"]["left"] == 5_000 - sum(tokens)
    assert "cost_usd" not in second["allowance"]  # no cost cap, nothing said about cost
    assert refused["allowance"] == second["allowance"] | {"resets": refused["allowance"]["resets"]}
    assert refused["allowance"]["resets"].startswith("at 00:00")


def test_the_chat_page_starts_with_whats_left_today(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=20, max_cost_micro_usd=1_500_000)
    TokenLog.objects.create(request_id="earlier", user=alice, feature=chat_feature, model="m", status=TokenLog.Status.OK,
                            prompt_tokens=10, completion_tokens=5, cost_micro_usd=250_000, created_at=timezone.now())
    client = Client()
    client.force_login(alice)
    page = client.get("/chat/")
    config = json.loads(re.search(r'id="chat-config" type="application/json">(.*?)</script>', page.content.decode()).group(1))
    allowance = config["allowance"]
    assert allowance["requests"] == {"limit": 20, "left": 19}
    assert allowance["cost_usd"] == {"limit": "1.500000", "left": "1.250000"}
    assert "tokens" not in allowance and allowance["resets"].startswith("at 00:00")


def test_without_a_daily_cap_the_allowance_is_null(live_stack, alice, chat_feature):
    Quota.objects.create(period="month", max_requests=50)  # a cap, but not today's
    *_, done = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Say yes.", 2)))
    assert done["type"] == "done" and done["allowance"] is None


def test_the_daily_token_cap_cuts_max_tokens_then_refuses(live_stack, alice, chat_feature):
    Quota.objects.create(period="day", max_tokens=60)
    cookie = session_cookie(alice)

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            await send(ws, chat_frame("Hi", 200))
            first = await read_until_end(ws)
            await send(ws, chat_frame("Hi", 200))
            return first, await next_frame(ws)

    first, refused = asyncio.run(scenario())
    accepted = first[0]
    assert accepted["max_tokens"] == 60 - accepted["prompt_tokens"]  # min(asked, what the allowance permits)
    assert refused["code"] == "user_tokens_per_day"
    assert "of your 60 tokens for today" in refused["message"]


def test_a_feature_cap_names_the_feature(live_stack, alice, chat_feature):
    Quota.objects.create(feature=chat_feature, period="month", max_requests=1)
    _, refused = refusal_after(live_stack, session_cookie(alice), 1)
    assert refused["code"] == "feature_requests_per_month"
    assert "on 'chat'" in refused["message"] and "for this month" in refused["message"]


def test_the_provider_spend_limit_refuses_everyone(live_stack, alice, bob, chat_feature):
    provider = Provider.default()
    provider.monthly_limit_micro_usd = 1
    provider.save()
    ModelPrice.objects.create(
        provider=provider, model="SmolLM2-135M-Instruct", input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=1_000_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")),
    )
    _, refused = refusal_after(live_stack, session_cookie(bob), 0)
    assert refused["code"] == "provider_spend"
    assert "The provider 'local' has reached its monthly spend limit" in refused["message"]


def test_a_loop_id_carries_a_call_budget(live_stack, alice, chat_feature, settings):
    frame = chat_frame("Say yes.", 2, loop_id="agent-run-7")
    _, refused = refusal_after(live_stack, session_cookie(alice), 10, frame)  # CEILING_LOOP_MAX_CALLS = 10
    assert refused["code"] == "loop_calls"
    assert refused["message"].startswith("This loop has made 10 of its 10 allowed model calls")
