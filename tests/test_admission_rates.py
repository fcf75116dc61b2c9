"""Admissions at gateway rates (#23): reference rows cached per process, ledger rows group-committed.

The cache must never serve a row older than the last write by any path (a save, a bulk update, a
management command, a staff page), and group commit must keep the ledger's promise: the row is
committed before admit() returns, and a process killed mid-admission leaves a row whose reservation
reconciliation releases.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO

import psycopg
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets import guard, ledger_writer, refcache
from budgets.guard import admit, counter_store, ledger_sums
from budgets.models import ModelPrice, Provider, Quota, TagQuota, TokenLog
from budgets.reconcile import fail_lost_request, release_lost_requests
from project import stack
from tests.conftest import _test_database_url
from tests.test_guard import clean_counters, request  # noqa: F401 (a fixture)

PRICE_OUT = 1_000_000  # micro-dollars per million output tokens: a token costs one micro-dollar


@pytest.fixture
def priced(chat_feature):
    provider = Provider.default()
    chat_feature.provider = provider
    chat_feature.save()
    return ModelPrice.objects.create(
        provider=provider, model="test-model", input_per_million_micro_usd=0,
        output_per_million_micro_usd=PRICE_OUT, effective_from=timezone.now() - timedelta(days=1),
    )


def reserved_cost(decision) -> int:
    return TokenLog.objects.get(request_id=decision.request_id).reserved_cost_micro_usd


# --- the reference cache: every write path reaches the next admission ---------------------------


def test_a_price_changed_by_a_bulk_update_prices_the_next_admission(alice, chat_feature, priced):
    assert reserved_cost(admit(request(alice, chat_feature, max_tokens=100))) == 100

    ModelPrice.objects.filter(pk=priced.pk).update(output_per_million_micro_usd=3 * PRICE_OUT)

    assert reserved_cost(admit(request(alice, chat_feature, max_tokens=100))) == 300


def test_a_new_price_saved_in_force_now_prices_the_next_admission(alice, chat_feature, priced):
    admit(request(alice, chat_feature, max_tokens=100))
    ModelPrice.objects.create(provider=priced.provider, model="test-model", output_per_million_micro_usd=2 * PRICE_OUT,
                              effective_from=timezone.now() - timedelta(seconds=1))

    assert reserved_cost(admit(request(alice, chat_feature, max_tokens=100))) == 200


def test_a_cap_set_with_set_quota_refuses_the_next_admission(alice, chat_feature):
    assert admit(request(alice, chat_feature)).admitted

    call_command("set_quota", "alice", "--period", "day", "--requests", "1", stdout=StringIO())

    decision = admit(request(alice, chat_feature))
    assert (decision.admitted, decision.code) == (False, "user_requests_per_day")


def test_caps_created_with_bulk_create_apply_to_the_next_admission(alice, chat_feature):
    assert admit(request(alice, chat_feature)).admitted
    Quota.objects.bulk_create([Quota(user=alice, period="day", max_requests=1)])

    assert admit(request(alice, chat_feature)).code == "user_requests_per_day"


def test_a_tag_cap_set_on_the_staff_page_applies_to_the_next_admission(alice, staff, chat_feature, priced):
    assert admit(request(alice, chat_feature, max_tokens=100, tags=("support",))).admitted
    client = Client()
    client.force_login(staff)

    assert client.post(reverse("staff-tags"), {"tag": "support", "max_cost_usd": "0.00005"}).status_code == 302

    assert TagQuota.objects.get(tag="support").max_cost_micro_usd == 50
    decision = admit(request(alice, chat_feature, max_tokens=100, tags=("support",)))
    # The first answer's 100 micro-dollars, still reserved, are past the tag's new $0.00005.
    assert (decision.admitted, decision.code) == (False, "tag_cost_per_month")


WRITE_PATHS = {
    "save": lambda q: q.save(),
    "queryset update": lambda q: Quota.objects.filter(pk=q.pk).update(max_requests=7),
    "bulk_update": lambda q: Quota.objects.bulk_update([q], ["max_requests"]),
    "queryset delete": lambda q: Quota.objects.filter(pk=q.pk).delete(),
    "instance delete": lambda q: q.delete(),
    "migrate": lambda q: call_command("migrate", "budgets", verbosity=0),
}


@pytest.mark.parametrize("path", sorted(WRITE_PATHS))
def test_every_write_path_makes_another_process_read_the_table_again(path, alice, redis_db):
    quota = Quota.objects.create(user=alice, period="day", max_requests=5)
    other_process = refcache.RefCache(refcache._client, refcache._prefix)  # a second process's cache: only Redis links them
    loads = []

    def read() -> int | None:
        return other_process.get("quotas", ("quota",), alice.pk, lambda: loads.append(1) or Quota.objects.count())

    other_process.refresh()
    read(), read()
    assert len(loads) == 1  # the second read was the cache's

    WRITE_PATHS[path](quota)
    other_process.refresh()
    read()

    assert len(loads) == 2


def test_a_redis_emptied_under_the_cache_does_not_bring_back_an_old_version(alice, redis_db):
    """Versions are random tokens, not counts: an INCR from 1 again would repeat a version."""
    other_process = refcache.RefCache(refcache._client, refcache._prefix)
    loads = []
    refcache.changed("quota")
    other_process.refresh()
    other_process.get("quotas", ("quota",), 1, lambda: loads.append(1))
    redis_db.delete(refcache.version_key("quota"))
    refcache.changed("quota")

    other_process.refresh()
    other_process.get("quotas", ("quota",), 1, lambda: loads.append(1))

    assert len(loads) == 2


def written_by_another_process(sql: str, table: str, redis_db) -> None:
    """A write this process never hears of but through Redis: SQL that sends no signal, and the
    version bump another process's refcache.changed() would send."""
    with connection.cursor() as cursor:
        cursor.execute(sql)
    redis_db.set(refcache.version_key(table), "bumped-elsewhere")


