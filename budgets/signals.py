"""Signals other apps listen to, so that budgets never imports them (budgets sits below inference).

ledger_row_logged
    Sent after the transaction commits, once per ledger row that was settled (finished, failed,
    served from a cache) or refused, with sender=TokenLog and two keyword arguments:

    row:   the TokenLog, its `feature` already selected (no query to read row.feature.name);
    point: the live dashboard's point for it, budgets.live.point_for(row, feature name), a dict
           ready to send to the DASHBOARD_GROUP channel-layer group.

    Sent with send_robust: a receiver that raises is logged and never breaks the ledger, and
    receivers must not block (the sender may be a worker between two decoding steps).
"""

from __future__ import annotations

from django.dispatch import Signal

ledger_row_logged = Signal()
