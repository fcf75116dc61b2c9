"""Loop budgets: a loop never makes more calls or spends more than it was given."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from budgets.actions import Usage, do_record_usage
from budgets.guard import settle
from budgets.loops import LoopBudgetExceeded, loop_budget
from budgets.models import ModelPrice, Provider, TokenLog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


def call_model(loop, feature, prompt_tokens: int, max_tokens: int, completion_tokens: int) -> TokenLog:
    """One iteration of a loop: admitted by the guard, then finished and settled like a real call."""
    decision = loop.admit(feature, "test-model", prompt_tokens, max_tokens)
    do_record_usage(decision.request_id, status=TokenLog.Status.OK, usage=Usage(prompt_tokens, completion_tokens))
    row = TokenLog.objects.get(request_id=decision.request_id)
    settle(row)
    return row


def test_a_loop_that_would_call_10_times_with_max_calls_3_makes_exactly_3(alice, chat_feature):
    calls = 0
    with loop_budget(alice, max_calls=3) as loop:
        with pytest.raises(LoopBudgetExceeded) as stopped:
            for _ in range(10):
                call_model(loop, chat_feature, 20, 10, 10)
                calls += 1
    assert calls == loop.calls == 3
    assert stopped.value.code == "loop_calls"
    rows = TokenLog.objects.filter(loop_id=loop.loop_id)
    assert rows.filter(status=TokenLog.Status.OK).count() == 3
    assert rows.filter(status=TokenLog.Status.REFUSED, refusal_code="loop_calls").count() == 1


def test_a_loop_stops_before_the_call_that_would_cross_its_spend(alice, chat_feature):
    ModelPrice.objects.create(
        provider=Provider.default(), model="test-model", input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=1_000_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")),
    )
    spent = []
    with loop_budget(alice, max_calls=None, max_cost_micro_usd=1_000) as loop:
        with pytest.raises(LoopBudgetExceeded) as stopped:
            for _ in range(10):
                spent.append(call_model(loop, chat_feature, 300, 100, 100).cost_micro_usd)
    # 400 µ$ per call: two fit in 1,000; the third's 300-token prompt alone would cross (800 + 300).
    assert spent == [400, 400]
    assert stopped.value.code == "loop_spend"
    assert sum(spent) <= 1_000


def test_a_loop_budget_needs_a_limit(alice):
    with pytest.raises(ValueError, match="needs max_calls"):
        with loop_budget(alice, max_calls=None):
            pass
    with pytest.raises(ValueError, match="at least 1"):
        with loop_budget(alice, max_calls=0):
            pass
