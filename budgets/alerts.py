"""Spend alerts: a provider's or a team's month, measured from the ledger, against its alert thresholds.

    check_provider_thresholds(provider_id)   # after each settled request: new Alert rows (the outbox)
    check_team_thresholds(team_id)           # the same for the team the request was admitted under
    check_spend_forecasts()                  # every minute (reconciliation): projected and spike alerts
    deliver_alert(alert_id)                  # in the email task: claim, send once, mark

An Alert row is unique per (kind, scope, threshold, period), so however many requests cross 80% at the
same moment, one row is created and one email is sent; the row is written before the email task
is queued, so the email is never lost either (STYLE.md points 6 and 7).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Sum
from django.utils import timezone

from . import forecast as forecasting
from .actions import do_claim_alert, do_mark_alert_sent, do_raise_alert
from .guard import counter_store, provider_month_key, team_key
from .models import Alert, Period, Provider, Team, TeamQuota, TokenLog
from .money import format_usd
from .periods import period_bounds, period_key

log = logging.getLogger(__name__)

PROVIDER_SCOPE = "provider:"
TEAM_SCOPE = "team:"
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
    scope, limit = provider_scope(provider), provider.monthly_limit_micro_usd
    if not threshold_may_be_due(provider, scope, limit, provider_month_key(provider.pk, at), at):
        return []
    spent = month_spend({"provider_id": provider.pk}, at)
    return raise_crossed(provider, scope, spent, limit, at)


def check_team_thresholds(team_id: int, at: datetime | None = None) -> list[int]:
    """Raise an Alert for every threshold the team's spend this month has reached, as a percent of
    its monthly cost cap (the all-features one); new ids. No such cap, nothing to alert about.

    The spend is the ledger rows admitted under the team (TokenLog.team), as the guard counts it.
    """
    at = at or timezone.now()
    limit = team_monthly_cap(team_id)  # first: most teams settle requests without one, at one query
    team = Team.objects.filter(pk=team_id).first() if limit else None
    if team is None:
        return []
    counter = team_key(team_id, None, Period.MONTH, period_key(Period.MONTH, at))
    if not threshold_may_be_due(team, team_scope(team), limit, counter, at):
        return []
    spent = month_spend({"team_id": team_id}, at)
    return raise_crossed(team, team_scope(team), spent, limit, at)


def threshold_may_be_due(owner: Provider | Team, scope: str, limit: int, counter_key: str, at: datetime) -> bool:
    """Whether the month's spend may have reached a threshold not yet raised this month: only then
    is the ledger summed (month_spend reads every settled row of the month, ~100 ms at a million
    rows, and this runs after every settled request).

    The guard's counter of the same month holds what was settled plus what running answers have
    reserved: at least the ledger's spend. While it stays under the lowest threshold not yet
    raised, no alert can be due. A counter that is missing or cannot be read says nothing, and the
    ledger decides.
    """
    raised = set(Alert.objects.filter(kind=Alert.Kind.THRESHOLD, scope=scope, period_key=period_key(Period.MONTH, at))
                 .values_list("threshold", flat=True))
    pending = [pct for pct in valid_thresholds(owner) if pct not in raised]
    if not pending:
        return False
    spent_at_most = counter_spend_bound(counter_key)
    return spent_at_most is None or spent_at_most * 100 >= limit * min(pending)


def counter_spend_bound(counter_key: str) -> int | None:
    """Micro-dollars a guard counter holds, settled and reserved; None when it is missing or unreadable."""
    try:
        state = counter_store().state(counter_key)
    except redis.RedisError as exc:
        log.warning("spend alert check: counter %s unreadable (%s); summing the ledger", counter_key, exc)
        return None
    return None if state is None else state.used.cost_micro_usd + state.reserved.cost_micro_usd


def raise_crossed(owner: Provider | Team, scope: str, spent: int, limit: int, at: datetime) -> list[int]:
    """One do_raise_alert per threshold of `owner` that `spent` has reached; the ids that are new."""
    month = period_key(Period.MONTH, at)
    new_ids = []
    for threshold in crossed_thresholds(owner, spent, limit):
        alert = do_raise_alert(
            scope=scope,
            threshold=threshold,
            period_key=month,
            spent_micro_usd=spent,
            limit_micro_usd=limit,
            recipients=", ".join(owner.recipients()),
        )
        if alert is not None:
            new_ids.append(alert.id)
    return new_ids


def team_monthly_cap(team_id: int) -> int | None:
    """The team's monthly cost cap on all features, in micro-dollars; None without one."""
    return (
        TeamQuota.objects.filter(team_id=team_id, feature__isnull=True, period=Period.MONTH)
        .values_list("max_cost_micro_usd", flat=True).first()
    )


