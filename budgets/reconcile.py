"""Reconciliation: requests a crashed worker left "running" are failed and their reservations
freed, alerts that were never sent are queued again, and the spend forecasts are checked."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from .actions import Usage, do_record_usage, do_requeue_unsent_alerts
from .alerts import check_spend_forecasts, check_thresholds_after_settle
from .guard import counter_store, flush_settled_marks, release, settle
from .models import TokenLog

log = logging.getLogger(__name__)


def release_lost_requests(now=None) -> int:
    """Fail every request still running past the reservation TTL and settle it. Idempotent."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.CEILING_RESERVATION_TTL_S)
    error = f"no worker finished this request within {settings.CEILING_RESERVATION_TTL_S} s"
    released = sum(
        fail_lost_request(row, error)
        for row in TokenLog.objects.filter(status=TokenLog.Status.RUNNING, created_at__lt=cutoff).iterator()
    )
    if released:
        log.warning("reconciliation released %d lost request(s)", released)
    return released


def fail_lost_request(row: TokenLog, error: str) -> bool:
    """Fail one request still running, with no answer tokens (a lost worker's are unknown to the
    ledger), and free what the counters hold for it; False when something settled it first.

    A row claims its admission from its INSERT on (budgets/guard.py); only the admit script's
    marker in Redis says the claim was granted. Without it the request was never admitted, so never
    dispatched: closed unadmitted. (Should Redis lose its data and a worker die with a request in
    flight, that request is closed unadmitted too: the one case where the ledger may not count
    a request that was served.)"""
    if not row.admitted or not counter_store().admitted(row.request_id):
        return close_unadmitted(row, error)
    if not do_record_usage(row.request_id, status=TokenLog.Status.FAILED, usage=Usage(row.prompt_tokens, 0), error=error):
        return False
    row.refresh_from_db()
    if settle(row):
        check_thresholds_after_settle(row)  # its prompt's cost counts toward the month too; logs, never raises
    flush_settled_marks()  # a sweep is rare: its mark is written before it reports the row done
    return True


ADMISSION_INTERRUPTED = "admission_interrupted"


def close_unadmitted(row: TokenLog, error: str) -> bool:
    """A row whose process died between opening it and the admit script's grant: never admitted, so
    never dispatched nor served. It is closed as refused (`admission_interrupted`), which the ledger does
    not count, and whatever a counter may hold for it is released, which the counters do not count
    either, so a rebuild from the ledger and the counters agree. Closed as failed it would count as
    a request used that no counter ever counted."""
    closed = TokenLog.objects.filter(pk=row.pk, status=TokenLog.Status.RUNNING).update(
        status=TokenLog.Status.REFUSED, refusal_code=ADMISSION_INTERRUPTED, admitted=False,
        error=f"the admission was interrupted: {error}"[:500], finished_at=timezone.now(),
    )
    if not closed:
        return False
    row.refresh_from_db()
    release(row)  # a no-op where nothing was reserved
    flush_settled_marks()
    return True


SETTLE_RETRY_AFTER_S = 30


def retry_unsettled(now=None) -> int:
    """Settle again what a Redis hiccup left unsettled, and release what a timed-out admission may
    have reserved. Both are no-ops for counters that do not hold the request."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=SETTLE_RETRY_AFTER_S)
    finished = TokenLog.objects.filter(admitted=True, counters_settled=False, finished_at__lt=cutoff).exclude(
        status__in=[TokenLog.Status.RUNNING, TokenLog.Status.REFUSED]
    )
    timed_out = TokenLog.objects.filter(
        status=TokenLog.Status.REFUSED, refusal_code__in=["guard_unavailable", ADMISSION_INTERRUPTED],
        counters_settled=False, finished_at__lt=cutoff,
    )
    done = 0
    for row in finished.iterator():
        # A settle that Redis missed skipped its threshold check too (it follows a settle that worked).
        if settle(row):
            check_thresholds_after_settle(row)
        done += row.counters_settled
    for row in timed_out.iterator():
        release(row)
        done += row.counters_settled
    flush_settled_marks()
    return done


def reconcile_forever(stop: threading.Event, every_s: float) -> None:
    """Run in each worker every CEILING_RECONCILE_EVERY_S: several at once is safe (settling is idempotent)."""
    while not stop.wait(every_s):
        try:
            close_old_connections()
            release_lost_requests()
            retry_unsettled()
            do_requeue_unsent_alerts()
            check_spend_forecasts_once_per(every_s)
        except Exception:  # noqa: BLE001 - reconciliation must never take the worker down
            log.exception("reconciliation failed")


FORECAST_LOCK_KEY = "ceiling:forecast-check"


def check_spend_forecasts_once_per(every_s: float) -> bool:
    """Projected and spike alerts, by one worker per interval (a Redis lock that expires): every
    worker running the same ledger-wide aggregates each minute would only repeat each other."""
    if not counter_store().client.set(FORECAST_LOCK_KEY, "1", nx=True, ex=max(1, int(every_s) - 1)):
        return False
    check_spend_forecasts()
    return True
