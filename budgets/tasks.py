"""Celery tasks of the "default" queue: spend-alert emails and webhook deliveries, one task per channel."""

from __future__ import annotations

from celery import shared_task

from . import delivery
from .alerts import AlertNotSent, deliver_alert
from .webhooks import MAX_ATTEMPTS, TIMEOUT_S, WebhookNotSent, deliver_webhook

ALERT_EMAIL_RETRIES = 5
ALERT_EMAIL_FIRST_RETRY_S = 60


@shared_task(
    bind=True,
    name="budgets.send_alert_email",
    queue="default",
    ignore_result=True,
    max_retries=ALERT_EMAIL_RETRIES,
    # EMAIL_TIMEOUT bounds each SMTP round trip; these bound the task in pools that enforce them.
    soft_time_limit=50,
    time_limit=60,
    # Idempotent (the outbox claim sends each alert once), so a worker killed mid-task must not lose
    # it: ack only when done, and put it back on the queue if the worker dies.
    acks_late=True,
    reject_on_worker_lost=True,
)
def send_alert_email(self, alert_id: int) -> bool:
    """Email one alert once. A failed send has released its claim, so the retry can take it."""
    try:
        return deliver_alert(alert_id)
    except AlertNotSent as exc:
        # 1, 2, 4, 8, 16 minutes: a mail server down for half an hour still gets the alert out.
        raise self.retry(exc=exc, countdown=ALERT_EMAIL_FIRST_RETRY_S * 2**self.request.retries) from exc


@shared_task(
    bind=True,
    name="budgets.send_alert_webhook",
    queue="default",
    ignore_result=True,
    # The row counts the attempts (a sweep's new task included); this is only Celery's backstop.
    max_retries=MAX_ATTEMPTS - 1,
    soft_time_limit=TIMEOUT_S + 20,
    time_limit=TIMEOUT_S + 30,
    acks_late=True,
    reject_on_worker_lost=True,
)
def send_alert_webhook(self, delivery_id: int) -> bool:
    """POST one alert to one webhook once. Its own task, so a failing receiver delays no other channel."""
    try:
        return deliver_webhook(delivery_id)
    except WebhookNotSent as exc:
        if exc.gave_up:
            return False  # out of attempts: failed on the alerts page, not retried again
        # From the row's attempts, not this task's retries: a task the sweeper queued starts at 0.
        raise self.retry(exc=exc, countdown=exc.retry_in_s) from exc


def queue_alert_email(alert_id: int) -> None:
    send_alert_email.delay(alert_id)


def queue_alert_webhook(delivery_id: int) -> None:
    send_alert_webhook.delay(delivery_id)


# The actions queue an alert's channels through budgets.delivery, which knows these tasks from here
# (each send looks its task up when it runs, as a direct call would).
delivery.register(alert_email=queue_alert_email, alert_webhook=queue_alert_webhook)
