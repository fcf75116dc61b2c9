"""A cap on requests in flight at once, per user (or everyone's default) and per API key (issue #39):
held in the same atomic admission as every other ceiling, freed at settle, recovered by reconciliation."""

from __future__ import annotations

import io
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from accounts.actions import do_create_api_key
from budgets.actions import Usage, do_record_usage, do_set_in_flight_cap
from budgets.guard import AdmissionRequest, Scopes, admit, applicable_ceilings, counter_store, ledger_sums, settle
from budgets.models import AuditEntry, InFlightCap, Period, Provider, Quota, TokenLog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:*"):
        if not key.startswith(b"ceiling:engine:"):
            redis_db.delete(key)


def request(user, feature, api_key=None, **sizes) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, user, feature, "test-model", sizes.get("prompt", 10),
                            sizes.get("max_tokens", 10), api_key=api_key)


def burst(make_request, n: int, at=None):
    """n admissions at once, after a first one alone (which builds the counters from the ledger)."""
    def one(_):
        try:
            return admit(make_request(), now=at)
        finally:
            connection.close()

    first = admit(make_request(), now=at)
    with ThreadPoolExecutor(12) as pool:
        return [first, *pool.map(one, range(n - 1))]


def finish(decision) -> TokenLog:
    row = TokenLog.objects.get(request_id=decision.request_id)
    do_record_usage(row.request_id, status=TokenLog.Status.OK, usage=Usage(row.prompt_tokens, 3))
    row.refresh_from_db()
    settle(row)
    return row


def in_flight_counter(user, feature, api_key=None, scope="user_in_flight"):
    [ceiling] = [c for c in applicable_ceilings(user, feature, Provider.default(), timezone.now(), None,
                                                 Scopes(api_key=api_key)) if c.scope == scope]
    return ceiling, counter_store().state(ceiling.spec.key)


def test_a_burst_admits_exactly_the_users_cap_on_requests_in_flight(alice, chat_feature):
    do_set_in_flight_cap(None, alice, 3)
    Quota.objects.create(period=Period.DAY, max_requests=1_000)

    decisions = burst(lambda: request(alice, chat_feature), 24)

    admitted = [d for d in decisions if d.admitted]
    refused = [d for d in decisions if not d.admitted]
    assert len(admitted) == 3
    assert {d.code for d in refused} == {"user_in_flight"}
    assert refused[0].message == ("You have 3 answers in progress, the most allowed at once (3). "
                                  "Send this request again when one of them has finished.")
    assert {d.retry_after_s for d in refused} == {1}
    ceiling, state = in_flight_counter(alice, chat_feature)
    assert state.reserved.requests == 3 and ledger_sums(ceiling.ledger_filter)[1].requests == 3


def test_a_settled_answer_frees_its_place_at_once(alice, chat_feature):
    do_set_in_flight_cap(None, alice, 2)
    first, second = admit(request(alice, chat_feature)), admit(request(alice, chat_feature))
    assert first.admitted and second.admitted
    assert admit(request(alice, chat_feature)).code == "user_in_flight"

    finish(first)

    assert admit(request(alice, chat_feature)).admitted
    assert admit(request(alice, chat_feature)).code == "user_in_flight"
    # The day's requests count every admitted request; the place counts only those in progress.
    _, state = in_flight_counter(alice, chat_feature)
    assert (state.used.requests, state.reserved.requests) == (1, 2)


def test_everyones_default_applies_until_a_user_has_their_own(alice, bob, chat_feature):
    do_set_in_flight_cap(None, None, 1)
    do_set_in_flight_cap(None, bob, 2)

    assert admit(request(alice, chat_feature)).admitted
    assert admit(request(alice, chat_feature)).code == "user_in_flight"
    assert [admit(request(bob, chat_feature)).admitted for _ in range(3)] == [True, True, False]


def test_an_api_keys_cap_holds_below_its_users(alice, chat_feature):
    do_set_in_flight_cap(None, alice, 10)
    key, _ = do_create_api_key(alice, "agent")
    key.max_in_flight = 2
    key.save()

    decisions = burst(lambda: request(alice, chat_feature, api_key=key), 10)

    assert sum(d.admitted for d in decisions) == 2
    refused = next(d for d in decisions if not d.admitted)
    assert refused.code == "key_in_flight"
    assert refused.message.startswith("This API key ('agent') has 2 answers in progress, the most allowed at once (2).")
    # The same user without the key still has room under their own cap.
    assert admit(request(alice, chat_feature)).admitted


def test_reconciliation_frees_the_places_of_requests_a_crashed_worker_left(alice, chat_feature):
    from budgets.reconcile import release_lost_requests

    do_set_in_flight_cap(None, alice, 2)
    lost = [admit(request(alice, chat_feature)) for _ in range(2)]
    assert all(d.admitted for d in lost)
    assert admit(request(alice, chat_feature)).code == "user_in_flight"

    later = timezone.now() + timedelta(seconds=settings.CEILING_RESERVATION_TTL_S + 60)
    assert release_lost_requests(now=later) == 2

    assert admit(request(alice, chat_feature)).admitted
    ceiling, state = in_flight_counter(alice, chat_feature)
    assert state.reserved.requests == 1 and ledger_sums(ceiling.ledger_filter)[1].requests == 1