def check_provider_thresholds_safely(provider_id: int, at: datetime | None = None) -> list[int]:
    """check_provider_thresholds for the settling path: a problem is logged, never raised.

    A request must be settled whatever happens to its alert; the next settle checks again.
    """
    try:
        return check_provider_thresholds(provider_id, at)
    except Exception:
        log.exception("spend alert check failed for provider %s", provider_id)
        return []


def check_thresholds_after_settle(row: TokenLog) -> list[int]:
    """The settling path's check: the row's provider (when it has a limit) and the team it was
    admitted under. Logs, never raises: a request must be settled whatever happens to its alert.

    Against the month of the row (its admission, where the ledger and the guard count it), not of
    now: a request admitted at 23:59:59 on the month's last day settles in the next month, and
    checked against that month its crossing was never seen.
    """
    new_ids = []
    if row.provider_id is not None and row.provider.monthly_limit_micro_usd is not None:
        new_ids += check_provider_thresholds_safely(row.provider_id, row.created_at)
    if row.team_id is not None:
        try:
            new_ids += check_team_thresholds(row.team_id, row.created_at)
        except Exception:
            log.exception("spend alert check failed for team %s", row.team_id)
    return new_ids


def raise_overshoot_alert(row: TokenLog) -> list[int]:
    """Once per provider and day: a remote billed a request beyond its reservation. Logs, never raises.

    The excess is billed and on the row; the provider's estimate has risen already (the worker
    learns it as it settles), so this says that the ceiling leaked by that much, once.
    """
    if row.provider_id is None or not (row.overshoot_tokens or row.overshoot_micro_usd):
        return []
    try:
        return _raise_overshoot_alert(row)
    except Exception:
        log.exception("overshoot alert failed for %s", row.request_id)
        return []


def _raise_overshoot_alert(row: TokenLog) -> list[int]:
    day = period_key(Period.DAY, timezone.localtime(row.created_at))
    return _raised(kind=Alert.Kind.OVERSHOOT, scope=provider_scope(row.provider), threshold=0, period_key=day,
                   spent_micro_usd=row.cost_micro_usd, limit_micro_usd=row.reserved_cost_micro_usd)


def check_spend_forecasts(at: datetime | None = None) -> list[int]:
    """Raise a projected alert for every cost cap that runs out early at this rate (once per period
    and scope), and a spike alert for every scope whose day is above 3x its median (once a day); new ids.

    Providers without a limit are watched for spikes too: a spike costs money with or without a cap.
    """
    at = at or timezone.now()
    providers = list(Provider.objects.order_by("name"))
    caps = forecasting.all_cost_caps(at)
    # Spikes only: a zero "cap" that never forecasts, so every provider's history is read in the same query.
    watched = caps + [
        forecasting.CostCap(provider_scope(p), Period.MONTH, 0, ("provider_id",), (p.pk,))
        for p in providers if not p.monthly_limit_micro_usd
    ]
    found = forecasting.histories(watched, at)
    new_ids = []
    for cap in caps:
        projection = forecasting.forecast(cap, found[(cap.group, cap.key)], at)
        if projection.worth_an_alert:
            new_ids += _raised(
                kind=Alert.Kind.PROJECTED, scope=cap.scope, threshold=0, period_key=period_key(cap.period, at),
                spent_micro_usd=projection.spent_micro_usd, limit_micro_usd=cap.cap_micro_usd,
                projected_at=projection.exhausted_at, period_end=projection.period_end,
            )
    seen = set()
    for cap in watched:
        if cap.scope in seen:  # a user's day and month caps are one scope: one spike a day
            continue
        seen.add(cap.scope)
        jump = forecasting.spike(found[(cap.group, cap.key)], at)
        if jump is not None:
            new_ids += _raised(
                kind=Alert.Kind.SPIKE, scope=cap.scope, threshold=100 * forecasting.SPIKE_FACTOR,
                period_key=period_key(Period.DAY, at), spent_micro_usd=jump[0], limit_micro_usd=jump[1],
            )
    return new_ids


