"""Live dashboard increments: one small event per settled or refused request, after commit.

Staff dashboards join the channel-layer group "dashboard" (inference/consumers.py) and fold each
event into their charts; they never reload whole figures. This module only announces the rows
(budgets.signals.ledger_rows_logged); the receiver that counts them in the metrics and sends their
points to the group lives in inference.

The announcement is batched per process: a committed row joins the batch, and a flusher thread
sends the whole batch in one signal within FLUSH_EVERY_S. One metrics script and one channel-layer
message per batch, where one each per request were ~0.8 ms of CPU of a ~3 ms admit+settle cycle
(docs/benchmarks.md, third pass). The ledger is never behind: only the dashboard and /metrics are,
by at most FLUSH_EVERY_S; a process that dies loses its unsent batch there (best effort, as a
failed send always was), never a ledger row. flush() sends at once (process exit, a scrape).
"""

from __future__ import annotations

import logging

from django.db import transaction

from . import refcache
from .batching import Batch
from .models import Feature, TokenLog
from .signals import ledger_rows_logged

log = logging.getLogger(__name__)

DASHBOARD_GROUP = "dashboard"
# Long enough for a busy process's rows to share a send (~50 at 1,000 requests/s), short next to
# anything a person watching a chart or a 15 s Prometheus scrape can notice.
FLUSH_EVERY_S = 0.05
MAX_BATCH = 500  # rows per signal: bounds one channel-layer message (~200 bytes a point)


def point_for(row: TokenLog, feature_name: str | None) -> dict:
    return {
        "type": "dashboard.point",
        "at": row.created_at.isoformat(),
        "feature": feature_name or "(none)",
        "status": row.status,
        "refusal_code": row.refusal_code,
        "tokens": row.prompt_tokens + row.completion_tokens,
        "cost_micro_usd": row.cost_micro_usd,
        "ttft_ms": row.ttft_ms,
        "total_ms": row.total_ms,
    }


def publish_on_commit(request_id: str, row: TokenLog | None = None) -> None:
    """Queue the event for after the current transaction; the ledger never waits on the dashboard.

    `row`: the row as the caller's last write left it (an UPDATE … RETURNING), so that the event
    need not read it again; without it, the row is read once committed.
    """
    transaction.on_commit(lambda: publish(request_id, row), robust=True)


def publish(request_id: str, row: TokenLog | None = None) -> None:
    """Add one settled or refused row to this process's batch; listeners hear of it within FLUSH_EVERY_S."""
    if row is None:
        row = TokenLog.objects.select_related("feature").filter(request_id=request_id).first()
        if row is None:
            return
    elif row.feature_id is not None and not TokenLog.feature.is_cached(row):
        row.feature = feature_by_id(row.feature_id)
    batch.add((row, point_for(row, row.feature.name if row.feature_id else None)))


def flush() -> None:
    """Announce everything this process has batched, now (before it exits; before a scrape reads)."""
    batch.flush()


def feature_by_id(feature_id: int) -> Feature:
    """From this process's reference cache: a feature is renamed a few times a year, finished every request."""
    return refcache.cache.get("feature_by_id", ("feature",), feature_id, lambda: Feature.objects.get(pk=feature_id))


def _announce(taken: list[tuple[TokenLog, dict]]) -> None:
    """One signal for the batch; send_robust: the rows are committed, a failing listener is only logged."""
    rows, points = [row for row, _ in taken], [point for _, point in taken]
    for receiver, result in ledger_rows_logged.send_robust(sender=TokenLog, rows=rows, points=points):
        if isinstance(result, Exception):
            # django.dispatch has logged the traceback; this line ties it to the ledger rows.
            log.warning("ledger_rows_logged receiver %s failed for %d row(s) (requests %s…)", _name(receiver),
                        len(rows), ", ".join(row.request_id for row in rows[:3]))


def _name(receiver: object) -> str:
    return getattr(receiver, "__qualname__", None) or repr(receiver)


batch: Batch[tuple[TokenLog, dict]] = Batch("ledger-announcer", _announce, FLUSH_EVERY_S, MAX_BATCH)
