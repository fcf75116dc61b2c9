"""How an alert's channels reach the task queue, without the actions importing the tasks.

The actions (budgets/actions.py) write an alert's outbox rows and, after commit, ask for each
channel to be sent; the Celery tasks that send them (budgets/tasks.py) sit above the actions and
call them. So the tasks module registers its senders here when it is imported (BudgetsConfig.ready
imports it in every process), and the actions only ever call down into this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

_senders: dict[str, Callable[[int], object]] = {}


def register(*, alert_email: Callable[[int], object], alert_webhook: Callable[[int], object]) -> None:
    _senders["alert_email"] = alert_email
    _senders["alert_webhook"] = alert_webhook


def queue_alert_email(alert_id: int) -> None:
    _queue("alert_email", alert_id)


def queue_webhook(delivery_id: int) -> None:
    _queue("alert_webhook", delivery_id)


def _queue(channel: str, row_id: int) -> None:
    send = _senders.get(channel)
    if send is None:  # budgets.tasks never imported: the row stays unsent, and the sweeper queues it
        log.warning("no sender registered for %s %s; the reconciliation sweep will queue it", channel, row_id)
        return
    send(row_id)
