"""A team's own alert channels: thresholds of its monthly cost cap, its recipients, its webhooks.

Exactly once per threshold, scope and month for every channel, through the same outbox claim as a
provider's alerts. A real SMTP server and real HTTP receivers on 127.0.0.1 that check the HMAC
signature; the alert tasks run eagerly in the committing thread (tests/test_alerts.py).
"""

from __future__ import annotations

import html
import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from budgets.actions import do_create_team
from budgets.alerts import check_provider_thresholds, check_spend_forecasts, check_team_thresholds
from budgets.models import (
    Alert,
    AlertWebhook,
    AuditEntry,
    Period,
    Provider,
    Team,
    TeamQuota,
    TokenLog,
    WebhookDelivery,
)
from budgets.webhooks import DELIVERY_HEADER, MAX_ATTEMPTS
from project import stack
from tests import test_alert_webhooks as hooks
from tests import test_alerts
from tests.test_alerts import all_at_once, local, spend

pytestmark = pytest.mark.django_db(transaction=True)

smtp, eager_tasks, receivers = test_alerts.smtp, test_alerts.eager_tasks, hooks.receivers
loopback_receivers = hooks.loopback_receivers  # autouse: the receivers are on 127.0.0.1
DOLLAR = 1_000_000
TEAM_CAP = 100 * DOLLAR
TEAM_RECIPIENTS = ["support-lead@example.com"]


@pytest.fixture
def unlimited(transactional_db) -> Provider:
    """The provider the requests ran on, without a limit: only the team's alerts are in play."""
    return Provider.objects.create(name="local", alert_recipients="ops@example.com")


@pytest.fixture
def support(alice, bob) -> Team:
    team, _ = do_create_team(None, "Support", [alice, bob])
    TeamQuota.objects.create(team=team, period=Period.MONTH, max_cost_micro_usd=TEAM_CAP)
    Team.objects.filter(pk=team.pk).update(alert_thresholds=[50, 80, 100], alert_recipients=", ".join(TEAM_RECIPIENTS))
    team.refresh_from_db()
    return team


def team_spend(team: Team | None, provider: Provider, user, feature, cost_micro_usd: int, at=None) -> TokenLog:
    """A settled ledger row admitted under `team` (what the guard records on TokenLog.team)."""
    row = spend(provider, user, feature, cost_micro_usd, at=at)
    TokenLog.objects.filter(pk=row.pk).update(team=team)
    return row


def team_hook(team: Team, url: str, body_format: str = AlertWebhook.BodyFormat.JSON) -> AlertWebhook:
    return AlertWebhook.objects.create(team=team, url=url, secret=hooks.new_secret(), body_format=body_format)


def team_subject(threshold: int, name: str = "Support") -> str:
    return f"[Ceiling] team {name!r} at {threshold}% of its monthly limit"


def test_fifty_concurrent_crossings_of_a_team_threshold_make_one_email_and_one_signed_post(
    smtp, receivers, unlimited, support, alice, chat_feature
):
    Team.objects.filter(pk=support.pk).update(alert_thresholds=[80])
    receiver = receivers()
    hook = team_hook(support, receiver.url)
    team_spend(support, unlimited, alice, chat_feature, 79_000_000)  # 79%
    new_ids: list[int] = []

    def settle_one() -> None:
        team_spend(support, unlimited, alice, chat_feature, 100_000)  # +0.1% each: 84% once all are in
        new_ids.extend(check_team_thresholds(support.id))

    assert all_at_once(50, settle_one) == []

    [alert] = Alert.objects.all()
    assert (alert.kind, alert.scope, alert.threshold, alert.limit_micro_usd) == ("threshold", "team:Support", 80, TEAM_CAP)
    assert new_ids == [alert.id]
    assert smtp.subjects() == [team_subject(80)]
    assert [envelope.rcpt_tos for envelope in smtp.envelopes] == [TEAM_RECIPIENTS]
    [post] = receiver.posts
    assert hooks.signed_by(hook, post) and post.answered == 200
    body = json.loads(post.body)
    assert (body["scope"], body["threshold_percent"], body["limit_micro_usd"]) == ("team:Support", 80, TEAM_CAP)
    assert "settings of the team" in body["text"]
    [delivery] = WebhookDelivery.objects.all()
    assert (delivery.status, delivery.attempts, delivery.webhook_id) == ("sent", 1, hook.pk)


