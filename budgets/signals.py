"""Signals other apps listen to, so that budgets never imports them (budgets sits below inference).

ledger_rows_logged
    Sent after the transactions commit, for ledger rows that were settled (finished, failed,
    served from a cache) or refused: batched per process, each row within budgets.live.FLUSH_EVERY_S
    of its commit, from the process's announcer thread (budgets.live.flush() sends at once). With
    sender=TokenLog and two keyword arguments, in the same order:

    rows:   the TokenLogs, each with its `feature` already selected (no query to read row.feature.name);
    points: the live dashboard's point for each, budgets.live.point_for(row, feature name), dicts
            ready to send to the DASHBOARD_GROUP channel-layer group.

    Sent with send_robust: a receiver that raises is logged and never breaks the ledger, and
    receivers must not block for long (the next batch waits behind them).
"""

from __future__ import annotations

from django.dispatch import Signal

ledger_rows_logged = Signal()