def test_a_cap_raised_by_another_process_admits_the_next_request_without_a_refresh(alice, chat_feature, redis_db):
    """The admission checks the versions in its own Lua call (no MGET before it): a moved version
    makes it read the caps again and decide under them, in the same admit()."""
    quota = Quota.objects.create(user=alice, period="day", max_requests=1)
    assert admit(request(alice, chat_feature)).admitted
    assert admit(request(alice, chat_feature)).code == "user_requests_per_day"  # warm: from the cache

    written_by_another_process(f"UPDATE budgets_quota SET max_requests = 2 WHERE id = {quota.pk}", "quota", redis_db)

    decision = admit(request(alice, chat_feature))
    assert decision.admitted
    assert admit(request(alice, chat_feature)).code == "user_requests_per_day"


def test_a_price_raised_by_another_process_prices_the_next_admission_and_its_row(alice, chat_feature, priced, redis_db):
    assert reserved_cost(admit(request(alice, chat_feature, max_tokens=100))) == 100
    written_by_another_process(
        f"UPDATE budgets_modelprice SET output_per_million_micro_usd = {3 * PRICE_OUT} WHERE id = {priced.pk}",
        "modelprice", redis_db,
    )

    decision = admit(request(alice, chat_feature, max_tokens=100))

    assert reserved_cost(decision) == 300
    assert TokenLog.objects.get(request_id=decision.request_id).price_id == priced.pk


def test_a_cap_added_by_another_process_is_recorded_on_the_row_it_admitted(alice, chat_feature, redis_db):
    """The row was opened under the old caps (no user cap: no user counter); the admission read
    them again, and the row names the counters it was really admitted on."""
    assert admit(request(alice, chat_feature)).admitted
    written_by_another_process(
        f"INSERT INTO budgets_quota (user_id, period, max_requests) VALUES ({alice.pk}, 'day', 5)", "quota", redis_db
    )

    decision = admit(request(alice, chat_feature))

    keys = TokenLog.objects.get(request_id=decision.request_id).counter_keys
    assert decision.admitted and any(f"user:{alice.pk}:all:day" in key for key in keys)