def test_a_team_receiver_failing_three_times_then_succeeding_gets_it_once(
    smtp, receivers, unlimited, support, alice, chat_feature
):
    flaky = receivers()
    flaky.failures = [500, 502, 503]
    hook = team_hook(support, flaky.url, AlertWebhook.BodyFormat.SLACK)
    team_spend(support, unlimited, alice, chat_feature, 50_000_000)

    [alert_id] = check_team_thresholds(support.id)

    assert [post.answered for post in flaky.posts] == [500, 502, 503, 200]
    assert all(hooks.signed_by(hook, post) for post in flaky.posts)
    assert len({post.headers[DELIVERY_HEADER] for post in flaky.posts}) == 1  # one delivery id throughout
    [delivered] = flaky.delivered()
    assert json.loads(delivered.body) == {"text": json.loads(delivered.body)["text"]}  # Slack's body: text alone
    assert json.loads(delivered.body)["text"].startswith(f"*{team_subject(50)}*")
    delivery = WebhookDelivery.objects.get(alert_id=alert_id)
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("sent", 4, 200)
    assert smtp.subjects() == [team_subject(50)]
    assert check_team_thresholds(support.id) == []  # once per threshold and month, however often asked
    assert len(flaky.delivered()) == 1 and len(smtp.envelopes) == 1


def test_each_webhook_gets_only_the_alerts_of_its_scope(smtp, receivers, support, alice, bob, chat_feature):
    limited = Provider.objects.create(name="local", monthly_limit_micro_usd=TEAM_CAP, alert_thresholds=[50])
    other, _ = do_create_team(None, "Sales")
    TeamQuota.objects.create(team=other, period=Period.MONTH, max_cost_micro_usd=TEAM_CAP)
    Team.objects.filter(pk=support.pk).update(alert_thresholds=[50])
    ours, theirs, providers, everything = receivers(), receivers(), receivers(), receivers()
    team_hook(support, ours.url)
    team_hook(other, theirs.url)
    hooks.webhook(limited, providers.url)
    hooks.webhook(None, everything.url)

    team_spend(support, limited, alice, chat_feature, 60_000_000)
    check_team_thresholds(support.id)
    check_provider_thresholds(limited.id)
    assert check_team_thresholds(other.id) == []  # Sales spent nothing

    scopes = {name: sorted(json.loads(p.body)["scope"] for p in r.posts)
              for name, r in (("ours", ours), ("theirs", theirs), ("providers", providers), ("everything", everything))}
    assert scopes == {
        "ours": ["team:Support"], "theirs": [], "providers": ["provider:local"],
        "everything": ["provider:local", "team:Support"],
    }


def test_a_failing_team_webhook_holds_back_no_other_channel_and_shows_on_the_alerts_panel(
    smtp, receivers, staff, unlimited, support, alice, chat_feature
):
    working = receivers()
    dead = team_hook(support, f"http://127.0.0.1:{stack.free_port()}/hook")  # nothing listens there
    team_hook(support, working.url)
    team_spend(support, unlimited, alice, chat_feature, 50_000_000)

    [alert_id] = check_team_thresholds(support.id)

    failed = WebhookDelivery.objects.get(alert_id=alert_id, webhook=dead)
    assert failed.status == "failed" and failed.attempts == MAX_ATTEMPTS and "ConnectError" in failed.last_error
    assert len(working.delivered()) == 1 and smtp.subjects() == [team_subject(50)]
    client = Client()
    client.force_login(staff)
    page = client.get("/staff/alerts/").content.decode()
    failing = page[page.index('id="failing-channels"'):page.index('id="alerts-table"')]
    assert "team:Support 50% " in failing and "ConnectError" in failing and dead.url in failing
    team_page = client.get(f"/staff/teams/{support.pk}/").content.decode()
    webhooks = team_page[team_page.index('id="team-webhooks"'):]
    assert "failed (6 attempts)" in webhooks and "ConnectError" in webhooks


