"""The guard as a state machine: admissions, settles, cancels, lost workers and Redis wipes in any order.

Hypothesis drives the real guard (budgets.guard and its Lua scripts) against the real Redis and the
real database. After every step the ledger must stay under the cap, and the Redis counter, whenever
it exists, must equal what the ledger says.
"""

from __future__ import annotations

import uuid
from dataclasses import astuple, dataclass
from datetime import datetime, timedelta

import hypothesis
import pytest
from django.conf import settings as django_settings
from django.utils import timezone
from hypothesis import HealthCheck
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from budgets.actions import Usage, do_record_usage
from budgets.counters import CounterState, Limits
from budgets.counters import Usage as CounterUsage
from budgets.guard import AdmissionRequest, Ceiling, admit, applicable_ceilings, counter_store, ledger_sums, settle
from budgets.models import Period, Provider, Quota, TokenLog
from budgets.reconcile import release_lost_requests

MODEL = "test-model"
MACHINE_SETTINGS = hypothesis.settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the tree
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Admitted:
    request_id: str
    prompt_tokens: int
    granted: int


def wipe_counters(client) -> None:
    """What a Redis restart does to the guard: every counter is gone."""
    keys = list(client.scan_iter(match="ceiling:c:*"))
    if keys:
        client.delete(*keys)


def expected_admission(cap: Limits, prompt_tokens: int, asked: int, ledger: tuple[CounterUsage, CounterUsage]) -> int | str:
    """What the ledger says the guard must answer: the max_tokens it grants, or the refusal code."""
    used, reserved = ledger
    if cap.requests is not None and used.requests + reserved.requests + 1 > cap.requests:
        return "user_requests_per_day"
    room = cap.tokens - used.tokens - reserved.tokens - prompt_tokens
    if room < 1:
        return "user_tokens_per_day"
    return min(asked, room)


def user_day_ceiling(user, feature, at: datetime) -> Ceiling:
    [ceiling] = applicable_ceilings(user, feature, Provider.default(), at)
    assert ceiling.scope == "user" and ceiling.period == Period.DAY
    return ceiling


