"""A request admitted but never claimed by any worker (its task died prefetched in a killed worker)
and whose web process died too: the live workers' sweep settles it past the first-token timeout,
releasing its reservation, instead of holding it for the 600 s reconciliation."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from budgets.models import Quota, TokenLog
from inference.actions import do_admit_request
from inference.bus.ownership import RUNNING_KEY
from inference.bus.stats import STATS_KEY_PREFIX
from inference.worker.lost import UNCLAIMED_GRACE_S, settle_requests_never_picked_up
from tests.faults import daily_counter_and_ledger

pytestmark = pytest.mark.django_db(transaction=True)


def admitted(user, feature, *, seconds_ago: float) -> str:
    request_id = uuid.uuid4().hex
    decision = do_admit_request(
        request_id=request_id, user=user, feature=feature, model="m",
        messages=[{"role": "user", "content": "Hi"}], prompt_ids=[1, 2, 3], max_tokens=16,
    )
    assert decision.admitted, decision.message
    TokenLog.objects.filter(request_id=request_id).update(created_at=timezone.now() - timedelta(seconds=seconds_ago))
    return request_id


def test_an_unclaimed_request_past_the_first_token_timeout_is_settled_and_its_reservation_released(
    redis_db, alice, chat_feature
):
    Quota.objects.create(period="day", max_requests=10)
    past_waiting = settings.CEILING_FIRST_TOKEN_TIMEOUT_S + UNCLAIMED_GRACE_S + 5
    lost = admitted(alice, chat_feature, seconds_ago=past_waiting)
    young = admitted(alice, chat_feature, seconds_ago=1)  # its web process may still settle it
    claimed = admitted(alice, chat_feature, seconds_ago=past_waiting)  # a worker runs it: its sweep's business
    redis_db.hset(RUNNING_KEY.format(claimed), mapping={"worker": "someone", "tokens": 0, "inbox": ""})
    # A live worker's heartbeat, so the test stack's own sweep of dead workers' requests leaves it alone.
    redis_db.set(f"{STATS_KEY_PREFIX}someone", "{}", ex=60)
    try:
        assert settle_requests_never_picked_up() == 1
        assert settle_requests_never_picked_up() == 0  # settled once, whatever sweeps again

        row = TokenLog.objects.get(request_id=lost)
        assert row.status == TokenLog.Status.FAILED and row.completion_tokens == 0
        assert "no worker picked this request up" in row.error
        assert TokenLog.objects.get(request_id=young).status == TokenLog.Status.RUNNING
        assert TokenLog.objects.get(request_id=claimed).status == TokenLog.Status.RUNNING
        state, (used, reserved) = daily_counter_and_ledger(redis_db, alice, chat_feature)
        assert (state.used, state.reserved) == (used, reserved)  # counters = ledger
        assert reserved.requests == 2 and used.requests == 1  # the lost one counts as asked, its hold is gone
    finally:
        redis_db.delete(RUNNING_KEY.format(claimed), f"{STATS_KEY_PREFIX}someone")


def test_rows_older_than_the_reservation_ttl_are_left_to_the_reconciliation(redis_db, alice, chat_feature):
    old = admitted(alice, chat_feature, seconds_ago=settings.CEILING_RESERVATION_TTL_S + 60)
    assert settle_requests_never_picked_up() == 0
    assert TokenLog.objects.get(request_id=old).status == TokenLog.Status.RUNNING


def test_a_row_whose_web_process_died_mid_admission_is_settled_and_its_reservation_released(
    redis_db, alice, chat_feature
):
    """Reserved in Redis, but the process died before the row was marked admitted (and so before any
    dispatch): nothing would ever claim it."""
    Quota.objects.create(period="day", max_requests=10)
    request_id = admitted(alice, chat_feature, seconds_ago=settings.CEILING_FIRST_TOKEN_TIMEOUT_S + UNCLAIMED_GRACE_S + 5)
    TokenLog.objects.filter(request_id=request_id).update(admitted=False)

    assert settle_requests_never_picked_up() == 1
    row = TokenLog.objects.get(request_id=request_id)
    # Never admitted, never served: refused (not counted), not failed (which would count as used).
    assert (row.status, row.refusal_code) == (TokenLog.Status.REFUSED, "admission_interrupted")
    assert "no worker picked this request up" in row.error
    state, (used, reserved) = daily_counter_and_ledger(redis_db, alice, chat_feature)
    assert state.reserved.requests == 0  # the reservation the dead process made is gone
    assert (state.used, state.reserved) == (used, reserved)  # and counters = ledger


def test_a_live_answer_whose_claim_redis_lost_is_not_taken_for_one_never_picked_up(redis_db, alice, chat_feature):
    """Before: a healthy answer streaming past the first-token timeout, its claim lost with a Redis
    restart, was failed by the sweep (unbilled, and its user got an error after the whole answer)."""
    from inference.bus import ownership, stats

    streaming = admitted(alice, chat_feature, seconds_ago=settings.CEILING_FIRST_TOKEN_TIMEOUT_S + UNCLAIMED_GRACE_S + 5)
    stats.heartbeat.set()  # this process is the worker that runs it
    try:
        ownership.claim_request(streaming, settings.CEILING_RESERVATION_TTL_S)
        redis_db.delete(RUNNING_KEY.format(streaming))  # Redis lost the claim

        assert settle_requests_never_picked_up() == 0
        assert TokenLog.objects.get(request_id=streaming).status == TokenLog.Status.RUNNING
        # With its next heartbeat the worker puts the claim back, so other workers' sweeps see it too.
        assert ownership.reassert_claims() == 1 and redis_db.exists(RUNNING_KEY.format(streaming))
        assert ownership.reassert_claims() == 0
    finally:
        ownership.release_claim(streaming)
        stats.heartbeat.clear()
    assert not ownership.holds(streaming)
