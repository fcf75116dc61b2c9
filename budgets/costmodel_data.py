"""Inputs for the cost model, read from the real TokenLog of a feature (one aggregate query each)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, F, FloatField, StdDev, Sum
from django.db.models.functions import Cast, Ln

from .costmodel import Distribution
from .models import Feature, ModelPrice, TokenLog

# Measured on the development machine (shared/ENGINE_NOTES.md): prefill ≈ 350 tokens/s, decode of one
# stream ≈ 12 tokens/s. Used only where the feature has no logs to measure from.
DEFAULT_PREFILL_TOKENS_PER_S = 350.0
DEFAULT_DECODE_TOKENS_PER_S = 12.0
DEFAULT_OVERHEAD_MS = 80.0


@dataclass(frozen=True)
class Observed:
    requests: int
    users: int
    prompt_tokens: Distribution | None
    output_tokens: Distribution | None
    requests_per_user_per_day: Distribution | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None


def observe(feature: Feature, now: datetime, days: int = 30) -> Observed:
    rows = TokenLog.objects.filter(feature=feature, status=TokenLog.Status.OK, created_at__gte=now - timedelta(days=days))
    shape = rows.filter(prompt_tokens__gt=0, completion_tokens__gt=0).aggregate(
        n=Count("id"),
        users=Count("user", distinct=True),
        prompt_log_mean=Avg(Ln(Cast("prompt_tokens", FloatField()))),
        prompt_log_std=StdDev(Ln(Cast("prompt_tokens", FloatField()))),
        output_log_mean=Avg(Ln(Cast("completion_tokens", FloatField()))),
        output_log_std=StdDev(Ln(Cast("completion_tokens", FloatField()))),
    )
    return Observed(
        requests=shape["n"],
        users=shape["users"],
        prompt_tokens=_lognormal(shape["prompt_log_mean"], shape["prompt_log_std"]),
        output_tokens=_lognormal(shape["output_log_mean"], shape["output_log_std"]),
        requests_per_user_per_day=_daily_rate(rows, days),
        **_measured_rates(rows),
    )


def _lognormal(log_mean, log_std) -> Distribution | None:
    if log_mean is None:
        return None
    return Distribution.lognormal(math.exp(log_mean), float(log_std or 0.0))


def _daily_rate(rows, days: int) -> Distribution | None:
    """Each user's requests per day over the window: one row per user (not per request), then a fit."""
    per_user = rows.values("user").annotate(requests=Count("id"))
    rates = [row["requests"] / days for row in per_user]
    if not rates:
        return None
    return Distribution.fit_lognormal(rates)


def _measured_rates(rows) -> dict:
    """Prefill ≈ prompt tokens per second of TTFT; decode ≈ tokens after the first per second after it."""
    timed = rows.filter(ttft_ms__gt=0, total_ms__gt=F("ttft_ms"), completion_tokens__gt=1).aggregate(
        prompt=Sum("prompt_tokens"), ttft=Sum("ttft_ms"),
        decoded=Sum(F("completion_tokens") - 1), decode_ms=Sum(F("total_ms") - F("ttft_ms")),
    )
    prefill = timed["prompt"] / timed["ttft"] * 1000 if timed["ttft"] else None
    decode = timed["decoded"] / timed["decode_ms"] * 1000 if timed["decode_ms"] else None
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}


def known_hosted_prices(limit: int = 400) -> list[ModelPrice]:
    """The prices in force per (provider, model), newest first, for the page's model picker."""
    rows = ModelPrice.objects.select_related("provider").order_by("provider__name", "model", "-effective_from")
    seen, prices = set(), []
    for row in rows[: limit * 4]:
        if (row.provider_id, row.model) not in seen:
            seen.add((row.provider_id, row.model))
            prices.append(row)
    return prices[:limit]