def test_a_team_without_a_monthly_cost_cap_raises_no_threshold_alerts(smtp, unlimited, support, alice, chat_feature):
    TeamQuota.objects.filter(team=support).update(period=Period.DAY)  # a daily cap only
    team_spend(support, unlimited, alice, chat_feature, 10 * TEAM_CAP)

    assert check_team_thresholds(support.id) == []
    assert not Alert.objects.exists() and smtp.envelopes == []


def test_requests_outside_the_team_do_not_count_towards_its_thresholds(smtp, unlimited, support, alice, chat_feature):
    team_spend(None, unlimited, alice, chat_feature, 60_000_000)  # before alice joined: no team recorded
    team_spend(support, unlimited, alice, chat_feature, 40_000_000, at=timezone.now() - timedelta(days=40))  # last month
    team_spend(support, unlimited, alice, chat_feature, 49_000_000)

    assert check_team_thresholds(support.id) == []  # 49% this month
    team_spend(support, unlimited, alice, chat_feature, 1_000_000)
    assert len(check_team_thresholds(support.id)) == 1


def test_settling_a_team_members_request_raises_the_team_alert(smtp, redis_db, unlimited, support, alice, chat_feature):
    # $1 a month for the team, and 10 answer tokens at $0.08 each: one request spends 80% of it.
    TeamQuota.objects.filter(team=support).update(max_cost_micro_usd=DOLLAR)
    test_alerts.settle_an_eighty_cent_request(unlimited, alice, chat_feature)

    assert [(a.scope, a.threshold, a.spent_micro_usd) for a in Alert.objects.order_by("threshold")] == [
        ("team:Support", 50, 800_000), ("team:Support", 80, 800_000),
    ]
    assert smtp.subjects() == [team_subject(50), team_subject(80)]


def test_a_projected_team_alert_goes_through_the_team_channels(smtp, receivers, unlimited, support, alice, chat_feature):
    receiver = receivers()
    hook = team_hook(support, receiver.url)
    TeamQuota.objects.filter(team=support).update(max_cost_micro_usd=50 * DOLLAR)
    now = local(2031, 3, 10, 12)
    day = local(2031, 2, 8).date()
    while day <= local(2031, 3, 9).date():  # $2 a day for 30 days: $31 of March's $50 left lasts 15.5 days
        team_spend(support, unlimited, alice, chat_feature, 2 * DOLLAR, at=local(day.year, day.month, day.day, 12))
        day += timedelta(days=1)
    team_spend(support, unlimited, alice, chat_feature, 1 * DOLLAR, at=local(2031, 3, 10, 6))

    check_spend_forecasts(at=now)
    check_spend_forecasts(at=now + timedelta(hours=2))  # once per period

    [alert] = Alert.objects.filter(kind=Alert.Kind.PROJECTED)
    assert alert.scope == "team:Support" and alert.recipients == ", ".join(TEAM_RECIPIENTS)
    [post] = receiver.posts
    body = json.loads(post.body)
    assert hooks.signed_by(hook, post) and body["kind"] == "projected" and body["scope"] == "team:Support"
    assert "At this rate the team 'Support''s monthly budget runs out on 26 Mar, 6 days early." in body["text"]
    [email] = smtp.envelopes
    assert email.rcpt_tos == TEAM_RECIPIENTS


