"""Writes that change the ledger or the alert outbox. Each is atomic and safe to replay:
ledger rows are keyed by request_id, alerts by (scope, threshold, period) and claimed once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from accounts.actions import create_successor
from accounts.models import ApiKey

from . import delivery, ledger_sql, refcache
from .live import publish_on_commit
from .models import (
    Alert,
    AlertWebhook,
    AuditEntry,
    Feature,
    InFlightCap,
    ModelPrice,
    Provider,
    Quota,
    RetrievalFacts,
    TagQuota,
    Team,
    TeamMembership,
    TeamQuota,
    TokenLog,
    WebhookDelivery,
    memberships_of,
    team_names_of,
    unique_row,
)
from .money import exact_usd
from .selfhosted import LocalCost


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
    retrieval: RetrievalFacts | None = None,
) -> TokenLog:
    """A refused request still leaves a row, so refusals can be counted and explained."""
    now = timezone.now()
    try:
        with transaction.atomic():
            row = TokenLog.objects.create(
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
                **(retrieval.ledger_fields() if retrieval else {}),
            )
    except IntegrityError:
        return TokenLog.objects.get(request_id=request_id)
    publish_on_commit(request_id)
    return row


def do_log_cache_hit(
    *,
    request_id: str,
    user: AbstractBaseUser,
    feature: Feature,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    max_tokens: int,
    kind: str,
    saved_micro_usd: int,
    retrieval: RetrievalFacts | None = None,
) -> TokenLog:
    """An answer served from a cache: no model call, cost 0, and what the original answer cost."""
    now = timezone.now()
    row = TokenLog.objects.create(
        request_id=request_id, user=user, feature=feature, model=model, status=TokenLog.Status.OK,
        finish_reason="stop", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        max_tokens=max_tokens, cost_micro_usd=0, cache=kind, saved_micro_usd=saved_micro_usd,
        ttft_ms=0, total_ms=0, created_at=now, finished_at=now, counters_settled=True,
        **(retrieval.ledger_fields() if retrieval else {}),
    )
    publish_on_commit(request_id)
    return row


def do_record_usage(
    request_id: str,
    *,
    status: str,
    usage: Usage,
    finish_reason: str = "",
    error: str = "",
    ttft_ms: int | None = None,
    admitted: TokenLog | None = None,
) -> TokenLog | None:
    """Settle a running request once, costed at the price in force when it was admitted.

    Returns the settled row as it now is, or None when it was already settled (a replay changes
    nothing). The dashboard event and the caller's settle use the returned row as it is.
    `admitted`: the row as the caller holds it since its admission (the worker reads it when it
    starts): its price and start are all this needs to read, and nothing writes a running row
    between its admission and its finish, so that row with the usage written over it is the row
    now (one UPDATE). Without it, the price and start are read first, and an UPDATE … RETURNING
    reads the row back.
    """
    now = timezone.now()
    if admitted is not None and admitted.request_id != request_id:
        admitted = None
    if admitted is not None:
        price_id, created_at = admitted.price_id, admitted.created_at
        reserved = (admitted.admitted, admitted.reserved_tokens, admitted.reserved_cost_micro_usd)
    else:
        found = ledger_sql.select(
            ("status", "price_id", "created_at", "admitted", "reserved_tokens", "reserved_cost_micro_usd"), "request_id", request_id
        )
        if found is None or found[0] != TokenLog.Status.RUNNING:
            return None
        _, price_id, created_at, *reserved = found
    price = price_by_id(price_id) if price_id is not None else None
    cost = price.cost_micro_usd(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if price else 0
    overshoot_tokens, overshoot_cost = overshoot(usage, cost, *reserved)
    total_ms = max(0, int((now - created_at).total_seconds() * 1000))
    values = {
        "status": status,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "cost_micro_usd": cost,
        "overshoot_tokens": overshoot_tokens,
        "overshoot_micro_usd": overshoot_cost,
        "finish_reason": finish_reason,
        "error": error[:500],
        "ttft_ms": ttft_ms,
        "total_ms": total_ms,
        "finished_at": now,
    }
    where = {"request_id": request_id, "status": TokenLog.Status.RUNNING}
    if admitted is not None:  # reading ~40 columns back was ~10% of a cycle's CPU (bench_guard)
        row = ledger_sql.updated_copy(admitted, values) if ledger_sql.update(values, where) else None
    else:
        row = ledger_sql.update_returning(values, where)
    if row is not None:
        publish_on_commit(request_id, row)
    return row


def overshoot(usage: Usage, cost_micro_usd: int, admitted: bool, reserved_tokens: int, reserved_cost: int) -> tuple[int, int]:
    """(tokens, micro-dollars) billed beyond what the guard reserved for an admitted request.

    The bill stands (the money is spent); the excess is what the ceiling could not hold back, and
    only a remote whose tokenizer or template counts more than its estimate can produce it.
    """
    if not admitted:
        return 0, 0
    used_tokens = usage.prompt_tokens + usage.completion_tokens
    return max(0, used_tokens - reserved_tokens), max(0, cost_micro_usd - reserved_cost)


def price_by_id(price_id: int) -> ModelPrice:
    """A price row from this process's reference cache (a price is written a few times a year)."""
    return refcache.cache.get("price_by_id", ("modelprice",), price_id, lambda: ModelPrice.objects.get(pk=price_id))


