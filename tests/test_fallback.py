"""Budget fallbacks (#20 item 3): a cost or provider-spend cap serves the request with the feature's fallback.

The guard against real Redis and PostgreSQL (who serves, what the row and the counters say, both
ceilings exact under concurrency, the user's own caps never falling back), the staff page that sets
a fallback, and the live stack: the websocket's `fell_back` notice and the API's x-ceiling-fallback
header, answered by the fallback's engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from openai import OpenAI

from accounts.actions import do_create_api_key
from budgets.actions import Usage, do_record_usage
from budgets.guard import (
    AdmissionRequest,
    Decision,
    Fallback,
    admit,
    applicable_ceilings,
    counter_store,
    ledger_sums,
    settle,
)
from budgets.models import AuditEntry, Feature, ModelPrice, Provider, Quota, TokenLog
from project import stack
from tests.conftest import _test_database_url, session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "test-model"
LONG_AGO = datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC"))


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:*"):
        if not key.startswith(b"ceiling:engine:"):
            redis_db.delete(key)


def priced_provider(name: str, *, limit_micro_usd: int | None, per_token_micro_usd: int, model: str = MODEL,
                    **fields) -> Provider:
    """A provider with a monthly limit whose `model` costs per_token_micro_usd for each input and output token."""
    provider = Provider.objects.create(name=name, monthly_limit_micro_usd=limit_micro_usd, **fields)
    per_million = per_token_micro_usd * 1_000_000
    ModelPrice.objects.create(provider=provider, model=model, input_per_million_micro_usd=per_million,
                              output_per_million_micro_usd=per_million, effective_from=LONG_AGO)
    return provider


@pytest.fixture
def premium(transactional_db) -> Feature:
    """The primary: an expensive hosted provider, 10,000 µ$ a month (5 requests of 10 + 10 tokens at 100 µ$ a token)."""
    hosted = priced_provider("hosted", limit_micro_usd=10_000, per_token_micro_usd=100)
    return Feature.objects.create(name="premium", provider=hosted)


@pytest.fixture
def basic(premium) -> Feature:
    """premium's fallback: a cheap provider, 3,000 µ$ a month (15 requests at 10 µ$ a token)."""
    cheap = priced_provider("cheap", limit_micro_usd=3_000, per_token_micro_usd=10)
    feature = Feature.objects.create(name="basic", provider=cheap)
    premium.fallback = feature
    premium.save(update_fields=["fallback"])
    return feature


def request(user, feature: Feature, fallback: Feature | None, prompt: int = 10, max_tokens: int = 10) -> AdmissionRequest:
    plan = Fallback(fallback, MODEL, max_tokens) if fallback else None
    return AdmissionRequest(uuid.uuid4().hex, user, feature, MODEL, prompt, max_tokens, fallback=plan)


def spend_provider(provider: Provider) -> None:
    """Fill the provider's monthly limit with one settled row, as a month of traffic would."""
    TokenLog.objects.create(
        request_id=uuid.uuid4().hex, provider=provider, model=MODEL, status=TokenLog.Status.OK,
        cost_micro_usd=provider.monthly_limit_micro_usd, created_at=timezone.now(),
    )


def provider_counter(user, feature: Feature):
    """(counter state, (ledger used, ledger reserved)) of the provider ceiling that applies to the feature."""
    [ceiling] = [c for c in applicable_ceilings(user, feature, feature.provider, timezone.now()) if c.scope == "provider"]
    return counter_store().state(ceiling.spec.key), ledger_sums(ceiling.ledger_filter)


def finish(decision: Decision, completion_tokens: int) -> TokenLog:
    row = TokenLog.objects.get(request_id=decision.request_id)
    do_record_usage(row.request_id, status=TokenLog.Status.OK, usage=Usage(row.prompt_tokens, completion_tokens))
    row.refresh_from_db()
    settle(row)
    return row


# --- the guard -------------------------------------------------------------------------------------