def _raised(**fields) -> list[int]:
    alert = do_raise_alert(recipients=", ".join(scope_recipients(fields["scope"])), **fields)
    return [alert.id] if alert is not None else []


def scope_recipients(scope: str) -> list[str]:
    """A provider's or team's alert recipients; for other scopes none of their own (the fallback setting applies)."""
    owner = scope_owner(scope)
    return owner.recipients() if owner else []


def month_spend(scope: dict, at: datetime) -> int:
    """Micro-dollars of settled requests of one scope ({"provider_id": 3}, {"team_id": 2}) in the
    calendar month of `at`: one aggregate query.

    From the ledger, not the guard's Redis counter: the counter also holds reservations of answers
    still running, and is a cache that may be missing; the ledger is what was really spent.
    """
    start, end = period_bounds(Period.MONTH, at)
    rows = TokenLog.objects.filter(**scope, created_at__gte=start, created_at__lt=end).exclude(
        status__in=[TokenLog.Status.RUNNING, TokenLog.Status.REFUSED]
    )
    return rows.aggregate(spent=Sum("cost_micro_usd"))["spent"] or 0


def crossed_thresholds(owner: Provider | Team, spent_micro_usd: int, limit: int | None = None) -> list[int]:
    """The owner's thresholds (percent) that `spent_micro_usd` has reached, in integer arithmetic.

    `limit` defaults to a provider's monthly limit; a team's is its monthly cost cap (a TeamQuota).
    """
    if limit is None:
        limit = getattr(owner, "monthly_limit_micro_usd", None) or 0
    return [pct for pct in valid_thresholds(owner) if spent_micro_usd * 100 >= limit * pct]


def valid_thresholds(owner: Provider | Team) -> list[int]:
    """alert_thresholds is free JSON edited by people: keep whole percents from 1 to 1000, once each."""
    raw = owner.alert_thresholds if isinstance(owner.alert_thresholds, list) else []
    valid = {pct for pct in raw if isinstance(pct, int) and not isinstance(pct, bool) and 1 <= pct <= 1000}
    if len(valid) != len(raw):
        log.warning("%s %s: ignoring invalid alert thresholds in %r", owner._meta.model_name, owner.name,
                    owner.alert_thresholds)
    return sorted(valid)


def provider_scope(provider: Provider) -> str:
    return f"{PROVIDER_SCOPE}{provider.name}"


def team_scope(team: Team) -> str:
    return f"{TEAM_SCOPE}{team.name}"


def scope_owner(scope: str) -> Provider | Team | None:
    """The provider or team an alert scope belongs to ("team:Support/feature:chat" is the team's); else None."""
    head = scope.split("/", 1)[0]
    if head.startswith(PROVIDER_SCOPE):
        return Provider.objects.filter(name=head.removeprefix(PROVIDER_SCOPE)).first()
    if head.startswith(TEAM_SCOPE):
        return Team.objects.filter(name=head.removeprefix(TEAM_SCOPE)).first()
    return None


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
    """The row's recipients; else the provider's or team's as configured now; else the fallback setting."""
    addresses = _split(alert.recipients) or scope_recipients(alert.scope)
    return addresses or list(settings.CEILING_ALERT_FALLBACK_EMAILS)


def alert_email(alert: Alert) -> tuple[str, str]:
    """(subject, body) of an alert, with the money in dollars: the email, and the webhooks' text."""
    if alert.kind == Alert.Kind.PROJECTED:
        return projected_text(alert)
    if alert.kind == Alert.Kind.SPIKE:
        return spike_text(alert)
    if alert.kind == Alert.Kind.OVERSHOOT:
        return overshoot_text(alert)
    return threshold_text(alert)