# --- the alert outbox ----------------------------------------------------------------------------


def do_raise_alert(
    *,
    scope: str,
    threshold: int,
    period_key: str,
    spent_micro_usd: int,
    limit_micro_usd: int,
    recipients: str,
    kind: str = Alert.Kind.THRESHOLD,
    projected_at: datetime | None = None,
    period_end: datetime | None = None,
) -> Alert | None:
    """Write the outbox row for one alert, a delivery row per webhook that receives it, and queue
    every channel after commit; None if the alert existed.

    The unique constraint decides between concurrent crossings: get_or_create inserts in a
    savepoint and, when another transaction won, reads that row instead (created=False). The
    deliveries are written in the same transaction, so no channel of an alert is ever lost.
    """
    with transaction.atomic():
        alert, created = Alert.objects.get_or_create(
            kind=kind,
            scope=scope,
            threshold=threshold,
            period_key=period_key,
            defaults={
                "spent_micro_usd": spent_micro_usd, "limit_micro_usd": limit_micro_usd, "recipients": recipients,
                "projected_at": projected_at, "period_end": period_end,
            },
        )
        if not created:
            return None
        webhooks = [hook for hook in AlertWebhook.objects.filter(enabled=True).select_related("provider", "team") if hook.receives(scope)]
        deliveries = WebhookDelivery.objects.bulk_create([WebhookDelivery(alert=alert, webhook=hook) for hook in webhooks])
        # robust: a broker that is away must not fail the caller (the settling of a request), and
        # one channel's task failing to queue must not keep the next from queueing; the rows stay
        # unsent and visible, and the sweeper queues them again.
        transaction.on_commit(lambda: delivery.queue_alert_email(alert.id), robust=True)
        for row in deliveries:
            transaction.on_commit(lambda delivery_id=row.id: delivery.queue_webhook(delivery_id), robust=True)
    return alert


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


# A webhook delivery's schedule (budgets/webhooks.py re-exports it): the first POST and five retries,
# 1, 2, 4, 8, 16 minutes apart.
WEBHOOK_MAX_ATTEMPTS = 6
WEBHOOK_FIRST_RETRY_S = 60
# The sweeper takes a failed delivery only this long after its retry was due: the retry the failed
# attempt scheduled (a Celery countdown) goes first, and the sweeper only stands in for one that was lost.
WEBHOOK_SWEEP_GRACE_S = 60


def webhook_retry_countdown(retries_so_far: int) -> int:
    """Seconds before the next attempt: doubling from a minute, so an hour-long outage is bridged."""
    return WEBHOOK_FIRST_RETRY_S * 2**retries_so_far


def webhook_retry_overdue(now: datetime) -> models.Q:
    """Deliveries whose next attempt is overdue by the grace: never tried, or failed `attempts` times
    and last tried more than the backoff after that many attempts (plus the grace) ago."""
    overdue = models.Q(attempts=0) | models.Q(last_attempt_at__isnull=True)
    for attempts in range(1, WEBHOOK_MAX_ATTEMPTS):
        wait = timedelta(seconds=webhook_retry_countdown(attempts - 1) + WEBHOOK_SWEEP_GRACE_S)
        overdue |= models.Q(attempts=attempts, last_attempt_at__lte=now - wait)
    return overdue


