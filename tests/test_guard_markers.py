"""How long the guard's Redis markers live (budgets/counters.py, docs/budgets.md): the admitted
marker for as long as reconciliation may need it for a running row, both markers a few minutes
once the settle script ran; what then happens without them changes no counter and admits nothing twice."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from budgets.counters import ADMITTED_MARKER_TTL_S, DONE_MARKER_TTL_S
from budgets.guard import admit, counter_store, settle
from budgets.models import Quota, TokenLog
from budgets.reconcile import release_lost_requests, retry_unsettled
from tests.test_guard import clean_counters, counter_and_ledger, finish, request  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def ttls(request_id: str) -> tuple[int, int]:
    """(admitted marker's, settled marker's) seconds to live; -2 for a marker that is not there."""
    store = counter_store()
    return store.client.ttl(store.admitted_marker(request_id)), store.client.ttl(store.settled_marker(request_id))


def test_an_admitted_request_keeps_its_marker_long_past_the_reservation_ttl(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))

    admitted, settled = ttls(decision.request_id)

    # reconciliation reads it CEILING_RESERVATION_TTL_S after the start at the earliest
    assert ADMITTED_MARKER_TTL_S - 5 <= admitted <= ADMITTED_MARKER_TTL_S
    assert admitted > 100 * settings.CEILING_RESERVATION_TTL_S and settled == -2


def test_a_settle_leaves_both_markers_a_few_minutes(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))

    finish(decision, 4)

    admitted, settled = ttls(decision.request_id)
    assert 0 < admitted <= DONE_MARKER_TTL_S and 0 < settled <= DONE_MARKER_TTL_S
    assert DONE_MARKER_TTL_S >= 10 * 30  # ten times reconciliation's wait before it settles a row again


def test_a_release_leaves_both_markers_a_few_minutes_too(alice, chat_feature):
    """An admission whose reply was lost (guard_unavailable after the script ran), released later."""
    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))
    TokenLog.objects.filter(request_id=decision.request_id).update(
        status=TokenLog.Status.REFUSED, refusal_code="guard_unavailable", admitted=False, finished_at=timezone.now(),
    )

    assert retry_unsettled(now=timezone.now() + timedelta(minutes=1)) == 1

    admitted, settled = ttls(decision.request_id)
    assert 0 < admitted <= DONE_MARKER_TTL_S and 0 < settled <= DONE_MARKER_TTL_S


def test_a_refusal_writes_no_marker(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=0)
    decision = admit(request(alice, chat_feature))

    assert not decision.admitted
    assert ttls(decision.request_id) == (-2, -2)


def test_once_the_markers_expired_a_replayed_settle_changes_nothing(alice, chat_feature):
    """The first settle took the request out of every counter's in-flight hash: a replay (a lost
    counters_settled mark, reconciliation) finds nothing to release there and counts nothing."""
    Quota.objects.create(period="day", max_requests=10)
    row = finish(admit(request(alice, chat_feature)), 4)
    counter_store().client.delete(counter_store().admitted_marker(row.request_id),
                                  counter_store().settled_marker(row.request_id))  # as their expiry does
    before, _ = counter_and_ledger(alice, chat_feature)

    settle(row)
    TokenLog.objects.filter(pk=row.pk).update(counters_settled=False)
    assert retry_unsettled(now=row.finished_at + timedelta(minutes=1)) == 1

    after, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert after == before and (after.used, after.reserved) == (used, reserved)
    assert (used.requests, reserved.requests) == (1, 0)


def test_once_the_markers_expired_the_same_request_id_is_still_refused_by_the_ledger(alice, chat_feature):
    Quota.objects.create(period="day", max_requests=10)
    first = request(alice, chat_feature)
    finish(admit(first), 4)
    store = counter_store()
    store.client.delete(store.admitted_marker(first.request_id), store.settled_marker(first.request_id))

    again = admit(first)

    assert (again.admitted, again.code) == (False, "duplicate_request")
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved) and (used.requests, reserved.requests) == (1, 0)


def test_a_request_left_running_by_a_crash_is_failed_and_settled_with_its_marker(alice, chat_feature):
    """Its admitted marker still lives when reconciliation comes, CEILING_RESERVATION_TTL_S later:
    the request may have been served, so it is counted (failed, its prompt used), not closed unadmitted."""
    Quota.objects.create(period="day", max_requests=10)
    decision = admit(request(alice, chat_feature))  # ... and its worker died: nothing settles it

    assert release_lost_requests(now=timezone.now() + timedelta(seconds=settings.CEILING_RESERVATION_TTL_S + 60)) == 1

    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.status, row.admitted, row.counters_settled) == ("failed", True, True)
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved) and (used.requests, reserved.requests) == (1, 0)
    assert 0 < ttls(decision.request_id)[0] <= DONE_MARKER_TTL_S  # settled now: short-lived