def test_a_provider_deleted_by_another_process_is_read_again_before_the_row_is_written(alice, chat_feature, redis_db):
    """The row is written before the Lua call checks the versions: a cached provider that is gone
    fails its INSERT, and the admission reads the reference rows again instead of failing."""
    first = admit(request(alice, chat_feature))
    assert first.admitted
    gone = first.log.provider_id
    written_by_another_process(
        f"DELETE FROM budgets_tokenlog; DELETE FROM budgets_provider WHERE id = {gone}", "provider", redis_db
    )
    Provider.objects.create(name="local", kind=Provider.Kind.LOCAL)  # what Provider.default() makes again
    refcache.cache.clear()  # … except that this process must not hear of it: fill its cache as before
    refcache.cache.get("default_provider", ("provider",), None, lambda: Provider(pk=gone, name="local"))

    decision = admit(request(alice, chat_feature))

    assert decision.admitted
    assert TokenLog.objects.get(request_id=decision.request_id).provider.name == "local"


def test_without_redis_the_cache_reads_the_database_every_time(alice):
    broken = refcache.RefCache(lambda: __import__("redis").Redis(port=1, socket_connect_timeout=0.1))
    loads = []
    for _ in range(2):
        broken.refresh()
        broken.get("quotas", ("quota",), 1, lambda: loads.append(1))
    assert len(loads) == 2


def test_a_warm_admission_alone_reads_no_reference_row_and_writes_its_row_itself(alice, chat_feature, priced):
    """Once warm, an admission's reference rows come from the cache; alone in its process (the
    writer idle), it writes its row on its own connection: no thread hop for a commit it would not
    share. Granted in full, as claimed by its INSERT, the row is written once."""
    from django.test.utils import CaptureQueriesContext

    admit(request(alice, chat_feature))
    with CaptureQueriesContext(connection) as queries:
        decision = admit(request(alice, chat_feature))
    assert decision.admitted
    assert [q["sql"].split()[0] for q in queries.captured_queries] == ["INSERT"]
    assert committed_elsewhere(decision.request_id)[:2] == ("running", True)


# --- group commit: rows committed before admit() returns, and crashes -------------------------------


def committed_elsewhere(request_id: str) -> tuple | None:
    """The row as a separate connection sees it: only what is committed."""
    with psycopg.connect(_test_database_url(), autocommit=True) as other:
        return other.execute(
            "SELECT status, admitted, reserved_tokens FROM budgets_tokenlog WHERE request_id = %s", [request_id]
        ).fetchone()


def test_each_admitted_row_is_committed_before_admit_returns(alice, chat_feature, settings):
    settings.CEILING_LEDGER_GROUP_COMMIT = True
    settings.CEILING_GUARD_TIMEOUT_S = 2.0
    counter_store.cache_clear()
    batches_before, writes_before = ledger_writer.writer.batches, ledger_writer.writer.writes
    requests = [request(alice, chat_feature, max_tokens=10) for _ in range(48)]

    def admit_and_look(req):
        try:
            decision = admit(req)
            return decision.admitted, committed_elsewhere(req.request_id)
        finally:
            connection.close()

    with ThreadPoolExecutor(16) as pool:
        seen = list(pool.map(admit_and_look, requests))

    assert all(seen_row == ("running", True, 20) for _, seen_row in seen)
    assert sum(admitted for admitted, _ in seen) == 48
    # Admissions that overlapped wrote through the writer, several to a commit.
    writes, commits = ledger_writer.writer.writes - writes_before, ledger_writer.writer.batches - batches_before
    assert writes > commits > 0


def test_a_duplicate_request_id_is_refused_through_the_writer(alice, chat_feature):
    """The writer's batch falls back to one row at a time, and the duplicate hears of its IntegrityError."""
    first, again = request(alice, chat_feature), request(alice, chat_feature)
    assert admit(first).admitted
    row = TokenLog(request_id=first.request_id, user=alice, feature=chat_feature, model="m", prompt_tokens=1,
                   max_tokens=1, counter_keys=[], created_at=timezone.now())
    others = [TokenLog(request_id=f"{again.request_id}-{i}", user=alice, feature=chat_feature, model="m",
                       prompt_tokens=1, max_tokens=1, counter_keys=[], created_at=timezone.now()) for i in range(3)]

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(_insert_through_writer, [row, *others]))

    assert outcomes[0] == "IntegrityError" and outcomes[1:] == ["ok"] * 3
    assert TokenLog.objects.filter(request_id__startswith=again.request_id).count() == 3
    assert TokenLog.objects.filter(request_id=first.request_id).count() == 1


def _insert_through_writer(row: TokenLog) -> str:
    try:
        ledger_writer.writer.insert(row)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
        return type(exc).__name__