def test_a_spent_provider_limit_admits_the_fallback_and_the_row_names_both(alice, premium, basic):
    spend_provider(premium.provider)

    decision = admit(request(alice, premium, basic))

    assert decision.admitted and decision.fell_back_to == basic and decision.fallback_model == MODEL
    assert decision.fallback_notice.startswith("The provider 'hosted' has reached its monthly spend limit: $0.01 of $0.01.")
    assert decision.fallback_notice.endswith("This answer comes from the feature 'basic' (test-model) instead.")
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.requested_feature, row.feature, row.provider.name, row.status) == (premium, basic, "cheap", "running")
    assert row.price.provider.name == "cheap" and row.reserved_cost_micro_usd == 200  # 20 tokens at 10 µ$
    # The reservation sits on the fallback provider's counter, and settling releases it there.
    cheap_state, (_, cheap_reserved) = provider_counter(alice, basic)
    assert cheap_state.reserved.cost_micro_usd == 200 == cheap_reserved.cost_micro_usd
    assert provider_counter(alice, premium)[0].reserved.cost_micro_usd == 0
    finish(decision, 4)
    cheap_state, (cheap_used, _) = provider_counter(alice, basic)
    assert cheap_state.reserved.cost_micro_usd == 0 and cheap_state.used.cost_micro_usd == 140 == cheap_used.cost_micro_usd


def test_the_token_log_shows_which_feature_a_fallback_served(staff, alice, premium, basic):
    spend_provider(premium.provider)
    decision = admit(request(alice, premium, basic))
    client = Client()
    client.force_login(staff)

    page = client.get(reverse("staff-logs")).content.decode()

    row = page[page.index(decision.request_id):]
    assert row[: row.index("</tr>")].count("basic <span class=\"muted fell-back\">(fallback of premium)</span>") == 1


def test_a_request_that_fits_its_own_feature_does_not_fall_back(alice, premium, basic):
    decision = admit(request(alice, premium, basic))
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert decision.admitted and decision.fell_back_to is None and decision.fallback_notice == ""
    assert (row.feature, row.requested_feature, row.provider.name) == (premium, None, "hosted")


def test_a_cost_cap_of_the_user_on_the_feature_falls_back_too(alice, premium, basic):
    # A cheaper model costs less: a spending allowance may still fit it, a request count never would.
    Quota.objects.create(user=alice, feature=premium, period="day", max_cost_micro_usd=100)

    decision = admit(request(alice, premium, basic))

    assert decision.fell_back_to == basic
    assert decision.fallback_notice.startswith("You have spent $0.00 of $0.000100 for today on 'premium'.")


@pytest.mark.parametrize(
    ("quotas", "code"),
    [
        ([{"on_feature": True, "period": "day", "max_requests": 0}], "feature_requests_per_day"),
        ([{"on_feature": True, "period": "day", "max_tokens": 10}], "feature_tokens_per_day"),
        # A cost cap says no first, but a token cap further down says no as well: the token cap wins.
        ([{"on_feature": False, "period": "day", "max_cost_micro_usd": 1},
          {"on_feature": True, "period": "month", "max_tokens": 10}], "feature_tokens_per_month"),
    ],
)
def test_the_users_request_and_token_caps_never_fall_back(alice, premium, basic, quotas, code):
    # The provider is spent as well, so the fallback would be tried if only money said no.
    spend_provider(premium.provider)
    for quota in quotas:
        on_feature = quota.pop("on_feature")
        Quota.objects.create(user=alice, feature=premium if on_feature else None, **quota)

    decision = admit(request(alice, premium, basic))

    assert not decision.admitted and decision.code == code and "basic" not in decision.message
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.status, row.refusal_code, row.feature, row.requested_feature) == ("refused", code, premium, None)
    assert provider_counter(alice, basic)[0].reserved.requests == 0


def test_when_the_fallback_does_not_fit_either_the_refusal_names_both(alice, premium, basic):
    spend_provider(premium.provider)
    spend_provider(basic.provider)

    decision = admit(request(alice, premium, basic))

    assert not decision.admitted and decision.code == "provider_spend"
    assert decision.message.startswith("The provider 'hosted' has reached its monthly spend limit: $0.01 of $0.01.")
    assert ("Its fallback, the feature 'basic', cannot take it either: "
            "The provider 'cheap' has reached its monthly spend limit: $0.003000 of $0.003000.") in decision.message
    assert 0 < decision.retry_after_s <= 31 * 86400
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.status, row.feature, row.requested_feature, row.reserved_cost_micro_usd) == ("refused", premium, None, 0)