def do_requeue_unsent_alerts(stale_after_s: int = 300) -> int:
    """The outbox sweeper: queue again every channel not sent yet, releasing claims a dead worker left.

    Covers a broker that was away when the alert was raised and a worker that died mid-send. A
    webhook whose attempts ran out is not queued again: it stays failed, on the alerts page. A
    webhook that failed is queued only once its backoff has passed (webhook_retry_overdue): every
    worker sweeps each minute, and re-queueing a failed delivery at once spent all six attempts
    within minutes.
    """
    now = timezone.now()
    stale = now - timedelta(seconds=stale_after_s)
    Alert.objects.filter(sent_at__isnull=True, claimed_at__lt=stale).update(claimed_at=None)
    WebhookDelivery.objects.filter(sent_at__isnull=True, claimed_at__lt=stale).update(claimed_at=None)
    waiting = list(Alert.objects.filter(sent_at__isnull=True, claimed_at__isnull=True).values_list("id", flat=True))
    for alert_id in waiting:
        delivery.queue_alert_email(alert_id)
    hooks = list(
        WebhookDelivery.objects.filter(sent_at__isnull=True, gave_up_at__isnull=True, claimed_at__isnull=True)
        .filter(webhook_retry_overdue(now))
        .values_list("id", flat=True)
    )
    for delivery_id in hooks:
        delivery.queue_webhook(delivery_id)
    return len(waiting) + len(hooks)


def do_mark_alert_sent(alert_id: int, error: str = "") -> bool:
    """Finish a claimed alert: sent (no error), or not sent with the error and the claim released.

    Releasing the claim on failure lets a retry claim and send it; an alert is never stuck half-sent.
    """
    held = Alert.objects.filter(id=alert_id, claimed_at__isnull=False, sent_at__isnull=True)
    if error:
        return held.update(claimed_at=None, error=error[:500]) == 1
    return held.update(sent_at=timezone.now(), error="") == 1


# --- webhook deliveries: the same claim, one row per alert and webhook -----------------------------


def do_claim_delivery(delivery_id: int) -> WebhookDelivery | None:
    """Take an unsent delivery for one attempt, counting it; None when it is sent, given up or held."""
    now = timezone.now()
    claimed = WebhookDelivery.objects.filter(
        id=delivery_id, claimed_at__isnull=True, sent_at__isnull=True, gave_up_at__isnull=True
    ).update(claimed_at=now, last_attempt_at=now, attempts=models.F("attempts") + 1)
    if claimed != 1:
        return None
    return WebhookDelivery.objects.select_related("alert", "webhook__provider").get(id=delivery_id)


def do_finish_delivery(delivery_id: int, *, status_code: int | None, error: str = "", give_up: bool = False) -> bool:
    """Record one attempt: sent (no error), or the error with the claim released (or, out of
    attempts, given up so the sweeper leaves it alone and staff see it failed)."""
    held = WebhookDelivery.objects.filter(id=delivery_id, claimed_at__isnull=False, sent_at__isnull=True)
    if not error:
        return held.update(sent_at=timezone.now(), last_status_code=status_code, last_error="") == 1
    failed = {"claimed_at": None, "last_status_code": status_code, "last_error": error[:500]}
    if give_up:
        failed["gave_up_at"] = timezone.now()
    return held.update(**failed) == 1


# --- configuration changes and their audit trail ----------------------------------------------------

QUOTA_FIELDS = ("max_requests", "max_tokens", "max_cost_micro_usd")
_ABSENT = object()  # a user scope without a row of its own: the default applies
NOT_CAPS = {"hourly_cost_micro_usd"}
SECRET_FIELDS = {"api_key_encrypted"}  # money that is not a limit: empty reads "none", not "no cap"


