"""budgets.signals.ledger_rows_logged: sent after commit, batched per process, with the rows and
their dashboard points; a receiver that raises is logged and never reaches the code that wrote the
ledger."""

from __future__ import annotations

import logging
import threading
import uuid

from django.db import transaction

from budgets import live
from budgets.actions import do_log_refusal
from budgets.models import TokenLog
from budgets.signals import ledger_rows_logged


def refuse(user, feature) -> str:
    request_id = str(uuid.uuid4())
    do_log_refusal(request_id=request_id, user=user, feature=feature, model="m", code="feature_disabled", message="off")
    return request_id


def test_a_refusal_is_announced_after_commit_even_past_a_failing_receiver(alice, chat_feature, caplog):
    heard = []

    def broken(sender, **kwargs):
        raise RuntimeError("listener down")

    def listening(sender, rows, points, **kwargs):
        heard.append((sender, rows, points))

    ledger_rows_logged.connect(broken, dispatch_uid="test-broken")
    ledger_rows_logged.connect(listening, dispatch_uid="test-listening")
    try:
        # The fixtures use transactional_db: this atomic block really commits, as a caller's would.
        with caplog.at_level(logging.WARNING), transaction.atomic():
            request_id = refuse(alice, chat_feature)
            live.flush()
            assert not heard  # not before the commit
        with caplog.at_level(logging.WARNING):
            live.flush()
    finally:
        ledger_rows_logged.disconnect(dispatch_uid="test-broken")
        ledger_rows_logged.disconnect(dispatch_uid="test-listening")

    [(sender, [row], [point])] = heard
    assert sender is TokenLog and row.request_id == request_id
    assert point["feature"] == "chat" and point["status"] == TokenLog.Status.REFUSED
    assert point["refusal_code"] == "feature_disabled"
    assert f"failed for 1 row(s) (requests {request_id}" in caplog.text


def test_rows_committed_together_are_announced_in_one_batch_by_the_flusher(alice, chat_feature):
    batches = []
    announced = threading.Event()

    def listening(sender, rows, points, **kwargs):
        batches.append([row.request_id for row in rows])
        announced.set()

    live.flush()  # nothing of an earlier test in the batch
    ledger_rows_logged.connect(listening, dispatch_uid="test-batch")
    try:
        with transaction.atomic():  # their announcements are queued within microseconds of each other
            request_ids = [refuse(alice, chat_feature) for _ in range(3)]
        # No flush(): the process's flusher thread sends them within FLUSH_EVERY_S.
        assert announced.wait(5)
    finally:
        ledger_rows_logged.disconnect(dispatch_uid="test-batch")
        live.flush()

    assert batches == [request_ids]
