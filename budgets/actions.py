"""Writes to the ledger. Each is atomic and idempotent by request_id."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import Feature, TokenLog


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cost_micro_usd: int = 0


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
    """Settle a running request once. Returns False when it was already settled (a replay)."""
    now = timezone.now()
    log = TokenLog.objects.filter(request_id=request_id).only("created_at").first()
    if log is None:
        return False
    total_ms = max(0, int((now - log.created_at).total_seconds() * 1000))
    updated = TokenLog.objects.filter(request_id=request_id, status=TokenLog.Status.RUNNING).update(
        status=status,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cost_micro_usd=usage.cost_micro_usd,
        finish_reason=finish_reason,
        error=error[:500],
        ttft_ms=ttft_ms,
        total_ms=total_ms,
        finished_at=now,
    )
    return updated == 1
