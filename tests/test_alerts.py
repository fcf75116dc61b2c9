"""Spend alerts: once per threshold and month, through the outbox row, by real email.

A real SMTP server (aiosmtpd) on 127.0.0.1 receives the mail; the email task runs eagerly, in the
thread that committed the alert, exactly as `transaction.on_commit` hands it to Celery.
"""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timedelta
from email import message_from_bytes, policy
from email.message import EmailMessage
from zoneinfo import ZoneInfo

import pytest
from aiosmtpd.controller import Controller
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from budgets.alerts import AlertNotSent, check_provider_thresholds
from budgets.guard import counter_store, provider_month_key
from budgets.models import Alert, ModelPrice, Provider, TokenLog
from budgets.money import format_usd
from budgets.tasks import send_alert_email
from inference.actions import do_admit_request, do_finish_request, settle_reservation
from project import stack
from project.celery import app as celery_app

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 100_000_000  # $100.00 a month
RECIPIENTS = ["ops@example.com", "finance@example.com"]


class Inbox:
    """The SMTP server's handler: keeps every message it accepts."""

    def __init__(self) -> None:
        self.envelopes = []
        self.port = 0

    async def handle_DATA(self, server, session, envelope) -> str:
        self.envelopes.append(envelope)
        return "250 Message accepted for delivery"

    @property
    def messages(self) -> list[EmailMessage]:
        return [message_from_bytes(e.original_content, policy=policy.default) for e in self.envelopes]

    def subjects(self) -> list[str]:
        return sorted(m["Subject"] for m in self.messages)


@pytest.fixture
def smtp(settings):
    """A real SMTP server, and Django's SMTP backend pointed at it."""
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=stack.free_port())
    controller.start()
    inbox.port = controller.port
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = controller.port
    settings.EMAIL_USE_TLS = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_TIMEOUT = 5
    settings.DEFAULT_FROM_EMAIL = "ceiling@example.com"
    settings.CEILING_ALERT_FALLBACK_EMAILS = []
    yield inbox
    controller.stop()


@pytest.fixture(autouse=True)
def eager_tasks():
    """Tasks queued with .delay() run at once, in the caller's thread (no worker for "default")."""
    previous = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = previous


@pytest.fixture
def provider(transactional_db) -> Provider:
    provider = Provider.objects.create(
        name="local",
        monthly_limit_micro_usd=LIMIT,
        alert_thresholds=[50, 80, 100],
        alert_recipients=", ".join(RECIPIENTS),
    )
    # Tests that write ledger rows themselves, past the guard, rely on the ledger being summed: no
    # counter of an earlier run (a reused id in a Redis database kept between runs) may stand in.
    store = counter_store()
    store.client.delete(store.redis_key(provider_month_key(provider.pk, timezone.now())))
    return provider


def spend(provider: Provider, user, feature, cost_micro_usd: int, at: datetime | None = None) -> TokenLog:
    """A settled request in the ledger that cost this much."""
    at = at or timezone.now()
    return TokenLog.objects.create(
        request_id=uuid.uuid4().hex,
        user=user,
        feature=feature,
        provider=provider,
        model="SmolLM2-135M-Instruct",
        status=TokenLog.Status.OK,
        cost_micro_usd=cost_micro_usd,
        created_at=at,
        finished_at=at,
        admitted=True,
    )


def local(*args: int) -> datetime:
    return datetime(*args, tzinfo=ZoneInfo(django_settings.TIME_ZONE))


def subject(threshold: int) -> str:
    return f"[Ceiling] provider 'local' at {threshold}% of its monthly limit"