CRASH_MID_ADMISSION = textwrap.dedent("""
    import os, signal, django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.contrib.auth.models import User
    from django.utils import timezone
    from budgets import guard
    from budgets.models import Feature
    user, feature = User.objects.get(username="alice"), Feature.objects.get(name="chat")
    req = guard.AdmissionRequest({request_id!r}, user, feature, "test-model", 10, 10)
    now = timezone.now()
    primary = guard.candidate(req, feature, None, "test-model", 10, now)
    row, _ = guard._open_row(req, primary.provider, primary.price, primary.ceilings, now)
    if {reserve!r}:
        result = guard._admit_with_rebuild(req, primary, None)
        assert result.status == "ok", result
    print("killed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # admit() never returns
""")


def _killed_mid_admission(request_id: str, *, reserve: bool) -> TokenLog:
    """A process that wrote the row (claiming its reservation) and, with reserve, also had the admit
    script grant it, then died before admit() returned: its row as the ledger holds it."""
    env = stack.child_env(DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL)
    script = CRASH_MID_ADMISSION.format(request_id=request_id, reserve=reserve)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and "killed" in done.stdout, done.stderr
    row = TokenLog.objects.get(request_id=request_id)
    assert (row.status, row.admitted) == ("running", True)  # claimed by its INSERT
    return row


def _user_day(row: TokenLog) -> str:
    [key] = [k for k in row.counter_keys if ":user:" in k and ":day:" in k]
    return key


def test_a_process_killed_after_reserving_leaves_a_row_that_is_failed_and_settled(alice, chat_feature):
    """The admit script granted the claim (its marker says so), so admit() may have returned and the
    request been served: reconciliation fails it as used (the prompt), and settles the counters
    to what the ledger then counts."""
    Quota.objects.create(user=alice, period="day", max_requests=100)
    row = _killed_mid_admission("killed-after-reserving", reserve=True)
    assert counter_store().state(_user_day(row)).reserved.requests == 1

    assert release_lost_requests(now=timezone.now() + timedelta(hours=1)) == 1

    state = counter_store().state(_user_day(row))
    row.refresh_from_db()
    assert (row.status, row.prompt_tokens, row.counters_settled) == ("failed", 10, True)
    used, reserved = ledger_sums({"user_id": alice.pk})
    assert (used, reserved) == (state.used, state.reserved)
    assert (used.requests, reserved.requests) == (1, 0)


@pytest.mark.parametrize("rebuilt_meanwhile", [False, True])
def test_a_process_killed_between_its_insert_and_the_admit_script_leaves_a_row_closed_unadmitted(
    alice, chat_feature, rebuilt_meanwhile
):
    """No marker: the script never granted the claim, so nothing was dispatched. Closed as refused
    (admission_interrupted), which neither the ledger nor the counters count; a counter rebuilt from
    the ledger in the meantime took the claim as a reservation, and releases it."""
    Quota.objects.create(user=alice, period="day", max_requests=100)
    assert admit(request(alice, chat_feature)).admitted  # the counter exists
    row = _killed_mid_admission("killed-before-reserving", reserve=False)
    if rebuilt_meanwhile:
        counter_store().client.delete(_user_day(row))
        assert admit(request(alice, chat_feature)).admitted  # rebuilds it, with the dead row's claim
        assert "killed-before-reserving" in counter_store().held(_user_day(row))

    assert fail_lost_request(row, "its process died")  # what the sweeps do with each row they find

    row.refresh_from_db()
    assert (row.status, row.refusal_code, row.admitted) == ("refused", "admission_interrupted", False)
    state = counter_store().state(_user_day(row))
    assert "killed-before-reserving" not in counter_store().held(_user_day(row))
    used, reserved = ledger_sums({"user_id": alice.pk})
    assert (used, reserved) == (state.used, state.reserved)
    assert reserved.requests == (2 if rebuilt_meanwhile else 1)


# --- the row claims its reservation from its INSERT on ---------------------------------------------


def _admission_parts(user, feature, max_tokens: int = 10):
    """What admit() does first: the request, its candidate and its row, claimed as granted in full."""
    req = request(user, feature, max_tokens=max_tokens)
    now = timezone.now()
    primary = guard.candidate(req, feature, None, "test-model", max_tokens, now)
    row, created = guard._open_row(req, primary.provider, primary.price, primary.ceilings, now)
    assert created and row.admitted
    return req, primary, row


