"""The budget guard against real Redis and PostgreSQL: caps hold exactly under concurrency."""

from __future__ import annotations

import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from budgets.actions import Usage, do_record_usage
from budgets.guard import (
    AdmissionRequest,
    Decision,
    LoopLimits,
    admit,
    applicable_ceilings,
    counter_store,
    ledger_sums,
    settle,
)
from budgets.models import Feature, ModelPrice, Provider, Quota, TokenLog
from project import stack
from tests.conftest import _test_database_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:*"):
        if not key.startswith(b"ceiling:engine:"):
            redis_db.delete(key)
    yield


def request(user, feature, prompt=10, max_tokens=10, **extra) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, user, feature, "test-model", prompt, max_tokens, **extra)


def admit_in_threads(requests: list[AdmissionRequest], threads: int = 16) -> list[Decision]:
    def one(req):
        try:
            return admit(req)
        finally:
            connection.close()

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, requests))


def counter_and_ledger(user, feature, at=None):
    """(counter state, (ledger used, ledger reserved)) of the user's all-feature daily ceiling."""
    provider = Provider.default()
    [ceiling] = [c for c in applicable_ceilings(user, feature, provider, at or datetime.now(ZoneInfo("UTC"))) if c.scope == "user" and c.period == "day"]
    return counter_store().state(ceiling.spec.key), ledger_sums(ceiling.ledger_filter)


def finish(decision: Decision, completion_tokens: int, status=TokenLog.Status.OK) -> TokenLog:
    row = TokenLog.objects.get(request_id=decision.request_id)
    do_record_usage(row.request_id, status=status, usage=Usage(row.prompt_tokens, completion_tokens))
    row.refresh_from_db()
    settle(row)
    return row