def audit_text(field: str, value: object) -> str:
    """How a value reads in the audit trail: exact dollars for money, "no cap" for an empty limit."""
    if value is _ABSENT:
        return "default"
    if field in SECRET_FIELDS:  # the trail says a key changed, never what it is (not even encrypted)
        return "set" if value else "not set"
    if field == "expires_at" and value is None:
        return "never"
    if value is None:
        is_cap = field.startswith("max_") or (field.endswith("_micro_usd") and field not in NOT_CAPS)
        return "no cap" if is_cap else "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if field.endswith("_micro_usd") and isinstance(value, int):
        return exact_usd(value)
    if isinstance(value, datetime):
        return timezone.localtime(value).isoformat(timespec="seconds")
    if field == "allowed_features" and not value:
        return "all features"
    if field == "backup_providers" and isinstance(value, list):
        return backup_names(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def backup_names(ids: list) -> str:
    """A feature's backup providers as the trail reads them: names in order ("none" for an empty list)."""
    if not ids:
        return "none"
    names = dict(Provider.objects.filter(pk__in=[pk for pk in ids if isinstance(pk, int)]).values_list("pk", "name"))
    return ", ".join(names.get(pk, f"provider {pk}") for pk in ids)


def audit_field(field: str) -> str:
    # The values are shown in dollars, so the unit suffix of the column would mislead.
    return field.removesuffix("_micro_usd")


def snapshot(instance: models.Model, fields: Iterable[str]) -> dict[str, object]:
    """The values to compare against after a form has changed the instance (take it before binding)."""
    return {name: getattr(instance, name) for name in fields}


def do_save_with_audit(
    actor: AbstractBaseUser | None,
    instance: models.Model,
    fields: Sequence[str],
    before: dict[str, object] | None,
    *,
    target: str,
) -> list[AuditEntry]:
    """Save `instance` and write one AuditEntry per changed field, in one transaction.

    `before` is snapshot() taken before a form touched the instance; None means a new row, whose
    every field is recorded. Only the fields that differ from `before` (what this person changed)
    are saved, so a concurrent edit of other fields is not overwritten; the trail's "before" is
    read from the locked row, so it says what this save really replaced. No change, no write.
    """
    if before is None:
        with transaction.atomic():
            instance.save()
            return _record(actor, "create", target, {name: ("", audit_text(name, getattr(instance, name))) for name in fields})
    touched = [name for name in fields if getattr(instance, name) != before[name]]
    if not touched:
        return []
    with transaction.atomic():
        current = snapshot(type(instance)._default_manager.select_for_update().get(pk=instance.pk), touched)
        changed = [name for name in touched if getattr(instance, name) != current[name]]
        if not changed:
            return []
        instance.save(update_fields=changed)
        changes = {name: (audit_text(name, current[name]), audit_text(name, getattr(instance, name))) for name in changed}
        return _record(actor, "update", target, changes)


def _record(actor: AbstractBaseUser | None, action: str, target: str, changes: dict[str, tuple[str, str]]) -> list[AuditEntry]:
    """One AuditEntry per field: {field: (before, after)} as people read them."""
    entries = [
        AuditEntry(actor=actor, action=action, target=target, field=audit_field(name), before=before, after=after)
        for name, (before, after) in changes.items()
    ]
    return AuditEntry.objects.bulk_create(entries)


def quota_target(user: AbstractBaseUser | None, feature: Feature | None, period: str) -> str:
    return f"quota {user.get_username() if user else 'default'}/{feature.name if feature else 'all'}/{period}"


def do_set_quota(
    actor: AbstractBaseUser | None,
    *,
    user: AbstractBaseUser | None,
    feature: Feature | None,
    period: str,
    caps: dict[str, int | None] | None,
) -> list[AuditEntry]:
    """Give one scope (user or default, feature or all, period) its caps and record each changed cap.

    caps None removes the scope's row: a user then follows the default again. A default row with
    no cap at all means the same as no row, so it is removed too. A user's row replaces the
    default for its period as a whole, which is why a missing user row reads "default" in the trail.
    """
    # For everyone, no row means no cap; for a user it means "whatever the default says".
    absent = _ABSENT if user is not None else None
    if user is None and caps is not None and all(value is None for value in caps.values()):
        caps = None
    with transaction.atomic():
        return _replace_caps_row(
            actor, Quota.objects.filter(user=user, feature=feature, period=period),
            lambda **row: Quota.objects.create(user=user, feature=feature, period=period, **row),
            caps, absent, quota_target(user, feature, period),
        )


def _replace_caps_row(actor, rows, create, caps: dict[str, int | None] | None, absent, target: str,
                      fields: Sequence[str] = QUOTA_FIELDS) -> list[AuditEntry]:
    """One scope's caps row (a user's, a team's, a tag's, an in-flight cap): replaced by `caps`,
    deleted by None, and each field that changed audited. Call inside a transaction: the row is
    locked so that `before` is what this change really replaced. `absent` is how a missing row reads
    in the trail."""
    quota = rows.select_for_update().first()
    before = {name: getattr(quota, name) if quota else absent for name in fields}
    after = {name: caps[name] if caps is not None else absent for name in fields}
    changed = [name for name in fields if before[name] != after[name]]
    if caps is None:
        action = "delete"
        if quota is not None:
            quota.delete()
    elif quota is None:
        action = "create"
        create(**caps)
    else:
        action = "update"
        for name in changed:
            setattr(quota, name, caps[name])
        if changed:
            quota.save(update_fields=changed)
    changes = {name: (audit_text(name, before[name]), audit_text(name, after[name])) for name in changed}
    return _record(actor, action, target, changes)


# --- teams, API keys and tags: the scopes beyond one user ------------------------------------------


def team_quota_target(team: Team, feature: Feature | None, period: str) -> str:
    return f"team quota {team.name}/{feature.name if feature else 'all'}/{period}"


def do_create_team(actor: AbstractBaseUser | None, name: str, members: Iterable[AbstractBaseUser] = ()) -> tuple[Team, list[AuditEntry]]:
    """A new team, with its first members (who stay in any other team they are in), audited."""
    with transaction.atomic():
        team = Team.objects.create(name=name)
        entries = _record(actor, "create", f"team {team.name}", {"name": ("", team.name)})
        for user in members:
            entries += do_join_team(actor, user, team)
        return team, entries


TEAM_ALERT_FIELDS = ("alert_thresholds", "alert_recipients")


def do_set_team_alerts(
    actor: AbstractBaseUser | None, team: Team, *, thresholds: list[int], recipients: str
) -> list[AuditEntry]:
    """A team's alert thresholds (percents of its monthly cost cap) and email recipients, audited."""
    before = snapshot(team, TEAM_ALERT_FIELDS)
    team.alert_thresholds, team.alert_recipients = thresholds, recipients
    return do_save_with_audit(actor, team, TEAM_ALERT_FIELDS, before, target=f"team {team.name}")


def do_delete_team(actor: AbstractBaseUser | None, team: Team) -> list[AuditEntry]:
    """Remove a team: its members are released (each audited, in no team afterwards), its caps and
    webhooks go with it, its ledger rows stay (their team becomes empty) and the trail keeps its name.

    Its Redis counters are left to expire with their period: no admission reads them once nobody
    is in the team.
    """
    with transaction.atomic():
        team = Team.objects.select_for_update().get(pk=team.pk)
        entries = []
        for membership in TeamMembership.objects.filter(team=team).select_related("user").order_by("user_id"):
            entries += do_leave_team(actor, membership.user, team)
        caps = TeamQuota.objects.filter(team=team).count()
        hooks = team.webhooks.count()
        entries += _record(actor, "delete", f"team {team.name}", {
            "name": (team.name, ""), "caps": (str(caps), ""), "webhooks": (str(hooks), ""),
        })
        team.delete()
        return entries


def do_join_team(actor: AbstractBaseUser | None, user: AbstractBaseUser, team: Team) -> list[AuditEntry]:
    """Add a user to a team (they stay in their other teams); audited, nothing when already in it."""
    with transaction.atomic():
        before = _locked_team_names(user)
        if team.name in before:
            return []
        TeamMembership.objects.create(user=user, team=team)
        return _record_teams(actor, user, before)


def do_leave_team(actor: AbstractBaseUser | None, user: AbstractBaseUser, team: Team) -> list[AuditEntry]:
    """Take a user out of one team; audited, nothing when they were not in it.

    The ledger rows already written keep the team they were admitted under, so the team's counters
    and a rebuild from the ledger agree whenever someone leaves.
    """
    with transaction.atomic():
        before = _locked_team_names(user)
        if not TeamMembership.objects.filter(user=user, team=team).delete()[0]:
            return []
        return _record_teams(actor, user, before)


def do_set_team(actor: AbstractBaseUser | None, user: AbstractBaseUser, team: Team | None) -> list[AuditEntry]:
    """Make `team` the user's only team (out of every other), or take them out of every team (None)."""
    with transaction.atomic():
        before = _locked_team_names(user)
        if before == ([team.name] if team else []):
            return []
        TeamMembership.objects.filter(user=user).exclude(team=team).delete()
        if team is not None and team.name not in before:
            TeamMembership.objects.create(user=user, team=team)
        return _record_teams(actor, user, before)


def _locked_team_names(user: AbstractBaseUser) -> list[str]:
    """The user's teams, first joined first, with their membership rows locked (on PostgreSQL) so
    that two changes at once each audit what the other left."""
    rows = memberships_of(user.pk).select_for_update()
    return [m.team.name for m in rows.select_related("team")]


def _record_teams(actor: AbstractBaseUser | None, user: AbstractBaseUser, before: list[str]) -> list[AuditEntry]:
    after = team_names_of(user.pk)
    change = {"team": (", ".join(before) or "none", ", ".join(after) or "none")}
    return _record(actor, "update", f"user {user.get_username()}", change)


def do_set_team_quota(
    actor: AbstractBaseUser | None, *, team: Team, feature: Feature | None, period: str,
    caps: dict[str, int | None] | None,
) -> list[AuditEntry]:
    """A team's caps for one scope (all features or one, a period); None or no cap at all removes the row."""
    if caps is not None and all(value is None for value in caps.values()):
        caps = None
    with transaction.atomic():
        return _replace_caps_row(
            actor, TeamQuota.objects.filter(team=team, feature=feature, period=period),
            lambda **row: TeamQuota.objects.create(team=team, feature=feature, period=period, **row),
            caps, None, team_quota_target(team, feature, period),
        )


def do_set_key_caps(actor: AbstractBaseUser | None, key, caps: dict[str, int | None]) -> list[AuditEntry]:
    """An API key's own caps (KEY_CAP_FIELDS) and scope (allowed_features); a field left out is kept. Audited.

    Who may raise what is the caller's rule (the owner may only lower, staff may do anything); the
    guard applies whatever is saved at the key's next admission.
    """
    before = snapshot(key, caps)
    for name, value in caps.items():
        setattr(key, name, value)
    return do_save_with_audit(actor, key, list(caps), before, target=api_key_target(key))


MAX_GRACE_HOURS = 720  # a rotated key's old text works at most 30 days more


class KeyNotRotatable(Exception):
    """The key cannot be rotated (revoked, expired, already rotated); the message says which."""


def api_key_target(key: ApiKey) -> str:
    return f"api key {key.pk} ({key.user.get_username()}/{key.name})"


def do_rotate_api_key(actor: AbstractBaseUser | None, key_id: int, grace: timedelta) -> tuple[ApiKey, str]:
    """Replace a working key with a new one (same name, caps and features): (the new row, its plaintext).

    The old key keeps working for `grace` (never longer than it would have), so the programs that use
    it can move over. Both changes are audited in the same transaction; the old row is locked (on PostgreSQL), so
    two rotations at once make one successor, not two.
    """
    now = timezone.now()
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().select_related("user").filter(pk=key_id).first()
        if key is None:
            raise KeyNotRotatable(f"There is no API key with id {key_id}.")
        _check_rotatable(key, now)
        new, plaintext = create_successor(key, now)
        before = key.expires_at
        key.expires_at = min(before, now + grace) if before is not None else now + grace
        key.save(update_fields=["expires_at"])
        _record(actor, "create", api_key_target(new), {"rotated_from": ("", f"api key {key.pk} ({key.prefix}…)")})
        _record(actor, "update", api_key_target(key),
                {"expires_at": (audit_text("expires_at", before), audit_text("expires_at", key.expires_at))})
    return new, plaintext


def _check_rotatable(key: ApiKey, now: datetime) -> None:
    if key.revoked_at is not None:
        raise KeyNotRotatable(f"The API key {key.name!r} ({key.prefix}…) is revoked; create a new key instead.")
    if key.is_expired(now):
        raise KeyNotRotatable(f"The API key {key.name!r} ({key.prefix}…) has expired; create a new key instead.")
    if not key.user.is_active:
        raise KeyNotRotatable(f"The user {key.user.get_username()!r} is deactivated; a key for them would not work.")
    if key.successors.exists():
        raise KeyNotRotatable(f"The API key {key.name!r} ({key.prefix}…) was rotated already; rotate its successor.")


def do_set_tag_quota(actor: AbstractBaseUser | None, tag: str, max_cost_micro_usd: int | None) -> list[AuditEntry]:
    """A tag's monthly spend cap; None removes it."""
    caps = {"max_cost_micro_usd": max_cost_micro_usd} if max_cost_micro_usd is not None else None
    with transaction.atomic():
        return _replace_caps_row(
            actor, TagQuota.objects.filter(tag=tag), lambda **row: TagQuota.objects.create(tag=tag, **row),
            caps, None, f"tag quota {tag}/month", fields=("max_cost_micro_usd",),
        )


def in_flight_target(user: AbstractBaseUser | None) -> str:
    return f"in-flight cap {user.get_username() if user else 'default'}"


def do_set_in_flight_cap(actor: AbstractBaseUser | None, user: AbstractBaseUser | None,
                         max_in_flight: int | None) -> list[AuditEntry]:
    """How many requests a user (None: everyone without their own) may have in flight at once; None
    removes the row (a user then follows the default again). Audited like every cap."""
    caps = {"max_in_flight": max_in_flight} if max_in_flight is not None else None
    # A user without a row follows the default: the trail says "default", not "no cap".
    absent = _ABSENT if user is not None else None
    with transaction.atomic():
        return _replace_caps_row(
            actor, InFlightCap.objects.filter(user=user), lambda **row: InFlightCap.objects.create(user=user, **row),
            caps, absent, in_flight_target(user), fields=("max_in_flight",),
        )


# --- alert webhooks ------------------------------------------------------------------------------

WEBHOOK_FIELDS = ("provider", "url", "body_format", "enabled")  # a team's webhook: "team" for "provider"
SECRET_SHOWN = "(set; shown once)"  # the trail says a secret exists, never what it is


def webhook_target(hook: AlertWebhook) -> str:
    return f"webhook {hook.pk} ({hook.scope_text})"


def _webhook_text(field: str, value: object) -> str:
    return "every alert" if field == "provider" and value is None else audit_text(field, value)


def do_create_webhook(
    actor: AbstractBaseUser | None, *, provider=None, team: Team | None = None, url: str, body_format: str, secret: str
) -> tuple[AlertWebhook, list[AuditEntry]]:
    """A new enabled webhook (a provider's, a team's, or every alert's), and its creation in the audit
    trail (the secret only as "set")."""
    with transaction.atomic():
        hook = AlertWebhook.objects.create(provider=provider, team=team, url=url, body_format=body_format, secret=secret)
        fields = ("team", *WEBHOOK_FIELDS[1:]) if team is not None else WEBHOOK_FIELDS
        changes = {name: ("", _webhook_text(name, getattr(hook, name))) for name in fields}
        changes["secret"] = ("", SECRET_SHOWN)
        return hook, _record(actor, "create", webhook_target(hook), changes)


def do_set_webhook_enabled(actor: AbstractBaseUser | None, hook: AlertWebhook, enabled: bool) -> list[AuditEntry]:
    """Switch a webhook on or off; alerts raised while it is off are not sent to it, then or later."""
    before = snapshot(hook, ["enabled"])
    hook.enabled = enabled
    return do_save_with_audit(actor, hook, ["enabled"], before, target=webhook_target(hook))


def do_delete_webhook(actor: AbstractBaseUser | None, hook: AlertWebhook) -> list[AuditEntry]:
    """Remove a webhook and its deliveries; the trail keeps where it pointed."""
    with transaction.atomic():
        entries = _record(actor, "delete", webhook_target(hook), {"url": (hook.url, "")})
        hook.delete()
        return entries


# --- providers and the self-hosted price ------------------------------------------------------------

LOCAL_COST_FIELDS = ("hourly_cost_micro_usd", "utilisation_percent")
PRICE_FIELDS = (
    "model",
    "input_per_million_micro_usd",
    "output_per_million_micro_usd",
    "cached_input_per_million_micro_usd",
    "effective_from",
)
# A worker's rate is recorded only when it beats the stored one by this much: the peaks creep up
# under load, and a new price row for every percent would bury the price history.
THROUGHPUT_NEWS = 1.05


def do_save_provider(
    actor: AbstractBaseUser | None, provider: Provider, fields: Sequence[str], before: dict[str, object] | None,
    *, model: str,
) -> list[AuditEntry]:
    """Save a provider's settings with their audit entries; a changed hourly cost or utilisation
    re-derives the price of its local model (`model`) in the same transaction."""
    target = f"provider {provider.name}"
    with transaction.atomic():
        entries = do_save_with_audit(actor, provider, fields, before, target=target)
        if any(audit_field(name) in {entry.field for entry in entries} for name in LOCAL_COST_FIELDS):
            do_price_local_tokens(actor, provider, model)
    return entries


def do_price_local_tokens(
    actor: AbstractBaseUser | None, provider: Provider, model: str, *, at: datetime | None = None
) -> ModelPrice | None:
    """A new `measured` price for a local provider's model from its hourly cost, utilisation and
    throughput, with its audit entries; None when those give no price or the price in force already."""
    cost = LocalCost.of(provider)
    if cost is None:
        return None
    at = at or timezone.now()
    price = cost.price(provider, model, at)
    current = unique_row(
        ModelPrice.objects.filter(provider=provider, model=model, effective_from__lte=at).order_by("-effective_from")
    )
    if current is not None and _same_price(current, price):
        return None
    do_save_with_audit(actor, price, PRICE_FIELDS, None, target=f"price {provider.name}/{model}")
    return price


def _same_price(a: ModelPrice, b: ModelPrice) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in PRICE_FIELDS[1:4])


