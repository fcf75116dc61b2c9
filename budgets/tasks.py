"""Celery tasks of the "default" queue: spend-alert emails."""

from __future__ import annotations

from celery import shared_task

from .alerts import AlertNotSent, deliver_alert

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