def test_200_concurrent_admissions_from_threads_and_processes_admit_exactly_50(alice, chat_feature, settings):
    # 48 threads on 2 cores: give Redis round trips 2 s, so every refusal here is the cap's, not the
    # guard's fail-closed 0.1 s timeout (which has its own test below).
    settings.CEILING_GUARD_TIMEOUT_S = 2.0
    counter_store.cache_clear()
    Quota.objects.create(period="day", max_requests=50)
    env = stack.child_env(DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL, CEILING_GUARD_TIMEOUT_S="2")
    args = [str(alice.pk), str(chat_feature.pk), "50", "12", "10", "10"]
    processes = [
        subprocess.Popen([sys.executable, "-m", "tests.guard_load", *args], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    local = admit_in_threads([request(alice, chat_feature) for _ in range(50)], threads=12)
    remote = [__import__("json").loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in processes]

    admitted = sum(d.admitted for d in local) + sum(r["admitted"] for r in remote)
    refused = sum(not d.admitted for d in local) + sum(r["refused"] for r in remote)
    assert (admitted, refused) == (50, 150)
    assert {d.code for d in local if not d.admitted} <= {"user_requests_per_day"}
    assert TokenLog.objects.filter(status=TokenLog.Status.RUNNING, admitted=True).count() == 50
    assert TokenLog.objects.filter(status=TokenLog.Status.REFUSED, refusal_code="user_requests_per_day").count() == 150
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert state.reserved == reserved and state.used == used
    assert state.reserved.requests == 50
    counter_store.cache_clear()  # back to the configured timeout for the next test


def test_token_reservations_never_pass_the_cap_and_settle_to_actual_usage(alice, chat_feature):
    Quota.objects.create(period="day", max_tokens=50_000)
    decisions = admit_in_threads([request(alice, chat_feature, prompt=500, max_tokens=500) for _ in range(100)])
    admitted = [d for d in decisions if d.admitted]
    assert len(admitted) <= 50
    assert all(d.code == "user_tokens_per_day" for d in decisions if not d.admitted)

    rng = random.Random(7)
    actual = 0
    for decision in admitted:
        row = finish(decision, rng.randint(0, decision.max_tokens))
        actual += row.prompt_tokens + row.completion_tokens
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert state.used.tokens == actual == used.tokens
    assert state.reserved.tokens == 0 == reserved.tokens
    assert state.used.requests == len(admitted)


def test_max_tokens_is_cut_to_what_the_allowance_permits(alice, chat_feature):
    Quota.objects.create(period="day", max_tokens=1_000)
    first = admit(request(alice, chat_feature, prompt=300, max_tokens=500))
    second = admit(request(alice, chat_feature, prompt=100, max_tokens=500))
    third = admit(request(alice, chat_feature, prompt=100, max_tokens=500))
    assert first.max_tokens == 500
    assert second.max_tokens == 1_000 - 800 - 100
    assert not third.admitted and third.code == "user_tokens_per_day"
    assert "1,000 of your 1,000 tokens for today" in third.message


def test_the_same_request_id_admitted_10_times_at_once_is_admitted_once(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=100)
    same = request(alice, chat_feature)
    decisions = admit_in_threads([same] * 10, threads=10)
    assert sum(d.admitted for d in decisions) == 1
    assert {d.code for d in decisions if not d.admitted} == {"duplicate_request"}
    assert TokenLog.objects.filter(request_id=same.request_id).count() == 1

    winner = next(d for d in decisions if d.admitted)
    row = TokenLog.objects.get(request_id=same.request_id)
    do_record_usage(row.request_id, status=TokenLog.Status.OK, usage=Usage(10, 5))
    row.refresh_from_db()
    with ThreadPoolExecutor(5) as pool:
        settled = list(pool.map(lambda _: settle(row), range(5)))
    assert settled.count(True) == 1
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert state.used.requests == 1 == used.requests and state.used.tokens == 15
    assert state.reserved.requests == 0
    assert winner.request_id == same.request_id


def test_a_duplicate_inside_a_callers_transaction_leaves_that_transaction_usable(alice, chat_feature):
    # The ledger row is one INSERT; inside a transaction its unique-key failure must stay in a savepoint.
    Quota.objects.create(period="day", max_requests=100)
    same = request(alice, chat_feature)
    with transaction.atomic():
        assert admit(same).admitted
        again = admit(same)
        assert not again.admitted and again.code == "duplicate_request"
        assert TokenLog.objects.filter(request_id=same.request_id).count() == 1  # still usable
    assert TokenLog.objects.get(request_id=same.request_id).admitted


def test_an_integrity_failure_that_is_not_a_duplicate_is_raised_not_refused(alice, chat_feature):
    gone = Feature.objects.create(name="gone")
    gone_pk = gone.pk
    gone.delete()
    gone.pk = gone_pk  # an object whose row no longer exists: its foreign key fails
    with pytest.raises(IntegrityError):
        admit(request(alice, gone))
    assert not TokenLog.objects.filter(feature_id=gone_pk).exists()


def test_counters_wiped_under_load_are_rebuilt_from_the_ledger_with_no_overshoot(alice, chat_feature, redis_db):
    Quota.objects.create(period="day", max_requests=40)
    first = admit_in_threads([request(alice, chat_feature) for _ in range(20)])
    for decision in first[:10]:
        finish(decision, 3)
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)

    after = admit_in_threads([request(alice, chat_feature) for _ in range(60)])
    assert sum(d.admitted for d in first) + sum(d.admitted for d in after) == 40
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    assert used.requests + reserved.requests == 40


def test_a_real_flushall_under_load_admits_nothing_extra(alice, chat_feature, settings, tmp_path):
    """A private redis-server, FLUSHALLed while 16 threads are admitting: the cap still holds exactly."""
    import threading

    import redis as redis_lib

    server, url = stack.start_private_redis(tmp_path)
    settings.REDIS_URL = url
    counter_store.cache_clear()
    try:
        Quota.objects.create(period="day", max_requests=60)
        flushed = threading.Event()

        def flush_soon():
            time.sleep(0.05)
            redis_lib.Redis.from_url(url).flushall()
            flushed.set()

        flusher = threading.Thread(target=flush_soon)
        flusher.start()
        decisions = admit_in_threads([request(alice, chat_feature) for _ in range(150)])
        flusher.join()
        assert flushed.is_set()
        assert sum(d.admitted for d in decisions) == 60
        state, (used, reserved) = counter_and_ledger(alice, chat_feature)
        assert (state.used, state.reserved) == (used, reserved)
        assert reserved.requests == 60
    finally:
        counter_store.cache_clear()
        stack.stop_all([server])


def test_unreachable_redis_refuses_fast_with_guard_unavailable(alice, chat_feature, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{stack.free_port()}/0"
    counter_store.cache_clear()
    try:
        started = time.perf_counter()
        decision = admit(request(alice, chat_feature))
        elapsed = time.perf_counter() - started
    finally:
        counter_store.cache_clear()
    assert not decision.admitted and decision.code == "guard_unavailable"
    assert elapsed < 0.3
    assert "try again" in decision.message
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert row.status == TokenLog.Status.REFUSED and row.refusal_code == "guard_unavailable"


def test_a_user_capped_today_is_admitted_after_midnight(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=2)
    zone = ZoneInfo(settings.TIME_ZONE)
    evening = datetime(2026, 12, 2, 23, 58, tzinfo=zone)
    assert admit(request(alice, chat_feature), now=evening).admitted
    assert admit(request(alice, chat_feature), now=evening).admitted
    refused = admit(request(alice, chat_feature), now=evening + timedelta(minutes=1))
    assert refused.code == "user_requests_per_day"
    assert refused.retry_after_s == 61
    assert "resets at 00:00" in refused.message and "in 1 min" in refused.message
    assert admit(request(alice, chat_feature), now=evening + timedelta(minutes=3)).admitted


def test_user_override_beats_the_default_and_feature_caps_add_up(alice, bob, chat_feature):
    Quota.objects.create(period="day", max_requests=1)
    Quota.objects.create(user=alice, period="day", max_requests=3)
    Quota.objects.create(feature=chat_feature, period="day", max_requests=2)
    alice_results = [admit(request(alice, chat_feature)).admitted for _ in range(3)]
    bob_results = [admit(request(bob, chat_feature)).admitted for _ in range(2)]
    assert alice_results == [True, True, False]  # the per-feature cap of 2 bites first
    assert bob_results == [True, False]  # the default of 1


def test_cost_caps_use_the_price_in_force(alice, chat_feature):
    provider = Provider.default()
    ModelPrice.objects.create(
        provider=provider, model="test-model", input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=2_000_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")),
    )
    Quota.objects.create(period="month", max_cost_micro_usd=1_000)  # $0.001
    # 100 prompt tokens cost 100 µ$; 500 output tokens would cost 1,000 µ$: cut to what fits (450).
    decision = admit(request(alice, chat_feature, prompt=100, max_tokens=500))
    assert decision.admitted and decision.max_tokens == 450
    row = finish(decision, 200)
    assert row.cost_micro_usd == 100 + 400 and row.price.output_per_million_micro_usd == 2_000_000
    # 500 µ$ left: 300 prompt tokens fit with 100 output tokens; 600 prompt tokens do not fit at all.
    assert admit(request(alice, chat_feature, prompt=300, max_tokens=500)).max_tokens == 100
    refused = admit(request(alice, chat_feature, prompt=600, max_tokens=10))
    assert refused.code == "user_cost_per_month"
    assert "for this month" in refused.message


def test_provider_spend_limit_refuses_at_100_percent(alice, chat_feature):
    provider = Provider.default()
    provider.monthly_limit_micro_usd = 300
    provider.save()
    ModelPrice.objects.create(
        provider=provider, model="test-model", input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=1_000_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")),
    )
    first = admit(request(alice, chat_feature, prompt=100, max_tokens=200))
    assert first.admitted
    finish(first, 200)
    refused = admit(request(alice, chat_feature, prompt=10, max_tokens=10))
    assert refused.code == "provider_spend" and "'local'" in refused.message and "Requests resume on 1 " in refused.message


def test_a_loop_budget_caps_calls(alice, chat_feature):
    loop = LoopLimits("loop-1", max_calls=3, max_cost_micro_usd=None)
    results = []
    for _ in range(10):
        decision = admit(request(alice, chat_feature, loop=loop))
        results.append(decision.code or "ok")
        if decision.admitted:
            finish(decision, 2)
    assert results == ["ok"] * 3 + ["loop_calls"] * 7


def test_nearing_a_cap_comes_with_a_warning(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=5)
    warnings = [admit(request(alice, chat_feature)).warning for _ in range(5)]
    assert warnings[:3] == ["", "", ""]
    assert warnings[3].startswith("You have used 80% of today's requests")
    assert "100%" in warnings[4]


def test_reconciliation_fails_lost_requests_and_frees_their_reservations(alice, chat_feature):
    from budgets.reconcile import release_lost_requests

    Quota.objects.create(period="day", max_requests=2)
    noon = datetime(2026, 12, 2, 12, 0, tzinfo=ZoneInfo(settings.TIME_ZONE))
    later = noon + timedelta(seconds=settings.CEILING_RESERVATION_TTL_S + 60)
    lost = [admit(request(alice, chat_feature), now=noon) for _ in range(2)]
    assert all(d.admitted for d in lost)
    assert admit(request(alice, chat_feature), now=later).code == "user_requests_per_day"

    assert release_lost_requests(now=later) == 2
    assert release_lost_requests(now=later) == 0  # a second pass changes nothing
    rows = TokenLog.objects.filter(request_id__in=[d.request_id for d in lost])
    assert {r.status for r in rows} == {TokenLog.Status.FAILED}
    assert all("no worker finished" in r.error for r in rows)
    state, (used, reserved) = counter_and_ledger(alice, chat_feature, at=later)
    assert state.reserved.requests == 0 and (state.used, state.reserved) == (used, reserved)


def test_a_settle_that_could_not_reach_redis_is_retried_by_reconciliation(alice, chat_feature, settings):
    from budgets.reconcile import retry_unsettled

    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))
    do_record_usage(decision.request_id, status=TokenLog.Status.OK, usage=Usage(10, 4))
    row = TokenLog.objects.get(request_id=decision.request_id)

    real_url = settings.REDIS_URL
    settings.REDIS_URL = f"redis://127.0.0.1:{stack.free_port()}/0"
    counter_store.cache_clear()
    try:
        assert settle(row) is False
    finally:
        settings.REDIS_URL = real_url
        counter_store.cache_clear()
    row.refresh_from_db()
    assert not row.counters_settled
    state, _ = counter_and_ledger(alice, chat_feature)
    assert state.reserved.requests == 1  # still held: Redis never heard of the settle

    assert retry_unsettled(now=row.finished_at + timedelta(minutes=1)) == 1
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved) and state.reserved.requests == 0
    assert retry_unsettled(now=row.finished_at + timedelta(minutes=2)) == 0


