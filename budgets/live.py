"""Live dashboard increments: one small event per settled or refused request, after commit.

Staff dashboards join the channel-layer group "dashboard" (inference/consumers.py) and fold each
event into their charts; they never reload whole figures. This module only announces the row
(budgets.signals.ledger_row_logged); the receiver that sends it to the group lives in inference.
"""

from __future__ import annotations

import logging

from django.db import transaction

from . import refcache
from .models import Feature, TokenLog
from .signals import ledger_row_logged

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


def publish_on_commit(request_id: str, row: TokenLog | None = None) -> None:
    """Queue the event for after the current transaction; the ledger never waits on the dashboard.

    `row`: the row as the caller's last write left it (an UPDATE … RETURNING), so that the event
    need not read it again; without it, the row is read once committed.
    """
    transaction.on_commit(lambda: publish(request_id, row), robust=True)


def publish(request_id: str, row: TokenLog | None = None) -> None:
    """Tell listeners (inference: Prometheus counters, the dashboard group) about one settled or refused row.

    A signal rather than a call, so budgets imports nothing of inference. send_robust, because
    the row is already committed: a failing listener must never surface in the ledger's caller.
    """
    if row is None:
        row = TokenLog.objects.select_related("feature").filter(request_id=request_id).first()
        if row is None:
            return
    elif row.feature_id is not None and not TokenLog.feature.is_cached(row):
        row.feature = feature_by_id(row.feature_id)
    point = point_for(row, row.feature.name if row.feature_id else None)
    for receiver, result in ledger_row_logged.send_robust(sender=TokenLog, row=row, point=point):
        if isinstance(result, Exception):
            # django.dispatch has logged the traceback; this line ties it to the ledger row.
            log.warning("ledger_row_logged receiver %s failed for request %s", _name(receiver), request_id)


def feature_by_id(feature_id: int) -> Feature:
    """From this process's reference cache: a feature is renamed a few times a year, finished every request."""
    return refcache.cache.get("feature_by_id", ("feature",), feature_id, lambda: Feature.objects.get(pk=feature_id))


def _name(receiver: object) -> str:
    return getattr(receiver, "__qualname__", None) or repr(receiver)
