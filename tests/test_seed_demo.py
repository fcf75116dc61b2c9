"""`seed_demo`: the ceiling visible out of the box, and nothing changed when it runs again."""

from __future__ import annotations

import io
import time
import uuid

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db.models import Count, Max, Min, Sum
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets import charts
from budgets.actions import do_save_provider, do_set_quota, snapshot
from budgets.costmodel_data import initial_from_logs
from budgets.guard import AdmissionRequest, admit
from budgets.management.commands import seed_demo
from budgets.models import AuditEntry, Feature, ModelPrice, Provider, Quota, TokenLog
from budgets.selfhosted import per_million_micro_usd
from budgets.usage import cost_per_user, today_allowance

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = settings.CEILING_MODEL_NAME


def seed(*args: str) -> str:
    out = io.StringIO()
    call_command("seed_demo", *args, stdout=out)
    return out.getvalue()


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def seeded_with_history() -> tuple[str, float]:
    """seed_demo with its 30 days of history: the output, and how long it took."""
    started = time.monotonic()
    output = seed()
    return output, time.monotonic() - started


def test_alice_gets_daily_caps_that_a_few_chats_reach():
    seed("--no-history")
    alice = User.objects.get(username="alice")
    quota = Quota.objects.get(user=alice, feature=None, period="day")
    assert (quota.max_requests, quota.max_tokens, quota.max_cost_micro_usd) == (20, 20_000, None)
    allowance = today_allowance(alice, timezone.now())
    assert allowance["requests"] == {"limit": 20, "left": 20} and allowance["tokens"] == {"limit": 20_000, "left": 20_000}
    chat = Feature.objects.get(name="chat")
    for _ in range(20):
        decision = admit(AdmissionRequest(uuid.uuid4().hex, alice, chat, MODEL, 50, 50))
        assert decision.admitted
    refused = admit(AdmissionRequest(uuid.uuid4().hex, alice, chat, MODEL, 50, 50))
    assert refused.code == "user_requests_per_day" and "resets at 00:00" in refused.message
    assert today_allowance(alice, timezone.now())["requests"]["left"] == 0


def test_the_local_provider_is_priced_from_its_hourly_cost_with_a_monthly_limit():
    output = seed("--no-history")
    local = Provider.objects.get(name="local")
    assert local.hourly_cost_micro_usd == seed_demo.LOCAL_HOURLY_COST_MICRO_USD and local.utilisation_percent == 70
    assert local.monthly_limit_micro_usd == seed_demo.LOCAL_MONTHLY_LIMIT_MICRO_USD
    assert local.alert_thresholds == [50, 80, 100]
    assert local.throughput_measured_at is None  # assumed rates: the first worker report replaces them
    [price] = ModelPrice.objects.filter(provider=local, model=MODEL)
    assert price.source == ModelPrice.Source.MEASURED
    assert price.output_per_million_micro_usd == per_million_micro_usd(
        local.hourly_cost_micro_usd, 70, seed_demo.ASSUMED_DECODE_TOKENS_PER_S)
    assert price.input_per_million_micro_usd == per_million_micro_usd(
        local.hourly_cost_micro_usd, 70, seed_demo.ASSUMED_PREFILL_TOKENS_PER_S)
    assert price.effective_from <= timezone.now() - timezone.timedelta(days=seed_demo.HISTORY_DAYS - 1)
    assert "assumed (no worker has measured yet)" in price.basis and "provider 'local': $0.10/h" in output
    # Written through the audited actions, with no person as the actor (the command line).
    targets = set(AuditEntry.objects.filter(actor=None).values_list("target", flat=True))
    assert {"quota alice/all/day", "provider local", f"price local/{MODEL}"} <= targets


def test_running_it_again_changes_nothing_and_keeps_what_staff_changed(staff):
    seed("--no-history")
    alice, local = User.objects.get(username="alice"), Provider.objects.get(name="local")
    do_set_quota(staff, user=alice, feature=None, period="day",
                 caps={"max_requests": 5, "max_tokens": None, "max_cost_micro_usd": None})
    before = snapshot(local, ["hourly_cost_micro_usd", "monthly_limit_micro_usd"])
    local.hourly_cost_micro_usd, local.monthly_limit_micro_usd = 3_600_000, 50_000_000
    do_save_provider(staff, local, ["hourly_cost_micro_usd", "monthly_limit_micro_usd"], before, model=MODEL)
    counts = (ModelPrice.objects.count(), AuditEntry.objects.count(), Quota.objects.count(), User.objects.count())

    output = seed("--no-history")
    assert (ModelPrice.objects.count(), AuditEntry.objects.count(), Quota.objects.count(), User.objects.count()) == counts
    assert Quota.objects.get(user=alice, period="day").max_requests == 5
    local.refresh_from_db()
    assert (local.hourly_cost_micro_usd, local.monthly_limit_micro_usd) == (3_600_000, 50_000_000)
    assert "alice has daily caps; unchanged" in output and "with password" not in output


def test_no_history_means_no_synthetic_rows():
    seed("--no-history")
    assert not TokenLog.objects.exists()


# --- the 30 days of history -----------------------------------------------------------------------


def test_the_history_is_30_days_of_a_few_hundred_users_at_the_local_price(seeded_with_history):
    output, elapsed = seeded_with_history
    rows = TokenLog.objects.filter(request_id__startswith="synth-")
    stats = rows.aggregate(n=Count("id"), users=Count("user", distinct=True), first=Min("created_at"),
                           last=Max("created_at"), cost=Sum("cost_micro_usd"))
    assert stats["n"] == seed_demo.HISTORY_ROWS
    assert 200 <= stats["users"] <= seed_demo.HISTORY_USERS
    assert (stats["last"] - stats["first"]).days >= seed_demo.HISTORY_DAYS - 1
    price = ModelPrice.objects.get(provider__name="local", model=MODEL)
    assert rows.filter(price=price).count() == stats["n"] and stats["cost"] > 0
    assert "created 20,000 rows" in output
    # A few seconds on the 2-core development machine (about 5 s on PostgreSQL and SQLite); the
    # bound only catches a generator that became row-by-row slow.
    assert elapsed < 30


def test_every_staff_page_has_data_on_first_load(seeded_with_history):
    now = timezone.now()
    [local] = [p for p in charts.provider_spend_this_month(now) if p.name == "local"]
    assert 0 < local.spent_micro_usd and local.limit_micro_usd == seed_demo.LOCAL_MONTHLY_LIMIT_MICRO_USD
    day = charts.feature_series(now, "24h")
    month = charts.feature_series(now, "30d")
    assert sum(sum(values) for values in day["tokens"].traces.values()) > 0
    assert len(month["cost"].x) >= 29 and sum(month["cost"].traces["chat"]) > 0
    assert sum(charts.refusal_series(now, "30d").traces.get("user_tokens_per_day", [0])) > 0
    tail = cost_per_user(now - timezone.timedelta(days=30), now)
    assert tail.users >= 200 and tail.p99_micro_usd > tail.p50_micro_usd > 0  # a long tail
    _, note = initial_from_logs(Feature.objects.get(name="chat"))
    assert note.startswith("Prefilled from") and "requests of" in note
    client = Client()
    client.force_login(User.objects.get(username="staff"))  # seed_demo's staff user
    for name in ("staff-overview", "staff-charts", "staff-costs", "staff-costmodel"):
        assert client.get(reverse(name)).status_code == 200, name


def test_a_second_run_adds_no_history(seeded_with_history):
    output = seed()
    assert "synthetic history exists; unchanged" in output
    assert TokenLog.objects.count() == seed_demo.HISTORY_ROWS
