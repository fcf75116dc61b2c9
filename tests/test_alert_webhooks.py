"""Alert webhooks: a signed POST per alert and webhook, exactly once, retried with backoff, beside email.

The receivers are real HTTP servers (http.server in a thread) on 127.0.0.1 and the mail server a
real SMTP server; the tasks run eagerly in the thread that committed the alert, as in
test_alerts.py, so a Celery retry runs at once instead of after its countdown.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client
from django.utils import timezone
from kombu.exceptions import OperationalError

from budgets.actions import do_requeue_unsent_alerts, webhook_retry_overdue
from budgets.alerts import check_provider_thresholds
from budgets.models import AlertWebhook, AuditEntry, WebhookDelivery
from budgets.webhooks import DELIVERY_HEADER, MAX_ATTEMPTS, SIGNATURE_HEADER, new_secret, retry_countdown
from project import stack
from tests import test_alerts
from tests.test_alerts import LIMIT, all_at_once, spend, subject

pytestmark = pytest.mark.django_db(transaction=True)

# The email tests' cast: a real SMTP server, eager tasks (autouse), the provider "local" at $100 a month.
smtp, eager_tasks, provider = test_alerts.smtp, test_alerts.eager_tasks, test_alerts.provider


@pytest.fixture(autouse=True)
def loopback_receivers(settings):
    """The receivers listen on 127.0.0.1, which webhooks may call only when private addresses are allowed."""
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    """A webhook endpoint: answers the statuses in `failures` first, then 200; keeps every POST."""

    server: ThreadingHTTPServer
    failures: list[int] = field(default_factory=list)
    posts: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/hook"

    def delivered(self) -> list[Received]:
        return [post for post in self.posts if post.answered == 200]


def start_receiver() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with receiver.lock:
                status = receiver.failures.pop(0) if receiver.failures else 200
                receiver.posts.append(Received(dict(self.headers), body, status))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"ok" if status == 200 else b"receiver is down")

        def log_message(self, *args) -> None:  # quiet: pytest shows what matters
            pass

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


@pytest.fixture
def receivers(settings):
    # They listen on 127.0.0.1, which webhooks may call only when private addresses are allowed.
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    started: list[Receiver] = []

    def make() -> Receiver:
        started.append(start_receiver())
        return started[-1]

    yield make
    for receiver in started:
        receiver.server.shutdown()
        receiver.server.server_close()


def webhook(provider_or_none, url: str, body_format: str = AlertWebhook.BodyFormat.JSON) -> AlertWebhook:
    return AlertWebhook.objects.create(provider=provider_or_none, url=url, secret=new_secret(), body_format=body_format)


def signed_by(hook: AlertWebhook, post: Received) -> bool:
    expected = "sha256=" + hmac.new(hook.secret.encode(), post.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(post.headers[SIGNATURE_HEADER], expected)


def test_fifty_concurrent_crossings_make_one_email_and_one_signed_post_per_webhook(
    smtp, receivers, provider, alice, chat_feature
):
    ops, slack = receivers(), receivers()
    ops_hook = webhook(provider, ops.url)
    slack_hook = webhook(None, slack.url, AlertWebhook.BodyFormat.SLACK)  # every alert, Slack's body
    spend(provider, alice, chat_feature, 79_000_000)

    def settle_one() -> None:
        spend(provider, alice, chat_feature, 100_000)
        check_provider_thresholds(provider.id)

    assert all_at_once(50, settle_one) == []
    assert smtp.subjects() == [subject(50), subject(80)]
    assert len(ops.posts) == 2 and len(slack.posts) == 2  # one POST per alert and webhook, none repeated
    assert all(signed_by(ops_hook, post) for post in ops.posts)
    assert all(signed_by(slack_hook, post) for post in slack.posts)
    assert not signed_by(slack_hook, ops.posts[0])  # each webhook has a secret of its own
    bodies = sorted((json.loads(post.body) for post in ops.posts), key=lambda b: b["threshold_percent"])
    assert [(b["kind"], b["scope"], b["threshold_percent"], b["limit_micro_usd"]) for b in bodies] == [
        ("threshold", "provider:local", 50, LIMIT),
        ("threshold", "provider:local", 80, LIMIT),
    ]
    assert "has spent $" in bodies[1]["text"] and bodies[1]["subject"] == subject(80)
    slack_bodies = [json.loads(post.body) for post in slack.posts]
    assert all(list(body) == ["text"] for body in slack_bodies)
    assert sorted(b["text"].splitlines()[0] for b in slack_bodies) == [f"*{subject(50)}*", f"*{subject(80)}*"]
    deliveries = WebhookDelivery.objects.all()
    assert len(deliveries) == 4 and all(d.status == "sent" and d.attempts == 1 and d.last_status_code == 200 for d in deliveries)


def test_a_receiver_failing_three_times_then_succeeding_gets_it_once(smtp, receivers, provider, alice, chat_feature):
    flaky = receivers()
    flaky.failures = [500, 500, 503]
    hook = webhook(provider, flaky.url)
    spend(provider, alice, chat_feature, 50_000_000)

    [alert_id] = check_provider_thresholds(provider.id)

    assert [post.answered for post in flaky.posts] == [500, 500, 503, 200]
    assert len(flaky.delivered()) == 1 and signed_by(hook, flaky.delivered()[0])
    # The same delivery id on every attempt, so a receiver that did get an earlier one can dedupe.
    assert len({post.headers[DELIVERY_HEADER] for post in flaky.posts}) == 1
    delivery = WebhookDelivery.objects.get(alert_id=alert_id)
    assert (delivery.status, delivery.attempts, delivery.last_status_code, delivery.last_error) == ("sent", 4, 200, "")
    assert smtp.subjects() == [subject(50)]  # the email went while the webhook was failing
    assert [retry_countdown(n) for n in range(MAX_ATTEMPTS - 1)] == [60, 120, 240, 480, 960]


def test_a_refused_connection_is_retried_then_given_up_and_the_other_channels_still_go(
    smtp, receivers, provider, alice, chat_feature, staff
):
    working = receivers()
    webhook(provider, f"http://127.0.0.1:{stack.free_port()}/hook")  # nothing listens there
    webhook(provider, working.url)
    spend(provider, alice, chat_feature, 50_000_000)

    [alert_id] = check_provider_thresholds(provider.id)

    dead = WebhookDelivery.objects.get(alert_id=alert_id, sent_at__isnull=True)
    assert dead.status == "failed" and dead.attempts == MAX_ATTEMPTS and dead.gave_up_at is not None
    assert dead.last_status_code is None and "ConnectError" in dead.last_error
    assert len(working.delivered()) == 1
    assert smtp.subjects() == [subject(50)]
    assert do_requeue_unsent_alerts() == 0  # given up: the sweeper leaves it for staff to see

    # The staff alerts page shows the failing channel: its attempts and its error.
    client = Client()
    client.force_login(staff)
    page = client.get("/staff/alerts/").content.decode()
    failing = page[page.index('id="failing-channels"'):page.index('id="alerts-table"')]
    assert "failed" in failing and "ConnectError" in failing and f">{MAX_ATTEMPTS}<" in failing
    assert "provider:local 50% " in failing


def test_a_delivery_a_dead_worker_left_is_sent_once_by_the_sweeper(smtp, receivers, provider, alice, chat_feature,
                                                                    monkeypatch):
    receiver = receivers()
    hook = webhook(provider, receiver.url)
    # The broker is away when the alert is raised: queueing fails (kombu's own error) and the rows
    # stay unsent. Not "queued with no worker": in the full suite a live stack's worker shares the broker.
    from budgets import tasks

    def broker_away(*args, **kwargs):
        raise OperationalError("Error 111 connecting to the broker. Connection refused.")

    with monkeypatch.context() as patched:
        patched.setattr(tasks.send_alert_email, "delay", broker_away)
        patched.setattr(tasks.send_alert_webhook, "delay", broker_away)
        spend(provider, alice, chat_feature, 50_000_000)
        [alert_id] = check_provider_thresholds(provider.id)
    assert receiver.posts == []
    assert do_requeue_unsent_alerts() == 2  # the email and the webhook, each once
    assert do_requeue_unsent_alerts() == 0
    assert len(receiver.delivered()) == 1 and signed_by(hook, receiver.delivered()[0])
    assert smtp.subjects() == [subject(50)]
    assert WebhookDelivery.objects.get(alert_id=alert_id).status == "sent"


def test_staff_create_a_webhook_see_its_secret_once_and_every_change_is_audited(staff, provider, receivers, smtp, alice, chat_feature):
    receiver = receivers()
    client = Client()
    client.force_login(staff)

    response = client.post("/staff/alerts/", {"provider": provider.pk, "url": receiver.url, "body_format": "slack"}, follow=True)

    hook = AlertWebhook.objects.get()
    assert (hook.provider, hook.url, hook.body_format, hook.enabled) == (provider, receiver.url, "slack", True)
    assert len(hook.secret) >= 40 and hook.secret in response.content.decode()
    assert hook.secret not in client.get("/staff/alerts/").content.decode()  # shown once
    trail = {e.field: (e.action, e.after) for e in AuditEntry.objects.filter(target=f"webhook {hook.pk} (provider local)")}
    assert trail == {
        "provider": ("create", "local"), "url": ("create", receiver.url), "body_format": ("create", "slack"),
        "enabled": ("create", "yes"), "secret": ("create", "(set; shown once)"),
    }

    client.post(f"/staff/alerts/webhooks/{hook.pk}/", {"action": "disable"})
    hook.refresh_from_db()
    assert hook.enabled is False
    assert AuditEntry.objects.filter(action="update", field="enabled", before="yes", after="no").count() == 1
    spend(provider, alice, chat_feature, 50_000_000)
    check_provider_thresholds(provider.id)
    assert receiver.posts == [] and smtp.subjects() == [subject(50)]  # disabled: email only

    client.post(f"/staff/alerts/webhooks/{hook.pk}/", {"action": "delete"})
    assert not AlertWebhook.objects.exists()
    assert AuditEntry.objects.filter(action="delete", field="url", before=receiver.url).count() == 1


def test_a_webhook_url_must_be_http(staff):
    client = Client()
    client.force_login(staff)
    response = client.post("/staff/alerts/", {"url": "ftp://example.com/x", "body_format": "json"})
    assert response.status_code == 200 and "starts with http" in response.content.decode()
    assert not AlertWebhook.objects.exists()


def test_end_users_cannot_see_or_change_webhooks(alice, provider):
    hook = webhook(provider, "http://127.0.0.1:9/hook")
    client = Client()
    client.force_login(alice)
    assert client.get("/staff/alerts/").status_code == 403
    assert client.post(f"/staff/alerts/webhooks/{hook.pk}/", {"action": "delete"}).status_code == 403
    assert AlertWebhook.objects.filter(pk=hook.pk).exists()


def failed_once(receiver: Receiver, provider) -> WebhookDelivery:
    """A delivery whose first POST just failed, as the task's first attempt leaves it (claim released)."""
    from budgets.models import Alert
    from budgets.webhooks import WebhookNotSent, deliver_webhook

    hook = webhook(provider, receiver.url)
    alert = Alert.objects.create(scope="provider:local", threshold=80, period_key="2026-12", spent_micro_usd=80,
                                 limit_micro_usd=100, sent_at=timezone.now())  # its email is not the point here
    delivery = WebhookDelivery.objects.create(alert=alert, webhook=hook)
    with pytest.raises(WebhookNotSent) as failed:
        deliver_webhook(delivery.id)
    assert failed.value.retry_in_s == 60
    delivery.refresh_from_db()
    return delivery


