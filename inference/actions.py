"""The lifecycle of one chat request: opened by the consumer, finished by the worker."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from budgets.actions import Usage, do_open_log, do_record_usage
from budgets.models import Feature, TokenLog

from .models import Transcript


@transaction.atomic
def do_open_request(
    *,
    request_id: str,
    user: AbstractBaseUser,
    feature: Feature,
    model: str,
    messages: list[dict],
    prompt_ids: list[int],
    max_tokens: int,
) -> TokenLog:
    log = do_open_log(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
    )
    Transcript.objects.create(log=log, messages=messages, prompt_ids=prompt_ids)
    return log


@transaction.atomic
def do_finish_request(
    request_id: str,
    *,
    status: str,
    prompt_tokens: int,
    completion_ids: list[int],
    text: str,
    finish_reason: str,
    ttft_ms: int | None,
    error: str = "",
) -> TokenLog | None:
    """Settle the ledger row and store the answer; None when it was already settled."""
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(completion_ids))
    settled = do_record_usage(
        request_id, status=status, usage=usage, finish_reason=finish_reason, error=error, ttft_ms=ttft_ms
    )
    if not settled:
        return None
    Transcript.objects.filter(log__request_id=request_id).update(completion_ids=completion_ids, response_text=text)
    return TokenLog.objects.get(request_id=request_id)
