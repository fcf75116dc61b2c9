"""Batch jobs: many inputs answered by one feature in the background, progress visible to staff.

Staff start a job (inference/batch_jobs.py do_start_batch); the Celery task inference.run_batch runs it inside an inference
worker, where the engine is in-process. Each item is one ordinary request: admitted by the guard as
the job's user and feature (a refusal is recorded on the item and the job goes on), generated inline,
settled and logged like a chat. A few items run at once so they share the engine's running batch.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from django.conf import settings
from django.db import close_old_connections, connection
from django.db.models import Case, F, Value, When
from django.utils import timezone

from budgets.actions import do_log_refusal
from budgets.models import Feature, TokenLog
from inference.actions import do_admit_request
from inference.models import BatchItem, BatchJob, Transcript
from inference.web.tokenizer import chat_prompt_ids, input_too_long_by_count, model_name
from inference.worker.generation import run_generation

log = logging.getLogger(__name__)

ITEMS_AT_ONCE = 4
REFUSED = TokenLog.Status.REFUSED


def run_batch_job(job_id: int) -> None:
    """Answer every item of a queued job, then mark it done (failed when no item succeeded)."""
    # Claimed atomically: a job runs once, even if its task were delivered twice.
    if not BatchJob.objects.filter(pk=job_id, status=BatchJob.Status.QUEUED).update(status=BatchJob.Status.RUNNING):
        log.warning("batch %s is not queued (unknown, or started already)", job_id)
        return
    job = BatchJob.objects.select_related("feature", "user").get(pk=job_id)
    items = list(job.items.filter(status=""))
    with ThreadPoolExecutor(max_workers=ITEMS_AT_ONCE, thread_name_prefix=f"batch-{job_id}") as pool:
        for _ in pool.map(partial(_run_item_in_thread, job), items):
            pass
    BatchJob.objects.filter(pk=job_id).update(
        status=Case(When(done=0, then=Value(BatchJob.Status.FAILED)), default=Value(BatchJob.Status.DONE)),
        finished_at=timezone.now(),
    )


def _run_item_in_thread(job: BatchJob, item: BatchItem) -> None:
    close_old_connections()
    try:
        run_item(job, item)
    except Exception as exc:
        log.exception("batch %s item %s failed", job.pk, item.index)
        _record(item, TokenLog.Status.FAILED, error=f"internal error: {exc}"[:500])
    finally:
        connection.close()  # this thread's own connection; the pool's threads end with the job


def run_item(job: BatchJob, item: BatchItem) -> None:
    """One item as one request: the guard, the engine, the ledger, then the item and the job's counters."""
    request_id = uuid.uuid4().hex
    feature = job.feature
    messages = [{"role": "user", "content": item.prompt}]
    prompt_ids = chat_prompt_ids(messages)
    max_tokens = min(job.max_tokens, feature.max_output_tokens)
    refusal = _refusal_before_guard(feature, len(prompt_ids))
    if refusal is not None:
        code, message = refusal
        do_log_refusal(
            request_id=request_id, user=job.user, feature=feature, model=model_name(feature), code=code, message=message,
            prompt_tokens=len(prompt_ids), max_tokens=max_tokens,
        )
        _record(item, REFUSED, request_id=request_id, error=message)
        return
    decision = do_admit_request(
        request_id=request_id, user=job.user, feature=feature, model=model_name(feature), messages=messages,
        prompt_ids=prompt_ids, max_tokens=max_tokens,
    )
    if not decision.admitted:
        _record(item, REFUSED, request_id=request_id, error=decision.message)
        return
    run_generation(request_id)
    row = TokenLog.objects.get(request_id=request_id)
    output = Transcript.objects.filter(log=row).values_list("response_text", flat=True).first() or ""
    _record(item, row.status, request_id=request_id, output=output, error=row.error)


def _refusal_before_guard(feature: Feature, prompt_tokens: int) -> tuple[str, str] | None:
    """What the session also checks before the guard: a switched-off feature, a too-long input."""
    # Read afresh for every item: staff may switch the feature off while a long job runs.
    enabled, max_input_tokens = Feature.objects.values_list("enabled", "max_input_tokens").get(pk=feature.pk)
    if not enabled:
        return "feature_disabled", f"The feature {feature.name!r} is switched off by the operators."
    too_long = input_too_long_by_count(prompt_tokens, min(max_input_tokens, settings.CEILING_MAX_INPUT_TOKENS))
    return ("max_input_tokens", too_long) if too_long else None


def _record(item: BatchItem, status: str, *, request_id: str = "", output: str = "", error: str = "") -> None:
    """Save the item's outcome and count it on the job at once, so progress shows while the job runs."""
    item.status, item.output, item.error = status, output, error[:500]
    item.request_id = request_id or item.request_id
    item.save(update_fields=["status", "output", "error", "request_id"])
    counter = "done" if status == TokenLog.Status.OK else "failed"
    BatchJob.objects.filter(pk=item.job_id).update(**{counter: F(counter) + 1})