def test_the_sweeper_leaves_a_failed_delivery_to_its_backoff(receivers, provider):
    receiver = receivers()
    receiver.failures = [500]  # the second POST would succeed
    delivery = failed_once(receiver, provider)
    # Every worker sweeps each minute; before, each sweep queued the failed delivery again at once
    # and all six attempts went out within minutes.
    for _ in range(3):
        do_requeue_unsent_alerts()
    assert len(receiver.posts) == 1
    # Its retry (1 minute) is due, but the retry the failed attempt scheduled goes first: the sweeper
    # stands in only for one that was lost, a grace minute later.
    WebhookDelivery.objects.filter(pk=delivery.pk).update(last_attempt_at=timezone.now() - timedelta(seconds=90))
    assert do_requeue_unsent_alerts() == 0 and len(receiver.posts) == 1
    WebhookDelivery.objects.filter(pk=delivery.pk).update(last_attempt_at=timezone.now() - timedelta(seconds=121))
    assert do_requeue_unsent_alerts() == 1
    assert len(receiver.delivered()) == 1 and WebhookDelivery.objects.get(pk=delivery.pk).status == "sent"


def test_a_retry_waits_as_long_as_the_rows_attempts_say_whoever_queued_it(receivers, provider):
    from budgets.webhooks import WebhookNotSent, deliver_webhook

    receiver = receivers()
    receiver.failures = [500] * 10
    delivery = failed_once(receiver, provider)
    # Three attempts made: the sweeper waits 4 minutes (plus its grace), and the task it queues,
    # failing, schedules its own retry 8 minutes on (its Celery retries count from 0).
    WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=3, last_attempt_at=timezone.now() - timedelta(seconds=250))
    assert not WebhookDelivery.objects.filter(pk=delivery.pk).filter(webhook_retry_overdue(timezone.now())).exists()
    with pytest.raises(WebhookNotSent) as failed:
        deliver_webhook(delivery.id)
    assert failed.value.retry_in_s == 480