class GuardMachine(RuleBasedStateMachine):
    # Hypothesis builds the machines itself, so the test hands its fixtures over here.
    user = None
    feature = None
    redis = None

    def __init__(self) -> None:
        super().__init__()
        # One instant for every admission, so a run that crosses midnight still lives in one day.
        self.now = timezone.now()
        self.running: dict[str, Admitted] = {}
        self.finished: list[Admitted] = []
        self.request_ids: list[str] = []

    @initialize(max_tokens=st.integers(1000, 5000), max_requests=st.none() | st.integers(1, 12))
    def clean_slate(self, max_tokens: int, max_requests: int | None) -> None:
        TokenLog.objects.all().delete()
        Quota.objects.all().delete()
        wipe_counters(self.redis)
        Quota.objects.create(user=None, feature=None, period=Period.DAY, max_tokens=max_tokens, max_requests=max_requests)
        self.cap = Limits(requests=max_requests, tokens=max_tokens)
        self.ceiling = user_day_ceiling(self.user, self.feature, self.now)

    def teardown(self) -> None:
        store = counter_store()
        markers = [m for rid in self.request_ids for m in (store.admitted_marker(rid), store.settled_marker(rid))]
        if markers:
            self.redis.delete(*markers)
        wipe_counters(self.redis)

    # --- rules ----------------------------------------------------------------------------------

    @rule(prompt_tokens=st.integers(1, 600), max_tokens=st.integers(1, 800))
    def reserve(self, prompt_tokens: int, max_tokens: int) -> None:
        expected = expected_admission(self.cap, prompt_tokens, max_tokens, self.ledger())
        request_id = uuid.uuid4().hex
        self.request_ids.append(request_id)
        request = AdmissionRequest(request_id, self.user, self.feature, MODEL, prompt_tokens, max_tokens)
        decision = admit(request, now=self.now)
        row = TokenLog.objects.get(request_id=request_id)
        hypothesis.event("admission", decision.code or ("cut" if decision.max_tokens < max_tokens else "granted in full"))
        if isinstance(expected, str):
            assert (decision.admitted, decision.code) == (False, expected), decision.message
            assert row.status == TokenLog.Status.REFUSED and row.reserved_tokens == 0
            return
        assert decision.admitted, decision.message
        assert decision.max_tokens == expected
        assert row.status == TokenLog.Status.RUNNING and row.admitted
        assert row.reserved_tokens == prompt_tokens + expected
        self.running[request_id] = Admitted(request_id, prompt_tokens, expected)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        request = self.pick_running(data)
        completion = data.draw(st.integers(0, request.granted), label="completion_tokens")
        self.settle(request, TokenLog.Status.OK, completion)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        request = self.pick_running(data)
        completion = data.draw(st.integers(0, request.granted - 1), label="completion_tokens")
        self.settle(request, TokenLog.Status.CANCELLED, completion)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def expire(self, data) -> None:
        """A lost worker, one request at a time: failed with no completion tokens, then settled."""
        self.settle(self.pick_running(data), TokenLog.Status.FAILED, 0)

    @precondition(lambda self: self.running)
    @rule()
    def reconcile(self) -> None:
        """The real reconciliation pass, once every running request is past the reservation TTL."""
        later = self.now + timedelta(seconds=django_settings.CEILING_RESERVATION_TTL_S + 1)
        assert release_lost_requests(now=later) == len(self.running)
        self.finished += self.running.values()
        self.running.clear()

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def replay(self, data) -> None:
        """A redelivered task settles again: neither the ledger nor the counter may move."""
        request = data.draw(st.sampled_from(self.finished), label="request")
        usage = Usage(request.prompt_tokens, request.granted)
        assert not do_record_usage(request.request_id, status=TokenLog.Status.OK, usage=usage)
        assert not settle(TokenLog.objects.get(request_id=request.request_id))

    @precondition(lambda self: self.counter() is not None)  # wiping nothing is a wasted step
    @rule()
    def wipe(self) -> None:
        """Redis restarts empty; the next admission must rebuild the counter from the ledger."""
        wipe_counters(self.redis)

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def nothing_is_negative(self) -> None:
        used, reserved = self.ledger()
        assert min(astuple(used) + astuple(reserved)) >= 0
        state = self.counter()
        if state is not None:
            assert min(astuple(state.used) + astuple(state.reserved)) >= 0, state

    @invariant()
    def the_cap_holds(self) -> None:
        used, reserved = self.ledger()
        assert used.tokens + reserved.tokens <= self.cap.tokens
        if self.cap.requests is not None:
            assert used.requests + reserved.requests <= self.cap.requests

    @invariant()
    def the_ledger_knows_every_request(self) -> None:
        used, reserved = self.ledger()
        assert reserved.requests == len(self.running)
        assert used.requests == len(self.finished)
        assert reserved.tokens == sum(r.prompt_tokens + r.granted for r in self.running.values())

    @invariant()
    def the_counter_is_the_ledger(self) -> None:
        # A wiped counter has nothing to compare; the ledger alone is checked above until a rebuild.
        state = self.counter()
        if state is not None:
            assert (state.used, state.reserved) == self.ledger()

    # --- helpers --------------------------------------------------------------------------------

    def ledger(self) -> tuple[CounterUsage, CounterUsage]:
        return ledger_sums(self.ceiling.ledger_filter)

    def counter(self) -> CounterState | None:
        return counter_store().state(self.ceiling.spec.key)

    def pick_running(self, data) -> Admitted:
        # In admission order: the ids are random uuids, and Hypothesis needs the same choice to pick
        # the same request when it replays an example.
        return data.draw(st.sampled_from(list(self.running.values())), label="request")

    def settle(self, request: Admitted, status: str, completion_tokens: int) -> None:
        """What a worker (or reconciliation) does: record the usage in the ledger, then settle Redis."""
        usage = Usage(request.prompt_tokens, completion_tokens)
        assert do_record_usage(request.request_id, status=status, usage=usage)
        assert settle(TokenLog.objects.get(request_id=request.request_id))
        del self.running[request.request_id]
        self.finished.append(request)


@pytest.fixture
def patient_guard(settings):
    # The guard's 0.1 s Redis timeout makes production fail fast; on a loaded 2-core test machine one
    # slow reply would turn into a spurious guard_unavailable here, so this test waits longer.
    settings.CEILING_GUARD_TIMEOUT_S = 5.0
    counter_store.cache_clear()
    yield
    counter_store.cache_clear()