def test_a_lost_counter_is_rebuilt_with_the_requests_still_in_flight(alice, chat_feature, redis_db):
    do_set_in_flight_cap(None, alice, 2)
    running = admit(request(alice, chat_feature))
    assert running.admitted
    ceiling, _ = in_flight_counter(alice, chat_feature)
    redis_db.delete(ceiling.spec.key, f"{ceiling.spec.key}:inflight")  # Redis flushed, restarted, evicted

    assert admit(request(alice, chat_feature)).admitted
    assert admit(request(alice, chat_feature)).code == "user_in_flight"  # the first still holds its place
    finish(running)
    assert admit(request(alice, chat_feature)).admitted


def test_a_changed_cap_applies_at_the_next_admission_and_is_audited(alice, chat_feature):
    do_set_in_flight_cap(None, alice, 1)
    assert admit(request(alice, chat_feature)).admitted
    assert admit(request(alice, chat_feature)).code == "user_in_flight"

    do_set_in_flight_cap(None, alice, 2)
    assert admit(request(alice, chat_feature)).admitted
    do_set_in_flight_cap(None, alice, None)  # back to the default: none
    assert admit(request(alice, chat_feature)).admitted
    assert not InFlightCap.objects.exists()

    trail = list(AuditEntry.objects.filter(target="in-flight cap alice").order_by("pk").values_list("before", "after"))
    assert trail == [("default", "1"), ("1", "2"), ("2", "default")]


def test_the_api_answers_429_with_a_short_retry_after(alice, chat_feature):
    """The refusal's HTTP shape, through the /v1 view's own refusal_response."""
    from inference.api import refusal_response

    do_set_in_flight_cap(None, alice, 1)
    assert admit(request(alice, chat_feature)).admitted
    decision = admit(request(alice, chat_feature))

    response = refusal_response({"type": "refused", "code": decision.code, "message": decision.message,
                                 "retry_after_s": decision.retry_after_s})

    assert response.status_code == 429 and response["Retry-After"] == "1"
    assert "x-should-retry" not in response  # a place frees within seconds: retrying is right


def test_set_quota_sets_and_removes_in_flight_caps(alice, chat_feature):
    out = io.StringIO()
    call_command("set_quota", "alice", "--in-flight", "4", stdout=out)
    assert "alice: max_in_flight=4" in out.getvalue()
    call_command("set_quota", "--default", "--in-flight", "8", stdout=io.StringIO())
    key, _ = do_create_api_key(alice, "bot")
    call_command("set_quota", "--api-key", str(key.pk), "--in-flight", "2", stdout=io.StringIO())
    key.refresh_from_db()
    assert key.max_in_flight == 2
    assert dict(InFlightCap.objects.values_list("user__username", "max_in_flight")) == {"alice": 4, None: 8}

    call_command("set_quota", "alice", "--in-flight", "none", stdout=io.StringIO())
    assert dict(InFlightCap.objects.values_list("user__username", "max_in_flight")) == {None: 8}


@pytest.mark.parametrize("args, message", [
    (["alice", "--in-flight", "0"], "at least 1"),
    (["alice", "--in-flight", "many"], "whole number"),
    (["alice", "--in-flight", "2", "--period", "day"], "on its own"),
    (["--team", "ops", "--in-flight", "2"], "a user's, everyone's"),
    (["alice"], "--period"),
])
def test_set_quota_refuses_bad_in_flight_arguments(alice, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("set_quota", *args, stdout=io.StringIO())


def test_staff_set_a_users_and_everyones_cap_on_the_caps_pages(alice, chat_feature, staff):
    from django.test import Client
    from django.urls import reverse

    from tests.test_staff_config import caps_data

    client = Client()
    client.force_login(staff)
    defaults = reverse("staff-defaults")
    assert client.post(defaults, caps_data(client.get(defaults), **{"inflight-max_in_flight": "6"})).status_code == 302
    page = reverse("staff-user", args=[alice.pk])
    form = client.get(page)
    assert 'placeholder="default (6)"' in form.content.decode()
    assert client.post(page, caps_data(form, **{"inflight-max_in_flight": "2"})).status_code == 302

    assert dict(InFlightCap.objects.values_list("user__username", "max_in_flight")) == {None: 6, "alice": 2}
    assert AuditEntry.objects.filter(actor=staff, target="in-flight cap alice", after="2").exists()
    assert [admit(request(alice, chat_feature)).admitted for _ in range(3)] == [True, True, False]

    # Saving the other caps leaves the in-flight cap as it is; a bad one saves nothing.
    assert client.post(page, caps_data(client.get(page))).status_code == 302
    refused = client.post(page, caps_data(client.get(page), **{"inflight-max_in_flight": "0"}))
    assert refused.status_code == 200 and "At least 1" in refused.content.decode()
    assert InFlightCap.objects.get(user=alice).max_in_flight == 2
