"""Tag caps are forecast like every cost cap: the projection from the tag's ledger rows, whoever sent
them, in /metrics (scope_kind "tag") and on the tags page, and a projected alert once a month.

Synthetic ledger rows in PostgreSQL with a fixed `now` where the answer is worked out by hand, as in
tests/test_forecast.py. A row carries its tags as ",a,b,": a tag must match whole, not as a prefix.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from budgets.alerts import check_spend_forecasts
from budgets.forecast import all_cost_caps, forecasts
from budgets.models import Alert, Period, Provider, TagQuota, TokenLog
from budgets.periods import period_bounds
from budgets.tags import tags_text
from tests import test_alerts
from tests.test_alerts import local, spend

pytestmark = pytest.mark.django_db(transaction=True)

smtp, eager_tasks = test_alerts.smtp, test_alerts.eager_tasks
DOLLAR = 1_000_000


@pytest.fixture
def provider(transactional_db) -> Provider:
    return Provider.objects.create(name="local")


def tagged(provider, user, feature, cost_micro_usd: int, tags: list[str], at) -> TokenLog:
    row = spend(provider, user, feature, cost_micro_usd, at=at)
    TokenLog.objects.filter(pk=row.pk).update(tags=tags_text(tags))
    return row


def tag_projection(tag: str, now):
    return next(f for f in forecasts(all_cost_caps(now), now) if f.cap.scope == f"tag:{tag}")


def a_month_of_support_traffic(provider, alice, bob, feature) -> None:
    """$2 a day on the tag 'support' from 8 Feb to 9 Mar 2031 (alice's alone, bob's with another tag),
    and traffic on look-alike tags that must not count."""
    day = local(2031, 2, 8).date()
    while day <= local(2031, 3, 9).date():
        noon = local(day.year, day.month, day.day, 12)
        tagged(provider, alice, feature, 1 * DOLLAR, ["support"], noon)
        tagged(provider, bob, feature, 1 * DOLLAR, ["beta", "support"], noon)
        tagged(provider, bob, feature, 5 * DOLLAR, ["support-team", "supports"], noon)  # not the tag 'support'
        day += timedelta(days=1)
    tagged(provider, alice, feature, 1 * DOLLAR, ["support"], local(2031, 3, 10, 6))  # today so far


def test_a_tag_cap_on_a_30_day_history_runs_out_when_the_arithmetic_says(provider, alice, bob, chat_feature):
    TagQuota.objects.create(tag="support", max_cost_micro_usd=50 * DOLLAR)
    TagQuota.objects.create(tag="beta", max_cost_micro_usd=50 * DOLLAR)
    a_month_of_support_traffic(provider, alice, bob, chat_feature)
    now = local(2031, 3, 10, 12)

    support, beta = tag_projection("support", now), tag_projection("beta", now)

    # March so far: 9 days x $2 + $1 = $19 of $50; $31 left at $2 a day is 15.5 days from now.
    assert support.spent_micro_usd == 19 * DOLLAR and support.cap.period == Period.MONTH
    assert support.daily_rate_micro_usd == pytest.approx(2 * DOLLAR)
    assert abs((support.exhausted_at - local(2031, 3, 26, 0)).total_seconds()) < 1
    # beta: bob's $1 a day only, nothing yet today; $41 of $50 left at 6/6.5 dollars a day lasts past March.
    assert beta.spent_micro_usd == 9 * DOLLAR and beta.exhausted_at is None and beta.seconds_left == math.inf


def test_a_tag_that_runs_out_early_raises_one_projected_alert(smtp, settings, provider, alice, bob, chat_feature):
    settings.CEILING_ALERT_FALLBACK_EMAILS = ["oncall@example.com"]
    TagQuota.objects.create(tag="support", max_cost_micro_usd=50 * DOLLAR)
    a_month_of_support_traffic(provider, alice, bob, chat_feature)
    now = local(2031, 3, 10, 12)

    check_spend_forecasts(at=now)
    check_spend_forecasts(at=now + timedelta(hours=1))

    [alert] = Alert.objects.filter(kind=Alert.Kind.PROJECTED)
    assert (alert.scope, alert.period_key, alert.limit_micro_usd) == ("tag:support", "2031-03", 50 * DOLLAR)
    [message] = smtp.messages
    assert "At this rate the tag 'support''s monthly budget runs out on 26 Mar, 6 days early." in message.get_content()


def test_metrics_and_the_tags_page_show_when_each_tag_cap_runs_out(settings, redis_db, staff, provider, alice, chat_feature):
    settings.CEILING_METRICS_TOKEN = "tag-forecast-token"
    now = timezone.now()
    today = now.astimezone(timezone.get_current_timezone()).replace(hour=0, minute=0, second=0, microsecond=0)
    elapsed = (now - today).total_seconds() / 86400
    # $24 a day for a week, today's share so far: a steady $24 a day.
    for days_ago in range(1, 7):
        tagged(provider, alice, chat_feature, 24 * DOLLAR, ["support"], today - timedelta(days=days_ago) + timedelta(hours=12))
    tagged(provider, alice, chat_feature, round(24 * DOLLAR * elapsed), ["support"], today)
    month_start, month_end = period_bounds(Period.MONTH, now)
    spent = sum(TokenLog.objects.filter(created_at__gte=month_start).values_list("cost_micro_usd", flat=True))
    TagQuota.objects.create(tag="support", max_cost_micro_usd=spent + 12 * DOLLAR)  # half a day more
    TagQuota.objects.create(tag="quiet", max_cost_micro_usd=DOLLAR)  # nothing spent lately: lasts

    body = Client().get("/metrics", headers={"Authorization": "Bearer tag-forecast-token"}).content.decode()

    [family] = [f for f in text_string_to_metric_families(body) if f.name == "ceiling_budget_exhaustion_seconds"]
    values = {(s.labels["scope_kind"], s.labels["scope"], s.labels["period"]): s.value for s in family.samples}
    half_a_day = 12 * 3600 if now + timedelta(hours=12) < month_end else math.inf  # the month may end first
    assert values[("tag", "tag:support", "month")] == pytest.approx(half_a_day, abs=5)
    assert values[("tag", "tag:quiet", "month")] == math.inf
    assert 'ceiling_budget_exhaustion_seconds{period="month",scope="tag:quiet",scope_kind="tag"} +Inf' in body

    client = Client()
    client.force_login(staff)
    page = client.get("/staff/tags/").content.decode()
    rows = page[page.index('id="tag-caps"'):]
    quiet, support = rows.index(">quiet<"), rows.index(">support<")
    assert '<span class="forecast small">no recent spend</span>' in rows[quiet:support]
    assert "runs out" in rows[support:] or half_a_day == math.inf