@pytest.fixture
def guard_keys_removed(redis_db):
    """Counters and markers go when the test ends: the next test starts from an empty guard."""
    yield
    for pattern in ("ceiling:c:*", "ceiling:admitted:*", "ceiling:settled:*"):
        keys = list(redis_db.scan_iter(match=pattern))
        if keys:
            redis_db.delete(*keys)


@pytest.mark.django_db(transaction=True)
def test_guard_state_machine(alice, chat_feature, redis_db, patient_guard):
    GuardMachine.user, GuardMachine.feature, GuardMachine.redis = alice, chat_feature, redis_db
    try:
        run_state_machine_as_test(GuardMachine, settings=MACHINE_SETTINGS)
    finally:
        GuardMachine.user = GuardMachine.feature = GuardMachine.redis = None


def admitted(user, feature, prompt_tokens: int, max_tokens: int, now: datetime) -> TokenLog:
    decision = admit(AdmissionRequest(uuid.uuid4().hex, user, feature, MODEL, prompt_tokens, max_tokens), now=now)
    assert decision.admitted, decision.message
    return TokenLog.objects.get(request_id=decision.request_id)


@pytest.mark.django_db(transaction=True)
def test_a_counter_rebuilt_between_the_ledger_write_and_the_settle_keeps_the_cap(alice, chat_feature, redis_db, patient_guard, guard_keys_removed):
    now = timezone.now()
    Quota.objects.create(period=Period.DAY, max_tokens=1_000)
    ceiling = user_day_ceiling(alice, chat_feature, now)
    first = admitted(alice, chat_feature, 100, 400, now)  # reserves 500
    admitted(alice, chat_feature, 100, 400, now)  # reserves 500: the cap is fully reserved
    # The worker writes the ledger, then Redis restarts before it settles the counter.
    assert do_record_usage(first.request_id, status=TokenLog.Status.OK, usage=Usage(100, 0))
    wipe_counters(redis_db)
    admitted(alice, chat_feature, 10, 10, now)  # rebuilds: 100 used, 500 + 20 reserved
    assert settle(TokenLog.objects.get(request_id=first.request_id))

    # The ledger says 100 used (1 request) and 520 reserved (2); today the counter says 200 used
    # (2 requests) and 20 reserved (1), so the next request is granted 680 tokens where 280 were left
    # and the day ends with 1,400 tokens reserved or used under a cap of 1,000.
    state = counter_store().state(ceiling.spec.key)
    assert (state.used, state.reserved) == ledger_sums(ceiling.ledger_filter)
    admit(AdmissionRequest(uuid.uuid4().hex, alice, chat_feature, MODEL, 100, 700), now=now)
    used, reserved = ledger_sums(ceiling.ledger_filter)
    assert used.tokens + reserved.tokens <= 1_000


@pytest.mark.django_db(transaction=True)
def test_a_request_that_settles_between_a_rebuilds_read_and_its_install_is_not_held_again(
    alice, chat_feature, redis_db, patient_guard, guard_keys_removed, monkeypatch
):
    """Before: the rebuild read the request as in flight, the request settled (finding no counter to
    release), and the install put its 500 tokens back as reserved until the day ended."""
    from budgets import guard

    now = timezone.now()
    Quota.objects.create(period=Period.DAY, max_tokens=1_000)
    ceiling = user_day_ceiling(alice, chat_feature, now)
    running = admitted(alice, chat_feature, 100, 400, now)  # reserves 500
    wipe_counters(redis_db)  # Redis lost the counter while the answer runs
    read_ledger, settled_meanwhile = guard.ledger_snapshot, []

    def read_then_let_it_settle(ledger_filter):
        snapshot = read_ledger(ledger_filter)
        if not settled_meanwhile:  # the fault: the worker finishes right after the rebuild's read
            settled_meanwhile.append(do_record_usage(running.request_id, status=TokenLog.Status.OK, usage=Usage(100, 50)))
            settle(TokenLog.objects.get(request_id=running.request_id))  # finds no counter to release
        return snapshot

    monkeypatch.setattr(guard, "ledger_snapshot", read_then_let_it_settle)
    guard.rebuild_counter(ceiling)
    monkeypatch.undo()

    state = counter_store().state(ceiling.spec.key)
    assert state.reserved.tokens == 0 and state.used.tokens == 150  # read again: settled, not held
    assert (state.used, state.reserved) == ledger_sums(ceiling.ledger_filter)
