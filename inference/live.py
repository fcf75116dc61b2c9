"""What inference does with every settled or refused ledger row: count it, and show it live.

budgets announces the rows after commit, batched per process (budgets.signals.ledger_rows_logged)
and knows nothing of what listens; this module is the listener, connected when the app is ready
(inference/apps.py): a batch's rows go into the Prometheus counters in one script
(inference/metrics.py), and their points to the staff dashboards' channel-layer group in one
message (inference/consumers.py's DashboardConsumer sends each point on to its socket).
"""

from __future__ import annotations

from budgets.live import DASHBOARD_GROUP
from budgets.models import TokenLog
from budgets.signals import ledger_rows_logged

from .bus.outbox import channel_sender
from .metrics import record_settled_many


def on_ledger_rows(sender, rows: list[TokenLog], points: list[dict], **_: object) -> None:
    record_settled_many(rows)  # the counters live in Redis; never raises
    # Fire and forget: the next batch must not wait on staff dashboards.
    channel_sender().group_send(DASHBOARD_GROUP, {"type": "dashboard.points", "points": points}, wait=False)


def connect() -> None:
    ledger_rows_logged.connect(on_ledger_rows, sender=TokenLog, dispatch_uid="inference.live.on_ledger_rows")