def test_a_fallbacks_own_fallback_is_not_followed(alice, premium, basic):
    spend_provider(premium.provider)
    spend_provider(basic.provider)
    basic.fallback = Feature.objects.create(name="free")  # the local provider, no limit: it would fit
    basic.save(update_fields=["fallback"])

    decision = admit(request(alice, premium, basic))

    assert not decision.admitted and "'free'" not in decision.message


def test_400_concurrent_requests_fill_both_ceilings_exactly(alice, premium, basic, settings):
    # 5 fit the primary, 15 the fallback, from 24 threads here and 3 processes; nothing overshoots.
    settings.CEILING_GUARD_TIMEOUT_S = 2.0  # refusals here must be the caps', not a loaded machine's timeout
    counter_store.cache_clear()
    env = stack.child_env(DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL, CEILING_GUARD_TIMEOUT_S="2")
    args = [str(alice.pk), str(premium.pk), "100", "8", "10", "10", str(basic.pk)]
    processes = [
        subprocess.Popen([sys.executable, "-m", "tests.guard_load", *args], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]

    def one(req: AdmissionRequest) -> Decision:
        try:
            return admit(req)
        finally:
            connection.close()

    with ThreadPoolExecutor(24) as pool:
        local = list(pool.map(one, [request(alice, premium, basic) for _ in range(100)]))
    remote = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in processes]
    counter_store.cache_clear()

    fell_back = sum(d.fell_back_to is not None for d in local) + sum(r["fell_back"] for r in remote)
    on_primary = sum(d.admitted and d.fell_back_to is None for d in local) + sum(r["admitted"] for r in remote)
    assert (on_primary, fell_back) == (5, 15)
    assert {d.code for d in local if not d.admitted} == {"provider_spend"}
    assert all(set(r["codes"]) <= {"provider_spend"} for r in remote)
    admitted = TokenLog.objects.filter(admitted=True)
    assert admitted.filter(provider__name="hosted", requested_feature=None).count() == 5
    assert admitted.filter(provider__name="cheap", requested_feature=premium, feature=basic).count() == 15
    assert TokenLog.objects.filter(status="refused", error__contains="Its fallback, the feature 'basic'").count() == 380
    for feature, limit in ((premium, 10_000), (basic, 3_000)):
        state, (used, reserved) = provider_counter(alice, feature)
        assert state.reserved == reserved and state.used == used
        assert reserved.cost_micro_usd == limit  # full to the last micro-dollar, never past it

    rng = random.Random(20)
    for decision in [d for d in local if d.admitted]:
        finish(decision, rng.randint(0, decision.max_tokens))
    for feature, limit in ((premium, 10_000), (basic, 3_000)):
        state, (used, reserved) = provider_counter(alice, feature)
        assert state.used == used and state.reserved == reserved
        assert used.cost_micro_usd + reserved.cost_micro_usd <= limit


# --- the staff page --------------------------------------------------------------------------------


def save_feature(client: Client, feature: Feature, **changes):
    fields = {"name": feature.name, "description": feature.description, "mode": feature.mode,
              "enabled": "on" if feature.enabled else "", "max_input_tokens": feature.max_input_tokens,
              "max_output_tokens": feature.max_output_tokens, "provider": feature.provider_id or "",
              "fallback": feature.fallback_id or "", "cache_ttl_s": feature.cache_ttl_s, **changes}
    return client.post(reverse("staff-feature", args=[feature.pk]), fields, follow=True)


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def test_staff_set_and_clear_a_fallback_on_the_feature_page_audited(staff_client, staff, chat_feature):
    small = Feature.objects.create(name="small")

    page = save_feature(staff_client, chat_feature, fallback=small.pk)

    assert page.status_code == 200
    chat_feature.refresh_from_db()
    assert chat_feature.fallback == small
    entry = AuditEntry.objects.get(field="fallback")
    assert (entry.actor, entry.target, entry.before, entry.after) == (staff, "feature chat", "none", "small")
    features_page = staff_client.get(reverse("staff-features")).content.decode()
    # Once as its own row's name, once in chat's row as its fallback.
    assert features_page.count(f'<a href="{reverse("staff-feature", args=[small.pk])}">small</a>') == 2
    save_feature(staff_client, chat_feature, fallback="")
    chat_feature.refresh_from_db()
    assert chat_feature.fallback is None


