"""budgets.signals.ledger_row_logged: sent after commit with the row and its dashboard point; a
receiver that raises is logged and never reaches the code that wrote the ledger."""

from __future__ import annotations

import logging
import uuid

from django.db import transaction

from budgets.actions import do_log_refusal
from budgets.models import TokenLog
from budgets.signals import ledger_row_logged


def test_a_refusal_is_announced_after_commit_even_past_a_failing_receiver(alice, chat_feature, caplog):
    heard = []

    def broken(sender, **kwargs):
        raise RuntimeError("listener down")

    def listening(sender, row, point, **kwargs):
        heard.append((sender, row, point))

    ledger_row_logged.connect(broken, dispatch_uid="test-broken")
    ledger_row_logged.connect(listening, dispatch_uid="test-listening")
    request_id = str(uuid.uuid4())
    try:
        # The fixtures use transactional_db: this atomic block really commits, as a caller's would.
        with caplog.at_level(logging.WARNING), transaction.atomic():
            do_log_refusal(request_id=request_id, user=alice, feature=chat_feature, model="m", code="feature_disabled",
                           message="off")
            assert not heard  # not before the commit
    finally:
        ledger_row_logged.disconnect(dispatch_uid="test-broken")
        ledger_row_logged.disconnect(dispatch_uid="test-listening")

    [(sender, row, point)] = heard
    assert sender is TokenLog and row.request_id == request_id
    assert point["feature"] == "chat" and point["status"] == TokenLog.Status.REFUSED
    assert point["refusal_code"] == "feature_disabled"
    assert f"failed for request {request_id}" in caplog.text
