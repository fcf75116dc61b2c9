"""Stage 8, settle: what this process settles itself. A worker settles every request it ran; this
process settles the admitted requests no worker will: one the broker never took, one whose caller
left while the guard was deciding, one that timed out, and one whose worker died (relay.py)."""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async

from budgets.models import TokenLog
from inference.actions import do_finish_request, settle_reservation
from project import tracing

log = logging.getLogger(__name__)

# Admissions whose caller went away while the guard was deciding; kept referenced until they finish.
_abandoned: set[asyncio.Task] = set()


def finish_undispatched(request_id: str, status: str, prompt_tokens: int, finish_reason: str, error: str) -> None:
    """Settle an admitted request that never reached a worker, and release its reservation."""
    from django.db import close_old_connections

    close_old_connections()
    with tracing.span("settle", request_id, status=status):
        do_finish_request(
            request_id, status=status, prompt_tokens=prompt_tokens, completion_ids=[], text="",
            finish_reason=finish_reason, ttft_ms=None, error=error,
        )
        settle_reservation(request_id)


def fail_undispatched(request_id: str, error: str) -> None:
    finish_undispatched(request_id, TokenLog.Status.FAILED, 0, "", f"could not reach the workers: {error}")


def close_when_admitted(admission: asyncio.Future) -> None:
    """An admission whose caller went away: once the guard answers, an admitted request is closed as
    cancelled, instead of holding its reservation until reconciliation fails it."""
    task = asyncio.ensure_future(_close_if_admitted(admission))
    _abandoned.add(task)
    task.add_done_callback(_abandoned.discard)


async def _close_if_admitted(admission: asyncio.Future) -> None:
    try:
        decision = await admission
    except Exception:
        log.exception("an abandoned admission failed")
        return
    if decision.admitted:
        # Not thread-sensitive: the HTTP request this came from may be over, and its thread with it.
        await sync_to_async(finish_undispatched, thread_sensitive=False)(
            decision.request_id, TokenLog.Status.CANCELLED, decision.log.prompt_tokens, "cancelled", ""
        )