def all_at_once(count: int, work) -> list[BaseException]:
    """Run `work` in `count` threads released together; the errors they raised (none: [])."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def one() -> None:
        try:
            barrier.wait(timeout=30)
            work()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()  # each thread's own database connection

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


def alerts() -> list[Alert]:
    return list(Alert.objects.order_by("period_key", "threshold"))


def test_fifty_concurrent_crossings_of_80_percent_make_one_alert_and_one_email(smtp, provider, alice, chat_feature):
    spend(provider, alice, chat_feature, 79_000_000)  # 79%: not checked yet, so 50% is crossed too
    new_ids: list[int] = []

    def settle_one() -> None:
        spend(provider, alice, chat_feature, 100_000)  # +0.1% each: 84% once all are in
        new_ids.extend(check_provider_thresholds(provider.id))

    assert all_at_once(50, settle_one) == []
    rows = alerts()
    assert [(a.scope, a.threshold, a.period_key) for a in rows] == [
        ("provider:local", 50, timezone.localtime().strftime("%Y-%m")),
        ("provider:local", 80, timezone.localtime().strftime("%Y-%m")),
    ]
    assert sorted(new_ids) == sorted(a.id for a in rows)  # each reported new exactly once
    assert all(a.sent_at is not None and a.claimed_at is not None and a.error == "" for a in rows)

    assert smtp.subjects() == [subject(50), subject(80)]
    for envelope in smtp.envelopes:
        assert envelope.mail_from == "ceiling@example.com"
        assert envelope.rcpt_tos == RECIPIENTS
    eighty = rows[1]
    assert 80_000_000 <= eighty.spent_micro_usd <= 84_000_000 and eighty.limit_micro_usd == LIMIT
    body = next(m for m in smtp.messages if m["Subject"] == subject(80)).get_content()
    assert f"has spent {format_usd(eighty.spent_micro_usd)} of its $100.00 monthly limit" in body
    assert "crossed the 80% alert threshold" in body


def test_twenty_workers_sending_the_same_alert_send_one_email(smtp, settings, provider, alice, chat_feature):
    settings.EMAIL_PORT = stack.free_port()  # the first send fails, so the alert is waiting, unsent
    spend(provider, alice, chat_feature, 50_000_000)
    [alert_id] = check_provider_thresholds(provider.id)
    settings.EMAIL_PORT = smtp.port
    barrier = threading.Barrier(20)
    sent: list[bool] = []

    def worker() -> None:
        try:
            barrier.wait(timeout=30)
            sent.append(send_alert_email(alert_id))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sorted(sent) == [False] * 19 + [True]  # the claim let exactly one through
    assert smtp.subjects() == [subject(50)]


def test_the_same_threshold_alerts_again_next_month(smtp, provider, alice, chat_feature):
    march, april = local(2031, 3, 20, 12), local(2031, 4, 2, 9)
    spend(provider, alice, chat_feature, 85_000_000, at=march)
    assert len(check_provider_thresholds(provider.id, at=march)) == 2
    assert check_provider_thresholds(provider.id, at=march) == []  # once per month, however often asked

    spend(provider, alice, chat_feature, 30_000_000, at=local(2031, 3, 31, 23, 59, 59))  # still March
    spend(provider, alice, chat_feature, 10_000_000, at=april)
    assert check_provider_thresholds(provider.id, at=april) == []  # April has spent 10% so far

    spend(provider, alice, chat_feature, 71_000_000, at=april)
    assert len(check_provider_thresholds(provider.id, at=april)) == 2

    assert [(a.threshold, a.period_key, a.spent_micro_usd) for a in alerts()] == [
        (50, "2031-03", 85_000_000),
        (80, "2031-03", 85_000_000),
        (50, "2031-04", 81_000_000),
        (80, "2031-04", 81_000_000),
    ]
    assert smtp.subjects() == [subject(50), subject(50), subject(80), subject(80)]
    april_bodies = [m.get_content() for m in smtp.messages if "in 2031-04" in m.get_content()]
    assert len(april_bodies) == 2
    assert all("has spent $81.00 of its $100.00 monthly limit in 2031-04 (81%)" in b for b in april_bodies)


def test_a_failed_send_is_recorded_unclaimed_and_sent_once_later(smtp, settings, provider, alice, chat_feature):
    settings.EMAIL_PORT = stack.free_port()  # nothing listens there: the mail server is down
    spend(provider, alice, chat_feature, 80_000_000)

    new_ids = check_provider_thresholds(provider.id)  # the eager task fails, retries, gives up

    assert len(new_ids) == 2 and smtp.envelopes == []
    for alert in alerts():
        assert alert.sent_at is None and alert.claimed_at is None
        assert "ConnectionRefusedError" in alert.error
    with pytest.raises(AlertNotSent):
        send_alert_email(new_ids[0])  # outside a worker the task raises instead of retrying
    assert Alert.objects.get(id=new_ids[0]).claimed_at is None

    settings.EMAIL_PORT = smtp.port  # the mail server is back
    assert [send_alert_email(alert_id) for alert_id in new_ids] == [True, True]
    assert [send_alert_email(alert_id) for alert_id in new_ids] == [False, False]  # sent once, never twice

    assert smtp.subjects() == [subject(50), subject(80)]
    assert all(a.sent_at is not None and a.error == "" for a in alerts())


def test_an_alert_nobody_would_read_waits_for_a_recipient(smtp, settings, alice, chat_feature):
    provider = Provider.objects.create(name="local", monthly_limit_micro_usd=LIMIT, alert_thresholds=[80])
    spend(provider, alice, chat_feature, 90_000_000)

    [alert_id] = check_provider_thresholds(provider.id)

    alert = Alert.objects.get(id=alert_id)
    assert alert.error == "no recipients" and alert.sent_at is None and alert.claimed_at is None
    assert smtp.envelopes == []

    settings.CEILING_ALERT_FALLBACK_EMAILS = ["oncall@example.com"]
    assert send_alert_email(alert_id) is True
    assert [e.rcpt_tos for e in smtp.envelopes] == [["oncall@example.com"]]
    assert smtp.subjects() == [subject(80)]


def test_a_provider_without_a_limit_raises_no_alerts(smtp, alice, chat_feature):
    provider = Provider.objects.create(name="local", monthly_limit_micro_usd=None, alert_recipients="ops@example.com")
    spend(provider, alice, chat_feature, 10**12)

    assert check_provider_thresholds(provider.id) == []
    assert alerts() == [] and smtp.envelopes == []


def test_a_jump_straight_to_the_limit_raises_every_threshold(smtp, provider, alice, chat_feature):
    spend(provider, alice, chat_feature, LIMIT)

    new_ids = check_provider_thresholds(provider.id)

    assert [a.threshold for a in alerts()] == [50, 80, 100] and sorted(new_ids) == [a.id for a in alerts()]
    assert smtp.subjects() == sorted([subject(50), subject(80), subject(100)])
    full = next(m for m in smtp.messages if m["Subject"] == subject(100)).get_content()
    assert "has spent $100.00 of its $100.00 monthly limit" in full and "(100%)" in full
    assert "New requests to it are refused" in full


def test_requests_that_are_refused_or_still_running_are_not_spending(smtp, provider, alice, chat_feature):
    spend(provider, alice, chat_feature, 40_000_000)
    running = spend(provider, alice, chat_feature, 40_000_000)
    TokenLog.objects.filter(pk=running.pk).update(status=TokenLog.Status.RUNNING)
    refused = spend(provider, alice, chat_feature, 40_000_000)
    TokenLog.objects.filter(pk=refused.pk).update(status=TokenLog.Status.REFUSED)

    assert check_provider_thresholds(provider.id) == []  # 40% really spent


def settle_an_eighty_cent_request(provider, user, feature) -> None:
    """One real request of 10 answer tokens at $0.08 each on the provider, admitted, finished and
    settled (then settled again: a replay settles nothing and alerts nothing)."""
    ModelPrice.objects.create(
        provider=provider, model="m", output_per_million_micro_usd=80_000 * 1_000_000, effective_from=local(2020, 1, 1)
    )
    feature.provider = provider
    feature.save(update_fields=["provider"])
    settle_another_eighty_cent_request(user, feature)


def settle_another_eighty_cent_request(user, feature) -> None:
    """settle_an_eighty_cent_request again, on the price and provider it set up."""
    request_id = uuid.uuid4().hex
    decision = do_admit_request(
        request_id=request_id, user=user, feature=feature, model="m",
        messages=[{"role": "user", "content": "hi"}], prompt_ids=[1, 2, 3], max_tokens=10,
    )
    assert decision.admitted, decision.message
    do_finish_request(
        request_id, status=TokenLog.Status.OK, prompt_tokens=3, completion_ids=list(range(10)), text="0123456789",
        finish_reason="length", ttft_ms=5,
    )
    assert settle_reservation(request_id) is True
    assert settle_reservation(request_id) is False


def test_settling_a_request_raises_the_alert(smtp, redis_db, provider, alice, chat_feature):
    # $1 a month, and 10 answer tokens at $0.08 each: one request spends 80% of it.
    Provider.objects.filter(pk=provider.pk).update(monthly_limit_micro_usd=1_000_000)
    settle_an_eighty_cent_request(provider, alice, chat_feature)

    assert [(a.threshold, a.spent_micro_usd, a.limit_micro_usd) for a in alerts()] == [
        (50, 800_000, 1_000_000),
        (80, 800_000, 1_000_000),
    ]
    assert smtp.subjects() == [subject(50), subject(80)]


def ledger_sums(queries: CaptureQueriesContext) -> int:
    return sum('SUM("budgets_tokenlog"."cost_micro_usd")' in query["sql"] for query in queries.captured_queries)


def test_the_ledger_is_summed_only_when_the_guards_counter_may_have_reached_a_new_threshold(smtp, redis_db, provider, alice,
                                                                                          chat_feature):
    # $2 a month; each request spends $0.80 (40%). Settling runs the alert check every time.
    Provider.objects.filter(pk=provider.pk).update(monthly_limit_micro_usd=2_000_000)
    settle_an_eighty_cent_request(provider, alice, chat_feature)  # the guard builds its counter from the ledger
    with CaptureQueriesContext(connection) as first:
        assert check_provider_thresholds(provider.id) == []
    assert alerts() == [] and ledger_sums(first) == 0  # the counter says 40%: under 50, nothing summed

    with CaptureQueriesContext(connection) as second:  # the counter is there: any sum is the alert check's
        settle_another_eighty_cent_request(alice, chat_feature)
    assert [(a.threshold, a.spent_micro_usd) for a in alerts()] == [(50, 1_600_000), (80, 1_600_000)]
    assert ledger_sums(second) == 1

    with CaptureQueriesContext(connection) as again:
        assert check_provider_thresholds(provider.id) == []
    assert ledger_sums(again) == 0  # 80%, and 50 and 80 are raised: only 100 is left
    assert smtp.subjects() == [subject(50), subject(80)]


def test_without_the_guards_counter_the_ledger_decides(smtp, redis_db, provider, alice, chat_feature):
    Provider.objects.filter(pk=provider.pk).update(monthly_limit_micro_usd=2_000_000)
    settle_an_eighty_cent_request(provider, alice, chat_feature)  # 40%, counted by the guard
    spend(provider, alice, chat_feature, 400_000)  # 20% more the counter never saw (a row from a restore, say)
    assert check_provider_thresholds(provider.id) == []  # the counter's 40% is under every threshold

    store = counter_store()
    store.client.delete(store.redis_key(provider_month_key(provider.pk, timezone.now())))
    with CaptureQueriesContext(connection) as queries:
        assert len(check_provider_thresholds(provider.id)) == 1
    assert ledger_sums(queries) == 1 and [a.threshold for a in alerts()] == [50]  # 60% in the ledger


def test_the_outbox_sweeper_queues_alerts_that_were_never_sent_once(transactional_db):
    """A broker outage or a dead worker leaves an alert unsent; the sweeper sends it, once."""
    from datetime import timedelta

    from django.utils import timezone

    from budgets.actions import do_requeue_unsent_alerts
    from budgets.models import Alert

    lost = Alert.objects.create(scope="provider:x", threshold=50, period_key="2026-12", spent_micro_usd=1, limit_micro_usd=2)
    stale = Alert.objects.create(scope="provider:x", threshold=80, period_key="2026-12", spent_micro_usd=1, limit_micro_usd=2,
                                 claimed_at=timezone.now() - timedelta(hours=1))
    done = Alert.objects.create(scope="provider:x", threshold=100, period_key="2026-12", spent_micro_usd=2, limit_micro_usd=2,
                                sent_at=timezone.now())
    assert do_requeue_unsent_alerts() == 2
    lost.refresh_from_db(), stale.refresh_from_db(), done.refresh_from_db()
    assert stale.claimed_at is None and done.sent_at is not None


def test_a_crossing_at_235959_on_the_months_last_day_is_alerted_in_that_month(smtp, redis_db, provider, alice, chat_feature):
    """The request is admitted in the month's last second and settles in the next month: its
    crossing is the old month's. Before, the check after the settle looked at the month of "now"
    (the new month, nothing spent yet) and the crossing was never alerted."""
    from budgets.alerts import check_thresholds_after_settle

    this_month = timezone.localtime()
    last_day = this_month.replace(day=1, hour=0, minute=0, second=0, microsecond=0) - timedelta(seconds=1)
    assert (last_day.hour, last_day.minute, last_day.second) == (23, 59, 59)
    spend(provider, alice, chat_feature, 79_000_000, at=last_day.replace(day=10, hour=12))
    row = spend(provider, alice, chat_feature, 2_000_000, at=last_day)  # 81%: crosses 80 (and 50, unchecked so far)

    new_ids = check_thresholds_after_settle(row)  # settled now, in the next month

    month = last_day.strftime("%Y-%m")
    assert [(a.threshold, a.period_key, a.spent_micro_usd) for a in alerts()] == [(50, month, 81_000_000), (80, month, 81_000_000)]
    assert sorted(new_ids) == [a.id for a in alerts()]
    assert smtp.subjects() == [subject(50), subject(80)]


def test_a_settle_replayed_by_reconciliation_checks_the_thresholds(smtp, redis_db, provider, alice, chat_feature):
    """Redis missed the settle, so its threshold check never ran; reconciliation settles it again
    and, before, checked nothing: the 80% crossing waited for the next request, maybe forever."""
    from budgets.reconcile import retry_unsettled

    Provider.objects.filter(pk=provider.pk).update(monthly_limit_micro_usd=1_000_000)
    ModelPrice.objects.create(
        provider=provider, model="m", output_per_million_micro_usd=80_000 * 1_000_000, effective_from=local(2020, 1, 1)
    )
    chat_feature.provider = provider
    chat_feature.save(update_fields=["provider"])
    request_id = uuid.uuid4().hex
    decision = do_admit_request(
        request_id=request_id, user=alice, feature=chat_feature, model="m",
        messages=[{"role": "user", "content": "hi"}], prompt_ids=[1, 2, 3], max_tokens=10,
    )
    assert decision.admitted, decision.message
    do_finish_request(request_id, status=TokenLog.Status.OK, prompt_tokens=3, completion_ids=list(range(10)),
                      text="0123456789", finish_reason="length", ttft_ms=5)
    # The worker's settle never reached Redis: the row is finished, unsettled, and nothing was checked.
    TokenLog.objects.filter(request_id=request_id).update(finished_at=timezone.now() - timedelta(minutes=2))
    assert alerts() == []

    assert retry_unsettled() == 1

    assert [(a.threshold, a.spent_micro_usd) for a in alerts()] == [(50, 800_000), (80, 800_000)]
    assert smtp.subjects() == [subject(50), subject(80)]
    assert retry_unsettled() == 0 and len(alerts()) == 2  # settled: a second sweep replays nothing
