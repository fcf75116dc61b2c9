"""Spend alerts: a provider's month, measured from the ledger, against its alert thresholds.

    check_provider_thresholds(provider_id)   # after each settled request: new Alert rows (the outbox)
    deliver_alert(alert_id)                  # in the email task: claim, send once, mark

An Alert row is unique per (scope, threshold, period), so however many requests cross 80% at the
same moment, one row is created and one email is sent; the row is written before the email task
is queued, so the email is never lost either (STYLE.md points 6 and 7).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Sum
from django.utils import timezone

from .actions import do_claim_alert, do_mark_alert_sent, do_raise_alert
from .models import Alert, Period, Provider, TokenLog
from .money import format_usd
from .periods import period_bounds, period_key

log = logging.getLogger(__name__)

PROVIDER_SCOPE = "provider:"
NO_RECIPIENTS = "no recipients"


class AlertNotSent(RuntimeError):
    """Sending failed; the error is on the row and the claim released, so a retry can send it."""


# --- raising -------------------------------------------------------------------------------------


def check_provider_thresholds(provider_id: int, at: datetime | None = None) -> list[int]:
    """Raise an Alert for every threshold the provider's spend this month has reached; new ids.

    Thresholds already alerted this month create nothing. A provider without a limit has nothing
    to be alerted about, nor has one with a zero limit (no share of $0 is worth an email).
    """
    at = at or timezone.now()
    provider = Provider.objects.filter(pk=provider_id).first()
    if provider is None or not provider.monthly_limit_micro_usd:
        return []
    limit = provider.monthly_limit_micro_usd
    spent = provider_month_spend(provider.pk, at)
    month = period_key(Period.MONTH, at)
    new_ids = []
    for threshold in crossed_thresholds(provider, spent):
        alert = do_raise_alert(
            scope=provider_scope(provider),
            threshold=threshold,
            period_key=month,
            spent_micro_usd=spent,
            limit_micro_usd=limit,
            recipients=", ".join(provider.recipients()),
        )
        if alert is not None:
            new_ids.append(alert.id)
    return new_ids


def check_provider_thresholds_safely(provider_id: int) -> list[int]:
    """check_provider_thresholds for the settling path: a problem is logged, never raised.

    A request must be settled whatever happens to its alert; the next settle checks again.
    """
    try:
        return check_provider_thresholds(provider_id)
    except Exception:
        log.exception("spend alert check failed for provider %s", provider_id)
        return []


def provider_month_spend(provider_id: int, at: datetime) -> int:
    """Micro-dollars of settled requests in the calendar month of `at`: one aggregate query.

    From the ledger, not the guard's Redis counter: the counter also holds reservations of answers
    still running, and is a cache that may be missing; the ledger is what was really spent.
    """
    start, end = period_bounds(Period.MONTH, at)
    rows = TokenLog.objects.filter(provider_id=provider_id, created_at__gte=start, created_at__lt=end).exclude(
        status__in=[TokenLog.Status.RUNNING, TokenLog.Status.REFUSED]
    )
    return rows.aggregate(spent=Sum("cost_micro_usd"))["spent"] or 0


def crossed_thresholds(provider: Provider, spent_micro_usd: int) -> list[int]:
    """The provider's thresholds (percent) that `spent_micro_usd` has reached, in integer arithmetic."""
    limit = provider.monthly_limit_micro_usd or 0
    return [pct for pct in valid_thresholds(provider) if spent_micro_usd * 100 >= limit * pct]


def valid_thresholds(provider: Provider) -> list[int]:
    """alert_thresholds is free JSON edited by people: keep whole percents from 1 to 1000, once each."""
    raw = provider.alert_thresholds if isinstance(provider.alert_thresholds, list) else []
    valid = {pct for pct in raw if isinstance(pct, int) and not isinstance(pct, bool) and 1 <= pct <= 1000}
    if len(valid) != len(raw):
        log.warning("provider %s: ignoring invalid alert thresholds in %r", provider.name, provider.alert_thresholds)
    return sorted(valid)


def provider_scope(provider: Provider) -> str:
    return f"{PROVIDER_SCOPE}{provider.name}"


# --- delivering ----------------------------------------------------------------------------------


def deliver_alert(alert_id: int) -> bool:
    """Claim the alert and email it once. True when this call sent it.

    False when it was sent already, someone else holds the claim, or there is nobody to tell
    (recorded on the row as "no recipients" and left unclaimed, to be sent once someone is
    configured). Raises AlertNotSent when the mail server failed.
    """
    alert = do_claim_alert(alert_id)
    if alert is None:
        return False
    recipients = alert_recipients(alert)
    if not recipients:
        log.warning("alert %s (%s) has no recipients; not sent", alert.id, alert)
        do_mark_alert_sent(alert.id, error=NO_RECIPIENTS)
        return False
    subject, body = alert_email(alert)
    try:
        send_mail(subject, body, None, recipients, fail_silently=False)
    except Exception as exc:  # whatever broke, the claim must be released or the alert is stuck
        error = f"{type(exc).__name__}: {exc}"
        do_mark_alert_sent(alert.id, error=error)
        raise AlertNotSent(f"alert {alert.id}: {error}") from exc
    do_mark_alert_sent(alert.id)
    return True


def alert_recipients(alert: Alert) -> list[str]:
    """The row's recipients; else the provider's as configured now; else the fallback setting."""
    addresses = _split(alert.recipients)
    if not addresses and alert.scope.startswith(PROVIDER_SCOPE):
        provider = Provider.objects.filter(name=alert.scope.removeprefix(PROVIDER_SCOPE)).first()
        addresses = provider.recipients() if provider else []
    return addresses or list(settings.CEILING_ALERT_FALLBACK_EMAILS)


def alert_email(alert: Alert) -> tuple[str, str]:
    """(subject, body) of the one email for an alert, with the money in dollars."""
    what = describe_scope(alert.scope)
    subject = f"[Ceiling] {what} at {alert.threshold}% of its monthly limit"
    percent = alert.spent_micro_usd * 100 // alert.limit_micro_usd if alert.limit_micro_usd else 0
    crossed_at = timezone.localtime(alert.created_at)
    lines = [
        f"The {what} has spent {format_usd(alert.spent_micro_usd)} of its {format_usd(alert.limit_micro_usd)} "
        f"monthly limit in {alert.period_key} ({percent}%).",
        "",
        f"It crossed the {alert.threshold}% alert threshold on {crossed_at:%Y-%m-%d at %H:%M %Z}.",
    ]
    if alert.threshold >= 100:
        lines.append("New requests to it are refused until the limit resets at the start of next month.")
    lines += [
        "",
        "You get this email once per threshold and month. The limit, thresholds and recipients are",
        "settings of the provider (staff dashboard, or /admin/).",
    ]
    return subject, "\n".join(lines) + "\n"


def describe_scope(scope: str) -> str:
    if scope.startswith(PROVIDER_SCOPE):
        return f"provider {scope.removeprefix(PROVIDER_SCOPE)!r}"
    return scope


def _split(addresses: str) -> list[str]:
    return [address.strip() for address in addresses.split(",") if address.strip()]