def _rebuild(primary, scope: str = "user", period: str = "day") -> str:
    """Another process finds the counter gone (Redis flushed, a new day) and rebuilds it from the ledger."""
    [ceiling] = [c for c in primary.ceilings if c.scope == scope and c.period == period]
    counter_store().client.delete(ceiling.spec.key)
    guard.rebuild_counter(ceiling)
    return ceiling.spec.key


def _counter_is_the_ledger(key: str, user) -> None:
    state = counter_store().state(key)
    used, reserved = ledger_sums({"user_id": user.pk})
    assert (state.used, state.reserved) == (used, reserved)
    in_flight = set(TokenLog.objects.filter(status="running", admitted=True).values_list("request_id", flat=True))
    assert set(counter_store().held(key)) == in_flight


def test_a_counter_rebuilt_before_each_admission_admits_exactly_the_cap(alice, chat_feature):
    """Each admission finds its counter gone, so it rebuilds it after its INSERT: the rebuilt
    counter holds the admission's own claim, which the script takes out before checking."""
    Quota.objects.create(user=alice, period="day", max_requests=3, max_tokens=1_000)
    decisions = []
    for _ in range(6):
        for key in counter_store().client.scan_iter(match="ceiling:c:user:*"):
            counter_store().client.delete(key)
        decisions.append(admit(request(alice, chat_feature)))

    assert [d.admitted for d in decisions] == [True] * 3 + [False] * 3
    assert {d.code for d in decisions[3:]} == {"user_requests_per_day"}
    [key] = [k for k in decisions[0].log.counter_keys if ":user:" in k and ":day:" in k]
    _counter_is_the_ledger(key, alice)
    assert counter_store().state(key).reserved.tokens == 3 * 20  # each request once, not twice


def test_a_counter_rebuilt_between_the_insert_and_the_admit_script_counts_the_request_once(alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_requests=2)
    assert admit(request(alice, chat_feature)).admitted
    req, primary, row = _admission_parts(alice, chat_feature)
    key = _rebuild(primary)  # holds both claims: the admitted request's and this one's
    assert counter_store().state(key).reserved.requests == 2

    result = guard._admit_with_rebuild(req, primary, None)

    assert result.status == "ok" and guard._granted_as_claimed(row, result)  # no second statement
    _counter_is_the_ledger(key, alice)
    assert not admit(request(alice, chat_feature)).admitted  # the cap of 2 holds


def test_a_refusal_releases_a_claim_that_a_counter_rebuilt_before_its_update_took(alice, chat_feature):
    """Between the script's refusal and the refusal's UPDATE the row still claims a reservation: a
    counter rebuilt in that moment holds it, and the refusal releases it there."""
    Quota.objects.create(user=alice, period="day", max_requests=1)
    assert admit(request(alice, chat_feature)).admitted
    req, primary, row = _admission_parts(alice, chat_feature)
    result = guard._admit_with_rebuild(req, primary, None)
    assert result.status == "refused"
    key = _rebuild(primary)
    assert row.request_id in counter_store().held(key)

    guard._refuse(row, "user_requests_per_day", "full", None)
    guard._release_claim(row)

    row.refresh_from_db()
    assert (row.status, row.admitted, row.reserved_tokens) == ("refused", False, 0)
    _counter_is_the_ledger(key, alice)


def test_a_partial_grant_writes_what_was_reserved_over_the_claim(alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_tokens=100)
    decision = admit(request(alice, chat_feature, max_tokens=500))  # claims 510 tokens; 100 fit

    assert decision.admitted and decision.max_tokens == 90
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.max_tokens, row.reserved_tokens) == (90, 100)
    [key] = [k for k in row.counter_keys if ":user:" in k and ":day:" in k]
    assert counter_store().held(key) == {row.request_id: (100, 0)}
    _counter_is_the_ledger(key, alice)


def test_a_refused_admission_leaves_no_claim_in_the_ledger(alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_requests=0)
    decision = admit(request(alice, chat_feature))

    assert not decision.admitted and decision.code == "user_requests_per_day"
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert (row.status, row.admitted, row.reserved_tokens, row.reserved_cost_micro_usd) == ("refused", False, 0, 0)
