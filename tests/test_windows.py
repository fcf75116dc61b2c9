"""Caps per minute and per hour: windows against bursts, in the same atomic admission as the day and
month caps (issue #39: "one user, curious or abusive, sending requests as fast as they can")."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets.guard import AdmissionRequest, admit, applicable_ceilings, counter_store, ledger_sums
from budgets.models import Period, Provider, Quota, TokenLog
from inference.web.ratelimits import rate_limit_headers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:*"):
        if not key.startswith(b"ceiling:engine:"):
            redis_db.delete(key)


def mid_minute(second: int = 20):
    return timezone.now().replace(second=second, microsecond=0)


def ask(user, feature, at, prompt: int = 10, max_tokens: int = 10):
    return admit(AdmissionRequest(uuid.uuid4().hex, user, feature, "test-model", prompt, max_tokens), now=at)


def burst(user, feature, at, n: int, **sizes):
    """n admissions at once, after a first one alone.

    The first builds the window's counters from the ledger. Built while a burst's rows are already
    claimed in it, a fresh counter holds their claims until each script settles its own, so a burst
    against it can admit fewer than the cap (never more); a window's counter is fresh every minute.
    """
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def one(_):
        try:
            return ask(user, feature, at, **sizes)
        finally:
            connection.close()

    first = ask(user, feature, at, **sizes)
    with ThreadPoolExecutor(12) as pool:
        return [first, *pool.map(one, range(n - 1))]


def counters_equal_ledger(user, feature, at) -> bool:
    for ceiling in applicable_ceilings(user, feature, Provider.default(), at):
        state = counter_store().state(ceiling.spec.key)
        if state is not None and (state.used, state.reserved) != ledger_sums(ceiling.ledger_filter):
            return False
    return True


def test_a_burst_against_a_per_minute_cap_admits_exactly_the_cap(alice, chat_feature):
    Quota.objects.create(period=Period.MINUTE, max_requests=5)
    Quota.objects.create(period=Period.DAY, max_requests=1_000)
    at = mid_minute()

    decisions = burst(alice, chat_feature, at, 40)

    assert sum(d.admitted for d in decisions) == 5
    refused = [d for d in decisions if not d.admitted]
    assert {d.code for d in refused} == {"user_requests_per_minute"}
    assert all(0 < d.retry_after_s <= 41 for d in refused)  # the window frees at the next minute
    assert "5 of your 5 requests this minute" in refused[0].message and "resets in" in refused[0].message
    assert counters_equal_ledger(alice, chat_feature, at)


def test_the_window_rolls_over_mid_burst(alice, chat_feature):
    Quota.objects.create(period=Period.MINUTE, max_requests=3)
    first_minute = mid_minute(55)
    next_minute = first_minute + timedelta(seconds=10)

    before = burst(alice, chat_feature, first_minute, 8)
    after = burst(alice, chat_feature, next_minute, 8)

    assert (sum(d.admitted for d in before), sum(d.admitted for d in after)) == (3, 3)
    assert TokenLog.objects.filter(status=TokenLog.Status.REFUSED, refusal_code="user_requests_per_minute").count() == 10
    assert counters_equal_ledger(alice, chat_feature, next_minute)


def test_an_hours_token_window_holds_beside_the_days_cap(alice, chat_feature):
    Quota.objects.create(period=Period.HOUR, max_tokens=100)  # 5 requests of 10 + 10
    Quota.objects.create(period=Period.DAY, max_tokens=100_000)

    decisions = burst(alice, chat_feature, mid_minute(), 12)

    admitted = [d for d in decisions if d.admitted]
    assert sum(d.max_tokens for d in admitted) + 10 * len(admitted) <= 100
    assert {d.code for d in decisions if not d.admitted} == {"user_tokens_per_hour"}


def test_a_feature_and_a_team_take_windows_too(alice, chat_feature):
    from budgets.models import Team, TeamMembership, TeamQuota

    team = Team.objects.create(name="Burst")
    TeamMembership.objects.create(user=alice, team=team)
    TeamQuota.objects.create(team=team, period=Period.MINUTE, max_requests=4)
    Quota.objects.create(feature=chat_feature, period=Period.MINUTE, max_requests=6)

    decisions = burst(alice, chat_feature, mid_minute(), 10)

    assert sum(d.admitted for d in decisions) == 4
    assert {d.code for d in decisions if not d.admitted} == {"team_requests_per_minute"}, [(d.code, d.message) for d in decisions if not d.admitted][:3]


def test_the_rate_limit_headers_report_the_tightest_window(alice, chat_feature):
    Quota.objects.create(period=Period.MINUTE, max_requests=3)
    Quota.objects.create(period=Period.DAY, max_requests=100)
    ask(alice, chat_feature, timezone.now())

    headers = rate_limit_headers(alice, "chat")

    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-reset-requests"].endswith("s") and "m" not in headers["x-ratelimit-reset-requests"]


def test_set_quota_sets_a_window_and_refuses_one_for_an_api_key(alice):
    out = io.StringIO()
    call_command("set_quota", "alice", "--period", "minute", "--requests", "30", "--tokens", "5000", stdout=out)
    assert Quota.objects.get(user=alice, period="minute").max_requests == 30

    from accounts.actions import do_create_api_key

    key, _ = do_create_api_key(alice, "k")
    with pytest.raises(CommandError, match="per day or per month"):
        call_command("set_quota", "--api-key", str(key.pk), "--period", "hour", "--requests", "5", stdout=io.StringIO())


def test_staff_set_windows_on_the_same_page(alice, chat_feature):
    from django.contrib.auth.models import User

    staff = User.objects.create_user("windows-staff", password="staff-password-1", is_staff=True)
    client = Client()
    client.force_login(staff)
    page = client.get(reverse("staff-user", args=[alice.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "per minute" in text and "per hour" in text and "per day" in text
