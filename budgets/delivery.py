"""How an alert's channels reach the task queue, without the actions importing the tasks.

The actions (budgets/actions.py) write an alert's outbox rows and, after commit, ask for each
channel to be sent; the Celery tasks that send them (budgets/tasks.py) sit above the actions and
call them. So the tasks module registers its senders here when it is imported, and the actions only
ever call down into this module. A process that has not imported the tasks yet (a web process
settling its first request) loads them by name at its first alert, not at start-up: they bring the
alert checks and forecasts, ~0.2 s of imports every process would otherwise pay.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

TASKS_MODULE = "budgets.tasks"

_senders: dict[str, Callable[[int], object]] = {}


def register(*, alert_email: Callable[[int], object], alert_webhook: Callable[[int], object]) -> None:
    _senders["alert_email"] = alert_email
    _senders["alert_webhook"] = alert_webhook


def queue_alert_email(alert_id: int) -> None:
    _sender("alert_email")(alert_id)


def queue_webhook(delivery_id: int) -> None:
    _sender("alert_webhook")(delivery_id)


def _sender(channel: str) -> Callable[[int], object]:
    if channel not in _senders:
        importlib.import_module(TASKS_MODULE)  # registers them (the bottom of budgets/tasks.py)
    return _senders[channel]
