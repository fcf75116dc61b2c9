"""Inputs for the cost model, read from the real TokenLog of a feature (one aggregate query each)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, F, FloatField, StdDev, Sum
from django.db.models.functions import Cast, Ln
from django.utils import timezone

from .costmodel import Distribution
from .models import Feature, ModelPrice, TokenLog

# Measured on the development machine (docs/engine.md): prefill ≈ 350 tokens/s, decode of one
# stream ≈ 12 tokens/s. Used only where the feature has no logs to measure from.
DEFAULT_PREFILL_TOKENS_PER_S = 350.0
DEFAULT_DECODE_TOKENS_PER_S = 12.0
DEFAULT_OVERHEAD_MS = 80.0

# The cost model's example inputs, where a feature has no logs to prefill from (the page and the command).
DEFAULTS = {
    "users": 1000, "system_prompt_tokens": 200, "retrieved_tokens": 0,
    "prompt_median": 120, "prompt_sigma": 0.6, "output_median": 250, "output_sigma": 0.5,
    "requests_law": "lognormal", "requests_a": 3, "requests_b": 1.0,
    "pricing": "custom", "input_usd_per_million": 0.15, "output_usd_per_million": 0.60,
    "hourly_usd": 3.60, "utilisation_percent": 70, "machine_decode_tokens_per_s": 2400,
    "overhead_ms": DEFAULT_OVERHEAD_MS, "prefill_tokens_per_s": DEFAULT_PREFILL_TOKENS_PER_S,
    "decode_tokens_per_s": DEFAULT_DECODE_TOKENS_PER_S, "retrieval_ms": 0, "target_usd": 2.0,
}


@dataclass(frozen=True)
class Observed:
    requests: int
    users: int
    prompt_tokens: Distribution | None
    output_tokens: Distribution | None
    requests_per_user_per_day: Distribution | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    # A docs feature's: the mean tokens retrieval placed in a prompt (left out of prompt_tokens, which
    # is then the rest of the prompt) and the mean retrieval time.
    retrieved_tokens: float = 0.0
    retrieval_ms: float | None = None


def observe(feature: Feature, now: datetime, days: int = 30) -> Observed:
    rows = TokenLog.objects.filter(feature=feature, status=TokenLog.Status.OK, created_at__gte=now - timedelta(days=days))
    own_prompt = Cast(F("prompt_tokens") - F("retrieved_tokens"), FloatField())
    shape = rows.filter(prompt_tokens__gt=F("retrieved_tokens"), completion_tokens__gt=0).aggregate(
        n=Count("id"),
        users=Count("user", distinct=True),
        prompt_log_mean=Avg(Ln(own_prompt)),
        prompt_log_std=StdDev(Ln(own_prompt)),
        retrieved=Avg("retrieved_tokens"),
        retrieval_ms=Avg("retrieval_ms"),
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
        retrieved_tokens=float(shape["retrieved"] or 0.0),
        retrieval_ms=shape["retrieval_ms"],
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


def initial_from_logs(feature: Feature | None) -> tuple[dict, str]:
    """The form's starting values: the feature's real numbers where it has logs, defaults elsewhere."""
    initial = dict(DEFAULTS)
    if feature is None:
        return initial, "No feature chosen: the inputs are examples; change them freely."
    seen = observe(feature, timezone.now())
    if not seen.requests:
        return {**initial, "feature": feature.pk}, f"{feature.name!r} has no completed requests yet: the inputs are examples."
    initial.update(feature=feature.pk, users=max(1, seen.users), system_prompt_tokens=0)
    if seen.prompt_tokens:
        initial.update(prompt_median=round(seen.prompt_tokens.median, 1), prompt_sigma=round(seen.prompt_tokens.sigma, 3))
    if seen.output_tokens:
        initial.update(output_median=round(seen.output_tokens.median, 1), output_sigma=round(seen.output_tokens.sigma, 3))
    if seen.requests_per_user_per_day:
        law = seen.requests_per_user_per_day
        initial.update(requests_law="lognormal", requests_a=round(law.median, 4), requests_b=round(law.sigma, 3))
    if seen.prefill_tokens_per_s:
        initial["prefill_tokens_per_s"] = round(seen.prefill_tokens_per_s, 1)
    if seen.decode_tokens_per_s:
        initial["decode_tokens_per_s"] = round(seen.decode_tokens_per_s, 2)
    # The real retrieved length: what retrieval placed in this feature's prompts, apart from the rest.
    initial["retrieved_tokens"] = round(seen.retrieved_tokens)
    if seen.retrieval_ms is not None:
        initial["retrieval_ms"] = round(seen.retrieval_ms, 1)
    return initial, f"Prefilled from {seen.requests:,} completed requests of {seen.users:,} users of {feature.name!r} in the last 30 days."


def known_hosted_prices(limit: int = 400) -> list[ModelPrice]:
    """The prices in force per (provider, model), newest first, for the page's model picker."""
    rows = ModelPrice.objects.select_related("provider").order_by("provider__name", "model", "-effective_from")
    seen, prices = set(), []
    for row in rows[: limit * 4]:
        if (row.provider_id, row.model) not in seen:
            seen.add((row.provider_id, row.model))
            prices.append(row)
    return prices[:limit]