def test_a_feature_cannot_be_its_own_fallback(staff_client, chat_feature):
    page = save_feature(staff_client, chat_feature, fallback=chat_feature.pk)

    assert "a feature is never its own fallback" in page.content.decode()
    chat_feature.refresh_from_db()
    assert chat_feature.fallback is None and not AuditEntry.objects.exists()


def test_a_fallback_chain_that_comes_back_is_refused(staff_client, chat_feature):
    small = Feature.objects.create(name="small")
    tiny = Feature.objects.create(name="tiny", fallback=chat_feature)
    small.fallback = tiny
    small.save(update_fields=["fallback"])

    page = save_feature(staff_client, chat_feature, fallback=small.pk)

    text = page.content.decode().replace("&#x27;", "'").replace("&gt;", ">")
    assert "'small' cannot be the fallback of 'chat': that makes a loop (chat → small → tiny → chat)." in text
    chat_feature.refresh_from_db()
    assert chat_feature.fallback is None


# --- the live stack --------------------------------------------------------------------------------


@pytest.fixture
def hosted_chat(transactional_db) -> Feature:
    """A feature on a hosted server that is never reached (its spend is gone), falling back to the local engine.

    Its answer can only come from the fallback: the hosted server's address answers nothing.
    """
    hosted = priced_provider("hosted", limit_micro_usd=1_000, per_token_micro_usd=1, model="gpt-4o",
                             kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", remote_model="gpt-4o")
    spend_provider(hosted)
    small = Feature.objects.create(name="small", description="the local model")
    return Feature.objects.create(name="hosted-chat", provider=hosted, fallback=small)


def test_the_websocket_says_fell_back_and_the_local_fallback_answers(live_stack, alice, hosted_chat):
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Say yes.", 8, feature="hosted-chat")))

    accepted, notice, *_, done = frames
    assert accepted["type"] == "accepted" and accepted["fallback"] == {"feature": "small", "model": settings.CEILING_MODEL_NAME}
    assert (notice["type"], notice["code"], notice["feature"]) == ("notice", "fell_back", "small")
    assert notice["message"].startswith("The provider 'hosted' has reached its monthly spend limit")
    assert notice["message"].endswith(f"This answer comes from the feature 'small' ({settings.CEILING_MODEL_NAME}) instead.")
    assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0
    row = TokenLog.objects.get(request_id=accepted["request_id"])
    assert (row.status, row.requested_feature, row.feature.name, row.provider.name) == ("ok", hosted_chat, "small", "local")
    assert row.model == settings.CEILING_MODEL_NAME and row.transcript.response_text


def test_the_api_names_the_fallback_in_a_header(live_stack, alice, hosted_chat):
    client = OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=do_create_api_key(alice, "tests")[1], max_retries=0, timeout=120)

    raw = client.chat.completions.with_raw_response.create(
        model="anything", messages=[{"role": "user", "content": "Say yes."}], max_tokens=8,
        extra_body={"feature": "hosted-chat"},
    )

    assert raw.headers["x-ceiling-fallback"] == "small"
    assert raw.headers["x-ceiling-fallback-model"] == settings.CEILING_MODEL_NAME
    completion = raw.parse()
    row = TokenLog.objects.get(request_id=completion.id.removeprefix("chatcmpl-"))
    assert (row.requested_feature, row.feature.name, row.status) == (hosted_chat, "small", "ok")
    assert completion.usage.completion_tokens == row.completion_tokens > 0


def test_over_the_websocket_the_users_cap_refuses_without_a_fallback(live_stack, alice, hosted_chat):
    Quota.objects.create(user=alice, feature=hosted_chat, period="day", max_requests=0)

    [refused] = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Say yes.", 8, feature="hosted-chat")))

    assert refused["type"] == "refused" and refused["code"] == "feature_requests_per_day"
    assert "small" not in refused["message"]
    assert not TokenLog.objects.filter(feature__name="small").exists()