def standard_webhooks_verify(whsec: str, headers: dict[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """What a Standard Webhooks library does (standardwebhooks.com): the key is the base64 after
    "whsec_"; the timestamp must be near; any "v1," signature listed may match."""
    import base64
    import time

    key = base64.b64decode(whsec.removeprefix("whsec_"))
    msg_id, stamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(stamp)) > tolerance_s:
        return False
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(sig.removeprefix("v1,"), expected) for sig in headers["webhook-signature"].split())


def test_a_delivery_carries_standard_webhooks_headers_that_bind_its_id_and_time(smtp, receivers, provider, alice, chat_feature):
    import base64

    receiver = receivers()
    hook = webhook(provider, receiver.url)
    spend(provider, alice, chat_feature, 50_000_000)
    check_provider_thresholds(provider.id)

    [post] = receiver.delivered()
    headers = {name.lower(): value for name, value in post.headers.items()}
    whsec = "whsec_" + base64.b64encode(hook.secret.encode()).decode()  # as docs/alerts.md tells receivers
    assert headers["webhook-id"] == headers[DELIVERY_HEADER.lower()]
    assert standard_webhooks_verify(whsec, headers, post.body)
    assert signed_by(hook, post)  # the old header, kept for one release
    # Replayed later with a fresh timestamp, or with another delivery's id, the signature fails:
    # before, the signature covered the body alone and a captured POST verified forever.
    later = {**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) + 3600)}
    assert not standard_webhooks_verify(whsec, later, post.body, tolerance_s=10**9)
    assert not standard_webhooks_verify(whsec, {**headers, "webhook-id": "999999"}, post.body)
