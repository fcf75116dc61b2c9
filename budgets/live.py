"""Live dashboard increments: one small event per settled or refused request, after commit.

Staff dashboards join the channel-layer group "dashboard" (budgets/consumers.py) and fold each
event into their charts; they never reload whole figures.
"""

from __future__ import annotations

import logging

from django.db import transaction

from .models import TokenLog

log = logging.getLogger(__name__)

DASHBOARD_GROUP = "dashboard"


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


def publish_on_commit(request_id: str) -> None:
    """Queue the event for after the current transaction; the ledger never waits on the dashboard."""
    transaction.on_commit(lambda: publish(request_id), robust=True)


def publish(request_id: str) -> None:
    from inference.bus import channel_sender  # one event loop per process for channel-layer sends
    from inference.metrics import record_settled

    row = TokenLog.objects.select_related("feature").filter(request_id=request_id).first()
    if row is None:
        return
    record_settled(row)  # the Prometheus counters in Redis (inference/metrics.py); never raises
    # Fire and forget: the worker's next step must not wait on staff dashboards.
    channel_sender().group_send(DASHBOARD_GROUP, point_for(row, row.feature.name if row.feature else None), wait=False)
