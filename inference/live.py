"""What inference does with every settled or refused ledger row: count it, and show it live.

budgets announces each row after commit (budgets.signals.ledger_row_logged) and knows nothing of
what listens; this module is the listener, connected when the app is ready (inference/apps.py):
the row goes into the Prometheus counters (inference/metrics.py), and its point to the staff
dashboards' channel-layer group (inference/consumers.py's DashboardConsumer).
"""

from __future__ import annotations

from budgets.live import DASHBOARD_GROUP
from budgets.models import TokenLog
from budgets.signals import ledger_row_logged

from .bus.outbox import channel_sender
from .metrics import record_settled


def on_ledger_row(sender, row: TokenLog, point: dict, **_: object) -> None:
    record_settled(row)  # the counters live in Redis; never raises
    # Fire and forget: the worker's next step must not wait on staff dashboards.
    channel_sender().group_send(DASHBOARD_GROUP, point, wait=False)


def connect() -> None:
    ledger_row_logged.connect(on_ledger_row, sender=TokenLog, dispatch_uid="inference.live.on_ledger_row")
