"""OpenAI's rate-limit headers, from the tightest of the caps the guard applies to a caller.

    headers = rate_limit_headers(user, feature)   # {} when no request or token cap applies

x-ratelimit-limit-requests / -remaining-requests / -reset-requests and the same three for tokens,
as OpenAI sends them (reset as a duration: "6m0s", "13h2m5s"). Each trio comes from the one cap of
its metric with the least left: the user's own or everyone's default, all features or this one, per
day or month (budgets/guard.py `applicable_ceilings`, the same list the guard admits against).
Read-only: the numbers are the guard's Redis counters (what is used and what answers in progress
hold), or the ledger's sums where a counter has not been built yet; nothing here admits or reserves.
Spend limits (cost caps, providers) and loop budgets have no OpenAI header and are left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from django.db import DatabaseError
from django.utils import timezone

from budgets.counters import Usage
from budgets.guard import Ceiling, applicable_ceilings, counter_store, ledger_sums, request_scopes
from budgets.models import Feature, Provider, unique_row
from budgets.periods import seconds_until_reset

log = logging.getLogger(__name__)

METRICS = ("requests", "tokens")


@dataclass(frozen=True)
class Window:
    limit: int
    remaining: int
    reset_s: int


def rate_limit_headers(user, feature_name: str | None, api_key=None) -> dict[str, str]:
    """The six headers (or the trios that apply); never raises: a header is not worth a failed answer."""
    try:
        windows = tightest_windows(user, feature_name, api_key)
    except (redis.RedisError, DatabaseError) as exc:
        log.warning("rate-limit headers left out: %s", exc)
        return {}
    headers = {}
    for metric, window in windows.items():
        headers[f"x-ratelimit-limit-{metric}"] = str(window.limit)
        headers[f"x-ratelimit-remaining-{metric}"] = str(window.remaining)
        headers[f"x-ratelimit-reset-{metric}"] = duration(window.reset_s)
    return headers


def tightest_windows(user, feature_name: str | None, api_key=None) -> dict[str, Window]:
    """metric → the window of the cap with the least left, for the metrics some cap limits."""
    now = timezone.now()
    feature = unique_row(Feature.objects.filter(name=feature_name)) if feature_name else None
    # An unsaved provider without a limit: spend limits have no header, and reading them must not
    # create the default provider row (Provider.default() would).
    # The user's team and the request's API key count too (a tag is per request, not per caller).
    scopes = request_scopes(user, api_key)
    ceilings = applicable_ceilings(user, feature, Provider(monthly_limit_micro_usd=None), now, None, scopes)
    if feature is None:  # no feature chosen (GET /v1/models, a bad body): the caps of every feature
        ceilings = [c for c in ceilings if c.scope in ("user", "team", "key")]
    best: dict[str, Window] = {}
    for ceiling in ceilings:
        if ceiling.period is None:
            continue  # a loop's budget does not reset with time
        spent = _spent(ceiling)
        for metric in METRICS:
            limit = getattr(ceiling.spec.limits, metric)
            if limit is None:
                continue
            left = max(0, limit - getattr(spent, metric))
            window = Window(limit, left, seconds_until_reset(ceiling.period, now))
            if metric not in best or window.remaining < best[metric].remaining:
                best[metric] = window
    return best


def _spent(ceiling: Ceiling) -> Usage:
    """Used plus held by answers in progress, as the guard counts it before it admits the next one."""
    state = counter_store().state(ceiling.spec.key)
    if state is None:
        used, reserved = ledger_sums(ceiling.ledger_filter)
    else:
        used, reserved = state.used, state.reserved
    return Usage(used.requests + reserved.requests, used.tokens + reserved.tokens, used.cost_micro_usd + reserved.cost_micro_usd)


def duration(seconds: int) -> str:
    """Seconds as OpenAI writes a reset: "45s", "6m0s", "13h2m5s" (hours grow past a day)."""
    hours, rest = divmod(max(0, seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