def do_record_throughput(
    decode_tokens_per_s: float, prefill_tokens_per_s: float, *, model: str, at: datetime | None = None
) -> list[ModelPrice]:
    """A worker's measured peak rates, for every local provider; those with an hourly cost are re-priced.

    Kept: the highest rates any worker has shown (a restarted worker's first quiet minutes must not
    make tokens dearer), except that the first real measurement replaces seed_demo's assumption.
    Returns the new price rows.
    """
    if decode_tokens_per_s <= 0:
        return []  # nothing generated yet: no figure to divide by
    at = at or timezone.now()
    prices = []
    with transaction.atomic():
        for provider in Provider.objects.select_for_update().filter(kind=Provider.Kind.LOCAL).order_by("pk"):
            rates = _recorded_rates(provider, decode_tokens_per_s, prefill_tokens_per_s)
            if rates is None:
                continue
            provider.decode_tokens_per_s, provider.prefill_tokens_per_s = rates
            provider.throughput_measured_at = at
            provider.save(update_fields=["decode_tokens_per_s", "prefill_tokens_per_s", "throughput_measured_at"])
            price = do_price_local_tokens(None, provider, model, at=at)
            if price is not None:
                prices.append(price)
    return prices


def do_record_variant_throughput(
    decode_tokens_per_s: float, prefill_tokens_per_s: float, *, model: str, at: datetime | None = None
) -> list[ModelPrice]:
    """A weight variant's workers' measured peak rates: its own price ("<model>@<variant>") for every
    local provider with an hourly cost, from that cost and these rates; the provider's own rates (its
    full-precision model's) are left alone.

    As for the full-precision model, only a faster engine makes a new price (5% or more: a lower
    price at the same cost), except that the first report, and the first after staff changed the
    provider's cost or utilisation, re-derive it whatever the rate. A price staff set for the variant
    themselves stands (it is not replaced by a measured one). Returns the new price rows.
    """
    if decode_tokens_per_s <= 0:
        return []
    at = at or timezone.now()
    prices = []
    with transaction.atomic():
        for provider in Provider.objects.select_for_update().filter(kind=Provider.Kind.LOCAL).order_by("pk"):
            machine = LocalCost.of(provider)
            if machine is None:
                continue
            cost = machine.with_rates(decode_tokens_per_s, prefill_tokens_per_s, at)
            price = cost.price(provider, model, at)
            current = unique_row(ModelPrice.objects.filter(provider=provider, model=model, effective_from__lte=at)
                                 .order_by("-effective_from"))
            if current is not None and current.source != ModelPrice.Source.MEASURED:
                continue  # staff priced this variant themselves: their price stands
            if (current is not None and current.basis.startswith(cost.cost_basis() + ";")
                    and price.output_per_million_micro_usd * THROUGHPUT_NEWS > current.output_per_million_micro_usd):
                continue  # not 5% faster than the engine this price came from
            do_save_with_audit(None, price, PRICE_FIELDS, None, target=f"price {provider.name}/{model}")
            prices.append(price)
    return prices


def _recorded_rates(provider: Provider, decode: float, prefill: float) -> tuple[float, float | None] | None:
    """The rates to store for this report, or None when it brings nothing new."""
    if provider.throughput_measured_at is None:  # never measured, or only assumed
        return decode, prefill or None
    stored_decode = provider.decode_tokens_per_s or 0.0
    stored_prefill = provider.prefill_tokens_per_s or 0.0
    if decode < stored_decode * THROUGHPUT_NEWS and prefill < stored_prefill * THROUGHPUT_NEWS:
        return None
    return max(decode, stored_decode), max(prefill, stored_prefill) or None
