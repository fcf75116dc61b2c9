"""The lifecycle of one chat request: opened by the consumer, finished by the worker."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from budgets.actions import Usage, do_record_usage
from budgets.alerts import check_provider_thresholds_safely
from budgets.guard import AdmissionRequest, Decision, LoopLimits, admit, settle
from budgets.models import Feature, TokenLog

from .models import Transcript


def do_admit_request(
    *,
    request_id: str,
    user: AbstractBaseUser,
    feature: Feature,
    model: str,
    messages: list[dict],
    prompt_ids: list[int],
    max_tokens: int,
    loop: LoopLimits | None = None,
) -> Decision:
    """Ask the guard; when admitted, store the prompt for the worker. Refusals are logged by the guard."""
    request = AdmissionRequest(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        loop=loop,
    )
    decision = admit(request)
    if decision.admitted:
        store_prompt(decision.log, messages, prompt_ids)
    return decision


def store_prompt(log: TokenLog, messages: list[dict], prompt_ids: list[int]) -> Transcript:
    """What the worker will read: the prompt of an admitted request."""
    return Transcript.objects.create(log=log, messages=messages, prompt_ids=prompt_ids)


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
    completion_tokens: int | None = None,
) -> TokenLog | None:
    """Settle the ledger row and store the answer; None when it was already settled.

    completion_tokens defaults to len(completion_ids); a remote engine has no local token ids and
    passes the count it reported instead. The guard's counters are settled by the caller after this
    commits (settle_reservation).
    """
    if completion_tokens is None:
        completion_tokens = len(completion_ids)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    settled = do_record_usage(
        request_id, status=status, usage=usage, finish_reason=finish_reason, error=error, ttft_ms=ttft_ms
    )
    if not settled:
        return None
    Transcript.objects.filter(log__request_id=request_id).update(completion_ids=completion_ids, response_text=text)
    return TokenLog.objects.get(request_id=request_id)


def settle_reservation(request_id: str) -> bool:
    """Release a finished request's reservation in the guard; safe to call any number of times."""
    row = TokenLog.objects.select_related("provider").filter(request_id=request_id).first()
    if row is None or row.status in (TokenLog.Status.RUNNING, TokenLog.Status.REFUSED) or not row.admitted:
        return False
    settled = settle(row)
    if settled and row.provider is not None and row.provider.monthly_limit_micro_usd is not None:
        check_provider_thresholds_safely(row.provider_id)  # logs, never raises: settling must not fail
    return settled
