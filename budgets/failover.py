"""Failover across remote providers under one reservation (docs/budgets.md, "Failover").

A feature lists backup providers (Feature.backup_providers, in order). When its remote provider
answers 429 or 5xx, cannot be reached, or sends no first token in time, and nothing has reached the
client yet, the worker (inference/worker/handles.py) moves the request to the next backup that may
serve it, without a second admission. The reservation was made at the feature's own provider's
price, so the rule that keeps it an upper bound of the bill is:

- a backup serves only if its price for the request's model is, input and output each, at most the
  price the request was reserved at (an unpriced provider costs $0 everywhere in Ceiling);
- a backup with a monthly spend limit of its own is passed over: the admission never checked that
  limit, and counting a request against it after the fact could take it past it;
- only remote (openai-compatible) providers are backups.

A backup passed over is named on the row with the reason. On a switch the row's provider and price
become the backup's and the feature's own provider's monthly counter lets go of the reservation
(its ledger no longer counts the row), so counters and ledger agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from .guard import counter_store, price_in_force
from .models import ModelPrice, Provider, TokenLog
from .money import format_usd

log = logging.getLogger(__name__)

PROVIDER_COUNTER_PREFIX = "ceiling:c:provider:"  # guard.provider_month_key's


@dataclass(frozen=True)
class Backup:
    """A backup provider that may serve the request: the model it is sent (and priced and logged as)
    and its price (None: unpriced, $0)."""

    provider: Provider
    model: str
    price: ModelPrice | None


def _rates(price: ModelPrice | None) -> tuple[int, int]:
    if price is None:
        return 0, 0
    return price.input_per_million_micro_usd, price.output_per_million_micro_usd


def why_not(provider: Provider | None, price: ModelPrice | None, reserved_at: ModelPrice | None) -> str:
    """Why this backup may not serve a request reserved at `reserved_at`; "" when it may."""
    if provider is None:
        return "no longer exists"
    if provider.kind != Provider.Kind.OPENAI_COMPATIBLE:
        return "is not a remote provider, so it cannot be a backup"
    if provider.monthly_limit_micro_usd is not None:
        return "was passed over: it has a monthly spend limit, which this request's admission did not check"
    (price_in, price_out), (cap_in, cap_out) = _rates(price), _rates(reserved_at)
    if price_in > cap_in or price_out > cap_out:
        return (
            f"was passed over: it costs {format_usd(price_in)}/{format_usd(price_out)} per million tokens in/out, "
            f"more than the {format_usd(cap_in)}/{format_usd(cap_out)} this request was reserved at"
        )
    return ""


def backups(row: TokenLog, reserved_at: ModelPrice | None) -> list[tuple[str, Backup | None, str]]:
    """The feature's backups in order, as (name, the backup, "") when it may serve this row, else
    (name, None, why not). Read only when a request's provider failed."""
    ids = row.feature.backup_providers if row.feature_id else []
    found = Provider.objects.in_bulk([pk for pk in ids if isinstance(pk, int)])
    tried = {row.provider_id}
    listed: list[tuple[str, Backup | None, str]] = []
    for pk in ids:
        provider = found.get(pk) if isinstance(pk, int) else None
        if provider is not None and provider.pk in tried:
            continue  # the feature's own provider, or one listed twice: it has had its try
        # The name the worker sends it (worker/remote.py), so the one it is priced and logged under.
        model = (provider.remote_model if provider is not None else "") or row.model
        price = price_in_force(provider, model, row.created_at) if provider is not None else None
        reason = why_not(provider, price, reserved_at)
        name = provider.name if provider is not None else f"provider {pk}"
        if not reason:
            tried.add(provider.pk)
        listed.append((name, None if reason else Backup(provider, model, price), reason))
    return listed


def do_switch_provider(row: TokenLog, backup: Backup, failed_over: list[str]) -> bool:
    """Make the backup the running row's provider (and price), with the failures so far; False when
    the row was settled meanwhile. The row is written first, then the feature's own provider's
    monthly counter releases the reservation: a counter rebuilt in between reads the row as the
    backup's already, so nothing is held twice or left held."""
    released = [key for key in row.counter_keys if key.startswith(PROVIDER_COUNTER_PREFIX)]
    keys = [key for key in row.counter_keys if key not in released]
    fields = {"provider": backup.provider, "model": backup.model, "price": backup.price, "counter_keys": keys,
              "failed_over": list(failed_over)}
    if not TokenLog.objects.filter(pk=row.pk, status=TokenLog.Status.RUNNING).update(**fields):
        return False
    for name, value in fields.items():
        setattr(row, name, value)
    if released:
        try:
            counter_store().release_held(row.request_id, released)
        except redis.RedisError as exc:
            # It holds the reservation until the counter is next rebuilt from the ledger (early
            # refusals, never an admission too many).
            log.warning("could not release %s's provider counter after failing over: %s", row.request_id, exc)
    return True


def do_note_failed_over(row: TokenLog, failed_over: list[str]) -> None:
    """Write the providers that failed (or were passed over) on the running row, before it settles."""
    if list(failed_over) == list(row.failed_over):
        return
    TokenLog.objects.filter(pk=row.pk, status=TokenLog.Status.RUNNING).update(failed_over=list(failed_over))
    row.failed_over = list(failed_over)