def test_settled_marks_are_written_together_shortly_after_the_settles(alice, chat_feature):
    from budgets import guard

    Quota.objects.create(period="day", max_requests=10)
    rows = []
    for _ in range(3):
        decision = admit(request(alice, chat_feature))
        rows.append(do_record_usage(decision.request_id, status=TokenLog.Status.OK, usage=Usage(10, 4)))
    for row in rows:
        assert settle(row) is True and row.counters_settled

    # No flush: the process's thread writes them, in one UPDATE, within SETTLED_MARKS_EVERY_S.
    deadline = time.monotonic() + 5
    while TokenLog.objects.filter(pk__in=[r.pk for r in rows], counters_settled=True).count() < 3:
        assert time.monotonic() < deadline, "the settled marks were never written"
        time.sleep(guard.SETTLED_MARKS_EVERY_S)


def test_settled_marks_lost_with_their_process_are_written_by_reconciliation(alice, chat_feature):
    """A process that dies holding marks loses them; the counters were settled, so reconciliation
    settles again (no change: the settled marker) and writes the mark."""
    from budgets import guard
    from budgets.reconcile import retry_unsettled

    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))
    row = do_record_usage(decision.request_id, status=TokenLog.Status.OK, usage=Usage(10, 4))
    assert settle(row) is True
    guard.flush_settled_marks()
    # What a process killed before its batch was written leaves: counters settled, the row unmarked.
    TokenLog.objects.filter(pk=row.pk).update(counters_settled=False)
    before, _ = counter_and_ledger(alice, chat_feature)
    assert not TokenLog.objects.get(pk=row.pk).counters_settled

    assert retry_unsettled(now=row.finished_at + timedelta(minutes=1)) == 1

    after, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert after == before and (after.used, after.reserved) == (used, reserved)
    assert TokenLog.objects.get(pk=row.pk).counters_settled


def test_an_admission_whose_reply_was_lost_is_released(alice, chat_feature):
    """The admit script ran but the reply timed out: the row says guard_unavailable, Redis holds a
    reservation. Reconciliation releases it without counting anything as used."""
    from budgets.reconcile import retry_unsettled

    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))
    lost_at = timezone.now()
    TokenLog.objects.filter(request_id=decision.request_id).update(
        status=TokenLog.Status.REFUSED, refusal_code="guard_unavailable", admitted=False, finished_at=lost_at,
    )
    assert retry_unsettled(now=lost_at + timedelta(minutes=1)) == 1
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert state.reserved.requests == 0 and state.used.requests == 0 == used.requests