def test_staff_set_a_teams_thresholds_recipients_and_webhooks_on_its_page(staff, receivers, support):
    receiver = receivers()
    client = Client()
    client.force_login(staff)
    url = f"/staff/teams/{support.pk}/"

    refused = client.post(url, {"save_alerts": "1", "thresholds": "50, lots", "recipients": ""})
    assert refused.status_code == 200 and "is not a whole percent" in refused.content.decode()
    refused = client.post(url, {"save_alerts": "1", "thresholds": "50", "recipients": "not-an-address"})
    assert "is not an email address" in refused.content.decode()
    client.post(url, {"save_alerts": "1", "thresholds": "90, 50%", "recipients": "a@example.com; b@example.com"})

    support.refresh_from_db()
    assert support.alert_thresholds == [50, 90] and support.recipients() == ["a@example.com", "b@example.com"]
    trail = {e.field: (e.before, e.after) for e in AuditEntry.objects.filter(target="team Support", action="update")}
    assert trail == {
        "alert_thresholds": ("50, 80, 100", "50, 90"),
        "alert_recipients": ("support-lead@example.com", "a@example.com, b@example.com"),
    }

    created = client.post(url, {"add_webhook": "1", "url": receiver.url, "body_format": "slack"}, follow=True)
    hook = AlertWebhook.objects.get()
    assert (hook.team, hook.provider, hook.body_format) == (support, None, "slack")
    assert hook.secret in created.content.decode() and hook.secret not in client.get(url).content.decode()
    assert {e.field: e.after for e in AuditEntry.objects.filter(target=f"webhook {hook.pk} (team Support)")} == {
        "team": "Support", "url": receiver.url, "body_format": "slack", "enabled": "yes", "secret": "(set; shown once)",
    }
    refused = client.post(url, {"add_webhook": "1", "url": "ftp://example.com/x", "body_format": "json"})
    assert "starts with http" in refused.content.decode() and AlertWebhook.objects.count() == 1

    # Disabled and deleted from the team page, back on it.
    assert client.post(f"/staff/alerts/webhooks/{hook.pk}/", {"action": "disable"})["Location"] == url
    assert client.post(f"/staff/alerts/webhooks/{hook.pk}/", {"action": "delete"})["Location"] == url
    assert not AlertWebhook.objects.exists()


def test_a_webhook_is_one_providers_or_one_teams_not_both(staff, support):
    provider = Provider.objects.create(name="local")
    client = Client()
    client.force_login(staff)
    response = client.post("/staff/alerts/", {"provider": provider.pk, "team": support.pk,
                                              "url": "https://example.com/hook", "body_format": "json"})
    assert "one provider's alerts or one team's, not both" in html.unescape(response.content.decode())
    assert not AlertWebhook.objects.exists()
    client.post("/staff/alerts/", {"team": support.pk, "url": "https://example.com/hook", "body_format": "json"})
    assert AlertWebhook.objects.get().team == support


def test_end_users_cannot_change_a_teams_alert_channels(alice, support):
    client = Client()
    client.force_login(alice)
    assert client.post(f"/staff/teams/{support.pk}/", {"save_alerts": "1", "thresholds": "1"}).status_code == 403
    assert client.post(f"/staff/teams/{support.pk}/", {"add_webhook": "1", "url": "https://x.example/h",
                                                       "body_format": "json"}).status_code == 403
    support.refresh_from_db()
    assert support.alert_thresholds == [50, 80, 100] and not AlertWebhook.objects.exists()


def test_a_per_feature_cap_of_a_team_with_the_longest_names_is_alerted_to_the_team(
    smtp, receivers, unlimited, alice, chat_feature
):
    long_name = "S" * 64
    team, _ = do_create_team(None, long_name, [alice])
    Team.objects.filter(pk=team.pk).update(alert_recipients="lead@example.com")
    feature = chat_feature.__class__.objects.create(name="f" * 64)
    TeamQuota.objects.create(team=team, feature=feature, period=Period.MONTH, max_cost_micro_usd=50 * DOLLAR)
    receiver = receivers()
    team_hook(team, receiver.url)
    day = local(2031, 2, 8).date()
    while day <= local(2031, 3, 9).date():
        row = team_spend(team, unlimited, alice, feature, 2 * DOLLAR, at=local(day.year, day.month, day.day, 12))
        day += timedelta(days=1)
    assert row.feature == feature

    check_spend_forecasts(at=local(2031, 3, 10, 12))

    [alert] = Alert.objects.filter(kind=Alert.Kind.PROJECTED)
    assert alert.scope == f"team:{long_name}/feature:{feature.name}"  # 142 characters
    assert [json.loads(post.body)["scope"] for post in receiver.posts] == [alert.scope]
    assert [envelope.rcpt_tos for envelope in smtp.envelopes] == [["lead@example.com"]]