def threshold_text(alert: Alert) -> tuple[str, str]:
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
    owner = "team (staff dashboard, Teams)" if alert.scope.startswith(TEAM_SCOPE) else "provider (staff dashboard, or /admin/)"
    lines += [
        "",
        "You get this email once per threshold and month. The limit, thresholds and recipients are",
        f"settings of the {owner}.",
    ]
    return subject, "\n".join(lines) + "\n"


def projected_text(alert: Alert) -> tuple[str, str]:
    """'At this rate the provider 'local''s monthly budget runs out on 18 Dec, 13 days early.'"""
    what = describe_scope(alert.scope)
    budget = "daily budget" if len(alert.period_key) > 7 else "monthly budget"
    runs_out = timezone.localtime(alert.projected_at)
    when = f"at {runs_out:%H:%M}" if budget == "daily budget" else f"on {runs_out.day} {runs_out:%b}"
    early = describe_early(alert.period_end - alert.projected_at) if alert.period_end and alert.projected_at else ""
    subject = f"[Ceiling] {what}: {budget} projected to run out {when}"
    lines = [
        f"At this rate the {what}'s {budget} runs out {when}, {early}.",
        "",
        f"It has spent {format_usd(alert.spent_micro_usd)} of {format_usd(alert.limit_micro_usd)} in {alert.period_key}; "
        "the projection follows the last 7 days' daily spend (by weekday, once there are 3 weeks of history).",
        "",
        "You get this once per period for each budget.",
    ]
    return subject, "\n".join(lines) + "\n"


def spike_text(alert: Alert) -> tuple[str, str]:
    what = describe_scope(alert.scope)
    times = alert.spent_micro_usd / alert.limit_micro_usd if alert.limit_micro_usd else 0
    subject = f"[Ceiling] spend spike: {what} on {alert.period_key}"
    lines = [
        f"The {what} has spent {format_usd(alert.spent_micro_usd)} on {alert.period_key}, {times:.1f}× the median "
        f"day of the 7 before it ({format_usd(alert.limit_micro_usd)}).",
        "",
        "You get this once per day at most.",
    ]
    return subject, "\n".join(lines) + "\n"


def overshoot_text(alert: Alert) -> tuple[str, str]:
    what = describe_scope(alert.scope)
    subject = f"[Ceiling] {what} billed beyond a reservation on {alert.period_key}"
    excess = max(0, alert.spent_micro_usd - alert.limit_micro_usd)
    lines = [
        f"The {what} billed a request {format_usd(alert.spent_micro_usd)}, {format_usd(excess)} more than the "
        f"{format_usd(alert.limit_micro_usd)} reserved for it before it was sent.",
        "",
        "Its prompt counted more tokens than Ceiling's estimate (its tokenizer or chat template adds more than",
        "the shipped tokenizer counts). The estimate for this provider and model has been raised to cover it, so the",
        "requests after it are reserved in full. The excess is on the token log (overshoot) and in /metrics.",
        "",
        "You get this once per provider and day at most.",
    ]
    return subject, "\n".join(lines) + "\n"


def describe_early(ahead: timedelta) -> str:
    """'13 days early', '1 day early', '5 h early' — how long before the reset a budget runs out."""
    days = ahead.days
    if days >= 1:
        return f"{days} day{'s' if days != 1 else ''} early"
    return f"{max(1, int(ahead.total_seconds() // 3600))} h early"


def describe_scope(scope: str) -> str:
    """'provider 'local'', 'user 'alice'', 'user 'alice' on the feature 'chat'' from Alert.scope."""
    parts = []
    for part in scope.split("/"):
        kind, _, name = part.partition(":")
        if kind == "feature" and parts:
            parts.append(f"on the feature {name!r}")
        elif kind in ("provider", "user", "feature", "team", "tag") and name:
            parts.append(f"{kind} {name!r}")
        else:
            parts.append(part)
    return " ".join(parts)


def _split(addresses: str) -> list[str]:
    return [address.strip() for address in addresses.split(",") if address.strip()]
