"""Writes that change the ledger or the alert outbox. Each is atomic and safe to replay:
ledger rows are keyed by request_id, alerts by (scope, threshold, period) and claimed once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import Alert, Feature, TokenLog


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


def do_log_refusal(
    *,
    request_id: str,
    user: AbstractBaseUser,
    feature: Feature | None,
    model: str,
    code: str,
    message: str,
    prompt_tokens: int = 0,
    max_tokens: int = 0,
) -> TokenLog:
    """A refused request still leaves a row, so refusals can be counted and explained."""
    now = timezone.now()
    try:
        with transaction.atomic():
            return TokenLog.objects.create(
                request_id=request_id,
                user=user,
                feature=feature,
                model=model,
                status=TokenLog.Status.REFUSED,
                refusal_code=code,
                error=message[:500],
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                created_at=now,
                finished_at=now,
            )
    except IntegrityError:
        return TokenLog.objects.get(request_id=request_id)


def do_record_usage(
    request_id: str,
    *,
    status: str,
    usage: Usage,
    finish_reason: str = "",
    error: str = "",
    ttft_ms: int | None = None,
) -> bool:
    """Settle a running request once, costed at the price in force when it was admitted.

    Returns False when it was already settled (a replay changes nothing).
    """
    now = timezone.now()
    log = TokenLog.objects.filter(request_id=request_id).select_related("price").first()
    if log is None:
        return False
    cost = log.price.cost_micro_usd(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if log.price else 0
    total_ms = max(0, int((now - log.created_at).total_seconds() * 1000))
    updated = TokenLog.objects.filter(request_id=request_id, status=TokenLog.Status.RUNNING).update(
        status=status,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cost_micro_usd=cost,
        finish_reason=finish_reason,
        error=error[:500],
        ttft_ms=ttft_ms,
        total_ms=total_ms,
        finished_at=now,
    )
    return updated == 1


# --- the alert outbox ----------------------------------------------------------------------------


def do_raise_alert(
    *,
    scope: str,
    threshold: int,
    period_key: str,
    spent_micro_usd: int,
    limit_micro_usd: int,
    recipients: str,
) -> Alert | None:
    """Write the outbox row for one crossing and queue its email after commit; None if it existed.

    The unique constraint decides between concurrent crossings: get_or_create inserts in a
    savepoint and, when another transaction won, reads that row instead (created=False).
    """
    with transaction.atomic():
        alert, created = Alert.objects.get_or_create(
            scope=scope,
            threshold=threshold,
            period_key=period_key,
            defaults={"spent_micro_usd": spent_micro_usd, "limit_micro_usd": limit_micro_usd, "recipients": recipients},
        )
        if created:
            # robust: a broker that is away must not fail the caller (the settling of a request);
            # the row stays unsent and visible.
            transaction.on_commit(lambda: _queue_alert_email(alert.id), robust=True)
    return alert if created else None


def _queue_alert_email(alert_id: int) -> None:
    from .tasks import send_alert_email  # tasks imports this module

    send_alert_email.delay(alert_id)


def do_claim_alert(alert_id: int) -> Alert | None:
    """Take an unsent alert for sending; None when it is sent or another worker holds it.

    One conditional UPDATE, never read-then-write: of two workers, exactly one sees count 1.
    """
    claimed = Alert.objects.filter(id=alert_id, claimed_at__isnull=True, sent_at__isnull=True).update(
        claimed_at=timezone.now()
    )
    if claimed != 1:
        return None
    return Alert.objects.get(id=alert_id)


def do_requeue_unsent_alerts(stale_after_s: int = 300) -> int:
    """The outbox sweeper: queue again every alert not sent yet, releasing claims a dead worker left.

    Covers a broker that was away when the alert was raised and a worker that died mid-send.
    """
    now = timezone.now()
    Alert.objects.filter(sent_at__isnull=True, claimed_at__lt=now - timedelta(seconds=stale_after_s)).update(claimed_at=None)
    waiting = list(Alert.objects.filter(sent_at__isnull=True, claimed_at__isnull=True).values_list("id", flat=True))
    for alert_id in waiting:
        _queue_alert_email(alert_id)
    return len(waiting)


def do_mark_alert_sent(alert_id: int, error: str = "") -> bool:
    """Finish a claimed alert: sent (no error), or not sent with the error and the claim released.

    Releasing the claim on failure lets a retry claim and send it; an alert is never stuck half-sent.
    """
    held = Alert.objects.filter(id=alert_id, claimed_at__isnull=False, sent_at__isnull=True)
    if error:
        return held.update(claimed_at=None, error=error[:500]) == 1
    return held.update(sent_at=timezone.now(), error="") == 1
