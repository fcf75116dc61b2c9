"""Budget forecasts: when each cost cap runs out at the current rate, projected and spike alerts,
the forecast beside the cap on the staff pages, and ceiling_budget_exhaustion_seconds in /metrics.

Synthetic ledger rows in PostgreSQL, one per day at a known hour, and a fixed `now`, so each
projection has an answer worked out by hand in the test. TIME_ZONE is UTC in the suite.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest
from django.db.models import Q
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from budgets.alerts import check_spend_forecasts
from budgets.forecast import all_cost_caps, forecasts
from budgets.models import Alert, Period, Provider, Quota
from tests import test_alert_webhooks as hooks
from tests import test_alerts
from tests.test_alerts import local, spend

pytestmark = pytest.mark.django_db(transaction=True)

smtp, eager_tasks, receivers = test_alerts.smtp, test_alerts.eager_tasks, hooks.receivers
DOLLAR = 1_000_000


def daily(provider, user, feature, first, last, dollars_on) -> None:
    """One settled row at noon on every day from `first` to `last` (dates), costing dollars_on(day)."""
    day = first
    while day <= last:
        amount = dollars_on(day)
        if amount:
            spend(provider, user, feature, round(amount * DOLLAR), at=local(day.year, day.month, day.day, 12))
        day += timedelta(days=1)


def projection_of(scope: str, now, period: str = Period.MONTH):
    return next(f for f in forecasts(all_cost_caps(now), now) if f.cap.scope == scope and f.cap.period == period)


@pytest.fixture
def local_provider(transactional_db) -> Provider:
    return Provider.objects.create(name="local", monthly_limit_micro_usd=50 * DOLLAR, alert_recipients="ops@example.com")


def test_a_steady_30_day_history_runs_out_when_the_arithmetic_says(local_provider, alice, chat_feature):
    now = local(2031, 3, 10, 12)
    daily(local_provider, alice, chat_feature, local(2031, 2, 8).date(), local(2031, 3, 9).date(), lambda d: 2)
    spend(local_provider, alice, chat_feature, 1 * DOLLAR, at=local(2031, 3, 10, 6))  # today so far: half a day's $2

    projection = projection_of("provider:local", now)

    # March so far: 9 days x $2 + $1 = $19 of $50; $31 left at $2 a day is 15.5 days from now.
    assert projection.spent_micro_usd == 19 * DOLLAR
    assert projection.daily_rate_micro_usd == pytest.approx(2 * DOLLAR)
    assert abs((projection.exhausted_at - local(2031, 3, 26, 0)).total_seconds()) < 1
    assert projection.early == timedelta(days=6)
    assert projection.seconds_left == pytest.approx(15.5 * 86400, abs=1)
    assert projection.text == "runs out 26 Mar 00:00 (6 days early)"


def weekdays_only(day) -> float:
    return 10 if day.weekday() < 5 else 0


def test_with_three_weeks_of_history_quiet_weekends_are_forecast_quiet(local_provider, alice, chat_feature):
    Provider.objects.filter(pk=local_provider.pk).update(monthly_limit_micro_usd=115 * DOLLAR)
    now = local(2031, 3, 12, 12)  # a Wednesday, noon
    daily(local_provider, alice, chat_feature, local(2031, 2, 10).date(), local(2031, 3, 11).date(), weekdays_only)
    spend(local_provider, alice, chat_feature, 5 * DOLLAR, at=local(2031, 3, 12, 6))

    projection = projection_of("provider:local", now)

    # $75 spent in March, $40 left at $10 a weekday and $0 a weekend day: the rest of today ($5),
    # Thursday, Friday, (the weekend), Monday, and half of Tuesday the 18th.
    assert projection.weekday_aware and projection.spent_micro_usd == 75 * DOLLAR
    assert abs((projection.exhausted_at - local(2031, 3, 18, 12)).total_seconds()) < 1


def test_with_two_weeks_of_history_the_same_days_are_forecast_flat(local_provider, alice, chat_feature):
    Provider.objects.filter(pk=local_provider.pk).update(monthly_limit_micro_usd=115 * DOLLAR)
    now = local(2031, 3, 12, 12)
    daily(local_provider, alice, chat_feature, local(2031, 2, 26).date(), local(2031, 3, 11).date(), weekdays_only)
    spend(local_provider, alice, chat_feature, 5 * DOLLAR, at=local(2031, 3, 12, 6))

    projection = projection_of("provider:local", now)

    # The last 6.5 days spent $45: $40 left lasts 40 x 6.5 / 45 days = 5 days 18 h 40 min.
    assert not projection.weekday_aware
    assert abs((projection.exhausted_at - local(2031, 3, 18, 6, 40)).total_seconds()) < 1


def test_a_cap_that_lasts_the_month_or_is_spent_or_unused(local_provider, alice, bob, chat_feature):
    now = local(2031, 3, 10, 12)
    daily(local_provider, alice, chat_feature, local(2031, 3, 1).date(), local(2031, 3, 9).date(), lambda d: 0.5)
    Quota.objects.create(user=bob, period=Period.DAY, max_cost_micro_usd=1 * DOLLAR)
    spend(local_provider, bob, chat_feature, 2 * DOLLAR, at=local(2031, 3, 10, 9))

    lasting = projection_of("provider:local", now)
    spent = projection_of("user:bob", now, Period.DAY)

    assert lasting.exhausted_at is None and lasting.seconds_left == math.inf and lasting.text == "lasts the period"
    assert spent.exhausted and spent.seconds_left == 0 and spent.text == "spent"
    assert not lasting.worth_an_alert and not spent.worth_an_alert


def test_default_and_per_feature_cost_caps_are_forecast_per_active_user(local_provider, alice, bob, chat_feature):
    now = local(2031, 3, 10, 12)
    Quota.objects.create(period=Period.MONTH, max_cost_micro_usd=20 * DOLLAR)  # everyone's
    Quota.objects.create(user=alice, feature=chat_feature, period=Period.MONTH, max_cost_micro_usd=15 * DOLLAR)
    daily(local_provider, alice, chat_feature, local(2031, 3, 1).date(), local(2031, 3, 9).date(), lambda d: 1)

    scopes = {(f.cap.scope, f.cap.period): f for f in forecasts(all_cost_caps(now), now)}

    # bob spent nothing this week: no forecast for him under the default.
    assert set(scopes) == {("provider:local", "month"), ("user:alice", "month"), ("user:alice/feature:chat", "month")}
    # Nothing spent yet today: the trailing 6.5 days spent $6. $9 of $15 leaves $6, which lasts 6.5
    # days (17 Mar 00:00); $9 of $20 leaves $11, 11 x 6.5 / 6 days = 11 days 22 h (22 Mar 10:00).
    assert abs((scopes[("user:alice/feature:chat", "month")].exhausted_at - local(2031, 3, 17, 0)).total_seconds()) < 1
    assert abs((scopes[("user:alice", "month")].exhausted_at - local(2031, 3, 22, 10)).total_seconds()) < 1


def test_a_projected_alert_goes_once_per_period_through_every_channel(smtp, receivers, local_provider, alice, chat_feature):
    receiver = receivers()
    hook = hooks.webhook(local_provider, receiver.url)
    now = local(2031, 3, 10, 12)
    daily(local_provider, alice, chat_feature, local(2031, 2, 8).date(), local(2031, 3, 9).date(), lambda d: 2)
    spend(local_provider, alice, chat_feature, 1 * DOLLAR, at=local(2031, 3, 10, 6))

    first = check_spend_forecasts(at=now)
    again = check_spend_forecasts(at=now + timedelta(hours=3))

    assert again == [] and len(first) == 1
    alert = Alert.objects.get(id=first[0])
    assert (alert.kind, alert.scope, alert.period_key, alert.limit_micro_usd) == ("projected", "provider:local", "2031-03", 50 * DOLLAR)
    expected = "At this rate the provider 'local''s monthly budget runs out on 26 Mar, 6 days early."
    [message] = smtp.messages
    assert message["Subject"] == "[Ceiling] provider 'local': monthly budget projected to run out on 26 Mar"
    assert expected in message.get_content()
    [post] = receiver.posts
    assert hooks.signed_by(hook, post) and expected in json.loads(post.body)["text"]
    assert alert.sent_at is not None or Alert.objects.get(id=alert.id).sent_at is not None


def test_a_day_above_three_times_its_trailing_median_is_a_spike_once_a_day(smtp, local_provider, alice, chat_feature):
    Provider.objects.filter(pk=local_provider.pk).update(monthly_limit_micro_usd=None)  # spikes are watched without a limit too
    daily(local_provider, alice, chat_feature, local(2031, 3, 1).date(), local(2031, 3, 9).date(), lambda d: 1)
    spend(local_provider, alice, chat_feature, 3 * DOLLAR, at=local(2031, 3, 10, 8))

    assert check_spend_forecasts(at=local(2031, 3, 10, 9)) == []  # 3x the median is not above it

    spend(local_provider, alice, chat_feature, 1, at=local(2031, 3, 10, 9))
    spiked = check_spend_forecasts(at=local(2031, 3, 10, 10))
    assert check_spend_forecasts(at=local(2031, 3, 10, 11)) == []  # once a day

    [alert] = Alert.objects.filter(id__in=spiked)
    assert (alert.kind, alert.scope, alert.period_key, alert.spent_micro_usd, alert.limit_micro_usd) == (
        "spike", "provider:local", "2031-03-10", 3 * DOLLAR + 1, DOLLAR,
    )
    assert smtp.subjects() == ["[Ceiling] spend spike: provider 'local' on 2031-03-10"]
    assert "3.0× the median day of the 7 before it ($1.00)" in smtp.messages[0].get_content()


def test_a_first_week_of_spend_is_never_a_spike(local_provider, alice, chat_feature):
    daily(local_provider, alice, chat_feature, local(2031, 3, 5).date(), local(2031, 3, 9).date(), lambda d: 1)
    spend(local_provider, alice, chat_feature, 50 * DOLLAR, at=local(2031, 3, 10, 8))
    assert check_spend_forecasts(at=local(2031, 3, 10, 9)) == []
    assert not Alert.objects.filter(kind=Alert.Kind.SPIKE).exists()


def test_metrics_show_seconds_until_each_cost_cap_runs_out(settings, redis_db, local_provider, alice, bob, chat_feature):
    settings.CEILING_METRICS_TOKEN = "forecast-scrape-token"
    now = timezone.now()
    today = now.astimezone(timezone.get_current_timezone()).replace(hour=0, minute=0, second=0, microsecond=0)
    elapsed = (now - today).total_seconds() / 86400
    # alice: $24 a day for a week, today's share so far, and a daily cap that lasts half the rest of today.
    for days_ago in range(1, 7):
        spend(local_provider, alice, chat_feature, 24 * DOLLAR, at=today - timedelta(days=days_ago) + timedelta(hours=12))
    spend(local_provider, alice, chat_feature, round(24 * DOLLAR * elapsed), at=today)
    Quota.objects.create(user=alice, period=Period.DAY, max_cost_micro_usd=round(24 * DOLLAR * (elapsed + (1 - elapsed) / 2)))
    Provider.objects.create(name="hosted", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://x/v1", monthly_limit_micro_usd=DOLLAR)
    Provider.objects.filter(pk=local_provider.pk).update(monthly_limit_micro_usd=DOLLAR)  # spent already

    body = Client().get("/metrics", headers={"Authorization": "Bearer forecast-scrape-token"}).content.decode()

    [family] = [f for f in text_string_to_metric_families(body) if f.name == "ceiling_budget_exhaustion_seconds"]
    values = {(s.labels["scope_kind"], s.labels["scope"], s.labels["period"]): s.value for s in family.samples}
    assert values[("provider", "provider:local", "month")] == 0
    assert values[("provider", "provider:hosted", "month")] == math.inf  # nothing spent on it lately
    assert values[("user", "user:alice", "day")] == pytest.approx((1 - elapsed) / 2 * 86400, abs=5)
    assert 'ceiling_budget_exhaustion_seconds{period="day",scope="user:alice",scope_kind="user"}' in body


def test_the_staff_pages_show_the_forecast_beside_the_cap(staff, local_provider, alice, chat_feature):
    now = timezone.now()
    for days_ago in range(1, 7):
        spend(local_provider, alice, chat_feature, 1000 * DOLLAR, at=now - timedelta(days=days_ago))
    Provider.objects.filter(pk=local_provider.pk).update(monthly_limit_micro_usd=10**6 * DOLLAR)
    Quota.objects.create(user=alice, period=Period.MONTH, max_cost_micro_usd=10**6 * DOLLAR)
    client = Client()
    client.force_login(staff)

    providers = client.get("/staff/providers/").content.decode()
    users = client.get("/staff/users/").content.decode()
    person = client.get(f"/staff/users/{alice.pk}/").content.decode()

    # $1,000 a day against $1,000,000 lasts the month, whatever day of it this is.
    for page in (providers, users, person):
        assert '<span class="forecast small">lasts the period</span>' in page
    Quota.objects.filter(Q(user=alice)).update(max_cost_micro_usd=1 * DOLLAR)
    assert '<span class="forecast small">spent</span>' in client.get("/staff/users/").content.decode()


def test_one_worker_per_interval_checks_the_forecasts(redis_db, local_provider):
    from budgets.reconcile import FORECAST_LOCK_KEY, check_spend_forecasts_once_per

    redis_db.delete(FORECAST_LOCK_KEY)
    assert check_spend_forecasts_once_per(60) is True
    assert check_spend_forecasts_once_per(60) is False  # another worker's reconciliation, same minute
    assert 0 < redis_db.ttl(FORECAST_LOCK_KEY) <= 59
    redis_db.delete(FORECAST_LOCK_KEY)


def test_a_teams_cost_cap_is_forecast_alerted_and_shown_beside_it(staff, local_provider, alice, bob, chat_feature):
    """The team's spend is what its members' ledger rows recorded as the team at admission: the same
    arithmetic as the provider's, a projected alert naming the team, the forecast on its pages."""
    from budgets.actions import do_create_team
    from budgets.models import TeamQuota, TokenLog

    team, _ = do_create_team(None, "Support", [alice, bob])
    TeamQuota.objects.create(team=team, period=Period.MONTH, max_cost_micro_usd=50 * DOLLAR)
    now = local(2031, 3, 10, 12)
    daily(local_provider, alice, chat_feature, local(2031, 2, 8).date(), local(2031, 3, 9).date(), lambda d: 1)
    daily(local_provider, bob, chat_feature, local(2031, 2, 8).date(), local(2031, 3, 9).date(), lambda d: 1)
    spend(local_provider, bob, chat_feature, 1 * DOLLAR, at=local(2031, 3, 10, 6))
    TokenLog.objects.update(team=team)
    spend(local_provider, bob, chat_feature, 40 * DOLLAR, at=local(2031, 3, 9, 13))  # before bob joined: not the team's

    projection = projection_of("team:Support", now)
    # March so far: 9 days x ($1 + $1) + $1 = $19 of $50; $31 left at $2 a day: 15.5 days from now.
    assert projection.spent_micro_usd == 19 * DOLLAR
    assert abs((projection.exhausted_at - local(2031, 3, 26, 0)).total_seconds()) < 1

    check_spend_forecasts(at=now)
    alert = Alert.objects.get(kind=Alert.Kind.PROJECTED, scope="team:Support")
    assert alert.period_key == "2031-03"

    over = spend(local_provider, alice, chat_feature, 60 * DOLLAR)  # now: over the team's $50 this month
    TokenLog.objects.filter(pk=over.pk).update(team=team)
    client = Client()
    client.force_login(staff)
    for url in ("/staff/teams/", f"/staff/teams/{team.pk}/"):
        assert '<span class="forecast small">spent</span>' in client.get(url).content.decode(), url
