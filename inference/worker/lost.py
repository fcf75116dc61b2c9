"""The requests of dead workers, settled by the live ones within seconds.

A worker records itself as the owner of each request it runs, with the tokens it has streamed and
the inbox of the web process waiting for it (inference/bus/ownership.py), and its stats key is its
heartbeat (TTL 5 s). Every live worker looks through those records every CEILING_LOST_SWEEP_EVERY_S:
a request whose owner's heartbeat is gone is settled failed with the tokens that owner had
streamed (not 0), its reservation is released, and the web process that waits for it, if any, gets
its `worker_lost` frame. That web process would notice by itself after 5 s of silence; the sweep is
what settles a request nobody waits for (a batch item, a web process that died
too), which otherwise stayed running, its reservation held, for CEILING_RESERVATION_TTL_S (600 s).

The same sweep settles a request admitted long ago that no worker ever claimed: a worker died with
its task prefetched (tasks are acked on receipt, never redelivered), or its queue lost it. The web
process waiting for it settles it at CEILING_FIRST_TOKEN_TIMEOUT_S; one that died too left it
running, its reservation held, for CEILING_RESERVATION_TTL_S. Past the first-token timeout plus
UNCLAIMED_GRACE_S, an unclaimed row (asked twice, a heartbeat apart: a live owner puts back a claim
Redis lost, inference/bus/ownership.py) can only be such a request (or one whose web process died in
the middle of its admission, before any dispatch): it is settled failed with 0 tokens and whatever a
counter holds for it is released.
A worker that picks the task up afterwards finds it settled and skips it.

Several workers sweeping at once is safe: the ledger row is settled once (do_fail_lost_request),
and only the one that settled it tells the waiting process.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from budgets.models import TokenLog
from budgets.reconcile import fail_lost_request
from inference.actions import do_fail_lost_request, worker_lost_event
from inference.bus.outbox import channel_sender
from inference.bus.ownership import holds, lost_claims, unclaimed

UNCLAIMED_GRACE_S = 30  # beyond the first-token timeout: the waiting web process settles first
UNCLAIMED_BATCH = 500  # rows looked at per sweep; the next sweep takes the rest
NEVER_PICKED_UP_ERROR = "no worker picked this request up within {seconds:.0f} s (its web process was gone too)"

log = logging.getLogger(__name__)

def settle_requests_of_dead_workers() -> int:
    """Settle every request whose owning worker is dead; returns how many this call settled."""
    settled = 0
    for claim in lost_claims():
        row = do_fail_lost_request(claim.request_id, tokens=claim.tokens)
        if row is None:
            continue
        settled += 1
        log.warning("request %s: its worker %s is gone; settled failed after %d tokens", claim.request_id,
                    claim.worker, claim.tokens)
        if claim.inbox:
            frame = worker_lost_event(claim.request_id, claim.tokens) | {"type": "chat.failed"}
            channel_sender().send_frame(claim.inbox, claim.request_id, frame, wait=True)
    return settled


def settle_requests_never_picked_up(now: datetime | None = None) -> int:
    """Settle requests that no worker claimed within the first-token timeout plus a grace: admitted
    ones never picked up, and rows whose web process died in the middle of their admission."""
    now = now or timezone.now()
    waited_s = settings.CEILING_FIRST_TOKEN_TIMEOUT_S + UNCLAIMED_GRACE_S
    # Older rows are the reconciliation's (budgets/reconcile.py), which fails them the same way.
    candidates = {
        row.request_id: row
        for row in TokenLog.objects.filter(
            status=TokenLog.Status.RUNNING,
            created_at__lt=now - timedelta(seconds=waited_s),
            created_at__gte=now - timedelta(seconds=settings.CEILING_RESERVATION_TTL_S),
        ).order_by("created_at")[:UNCLAIMED_BATCH]
    }
    settled = 0
    error = NEVER_PICKED_UP_ERROR.format(seconds=waited_s)
    for request_id in unclaimed_after_a_beat([request_id for request_id in candidates if not holds(request_id)]):
        if fail_lost_request(candidates[request_id], error):
            settled += 1
            log.warning("request %s: no worker picked it up within %.0f s; settled", request_id, waited_s)
    return settled


# Two heartbeats: a live owner whose claim Redis lost has put it back by then (ownership.reassert_claims).
CLAIM_REASSERT_S = 1.0


def unclaimed_after_a_beat(request_ids: list[str]) -> list[str]:
    """Those of the requests no worker claims, asked again after a live owner could put a lost claim back."""
    missing = unclaimed(request_ids)
    if not missing:
        return []
    time.sleep(CLAIM_REASSERT_S)
    return unclaimed(missing)


def settle_lost_requests_forever(stop: threading.Event, every_s: float) -> None:
    """In each worker: once at start (a restarted worker settles what its predecessor left), then every every_s."""
    while True:
        try:
            close_old_connections()
            settle_requests_of_dead_workers()
            settle_requests_never_picked_up()
        except redis.RedisError as exc:
            log.warning("could not look for the requests of dead workers: %s", exc)
        except Exception:  # noqa: BLE001 - the sweep must never take the worker down
            log.exception("settling the requests of dead workers failed")
        if stop.wait(every_s):
            return
