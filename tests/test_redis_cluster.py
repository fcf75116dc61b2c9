"""The guard's counters, the caches and the stream inboxes on a real Redis Cluster (CEILING_COUNTERS_URL).

One cluster for the module: 3 masters with a replica each, on loopback ports 7100-7105, started with
redis-server --cluster-enabled yes and redis-cli --cluster create (tests/redis_cluster.py). Celery
and the channel layer stay on REDIS_URL, as in production.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.utils import timezone
from redis.cluster import RedisCluster

from budgets.guard import admit, applicable_ceilings, counter_store, ledger_sums
from budgets.models import Provider, Quota, Team, TeamMembership, TeamQuota, TokenLog
from budgets.reconcile import retry_unsettled
from inference.bus import clients as bus_clients
from inference.bus.cancel import is_cancel_requested, listen_for_cancellations, request_cancel
from inference.bus.inbox import StreamInbox
from inference.bus.outbox import ChannelSender
from inference.bus.ownership import RUNNING_KEY, lost_claims
from inference.bus.stats import STATS_KEY_PREFIX, read_engine_stats
from project import stack
from project.settings import check_counters_url, check_redis_url
from tests.conftest import _test_database_url
from tests.redis_cluster import LocalCluster, redis_server_missing
from tests.test_guard import admit_in_threads, finish, request

pytestmark = pytest.mark.django_db(transaction=True)

BASE_PORT = 7100


@pytest.fixture(scope="session")
def cluster():
    missing = redis_server_missing()
    if missing:
        pytest.skip(missing)
    local = LocalCluster(BASE_PORT)
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest.fixture
def on_cluster(cluster, settings):
    """Counters, caches and inboxes on the cluster, emptied; each admission waits for 1 replica."""
    for port in cluster.masters():
        redis.Redis(port=port).flushall()
    settings.CEILING_COUNTERS_URL = cluster.url
    settings.CEILING_COUNTERS_WAIT_REPLICAS = 1
    # 2 cores, a dozen threads: give a round trip 2 s, so a refusal is the cap's, not a slow reply's.
    settings.CEILING_GUARD_TIMEOUT_S = 2.0
    _forget_clients()
    yield cluster
    _forget_clients()


def _forget_clients() -> None:
    counter_store.cache_clear()
    bus_clients.redis_client.cache_clear()


def user_day_ceiling(user, feature):
    now = datetime.now(ZoneInfo("UTC"))
    [ceiling] = [c for c in applicable_ceilings(user, feature, Provider.default(), now) if c.scope == "user" and c.period == "day"]
    return ceiling


def counter_and_ledger(user, feature):
    ceiling = user_day_ceiling(user, feature)
    return counter_store().state(ceiling.spec.key), ledger_sums(ceiling.ledger_filter)


def cluster_client(cluster) -> RedisCluster:
    return RedisCluster(host="127.0.0.1", port=cluster.alive_ports()[0])


# --- configuration ---------------------------------------------------------------------------------


def test_counters_url_accepts_one_redis_or_a_cluster_and_says_what_it_wants_otherwise():
    assert check_counters_url("redis+cluster://10.0.0.5:7000/0") == "redis+cluster://10.0.0.5:7000/0"
    assert check_counters_url("") == ""  # empty: the counters use REDIS_URL
    with pytest.raises(ImproperlyConfigured, match="must start with redis://"):
        check_counters_url("http://10.0.0.5:7000")
    with pytest.raises(ImproperlyConfigured, match="only database 0"):
        check_counters_url("redis+cluster://10.0.0.5:7000/3")


def test_redis_url_refuses_a_cluster_because_celery_and_channels_need_one_server():
    with pytest.raises(ImproperlyConfigured, match="CEILING_COUNTERS_URL"):
        check_redis_url("redis+cluster://10.0.0.5:7000/0")


def test_a_replica_wait_longer_than_the_guards_socket_timeout_stops_start_up():
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", "import project.settings"],
        env={"CEILING_COUNTERS_URL": "redis+cluster://127.0.0.1:7100/0", "CEILING_COUNTERS_WAIT_MS": "100",
             "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode != 0 and "must be below CEILING_GUARD_TIMEOUT_S" in result.stderr


# --- the guard -------------------------------------------------------------------------------------


def test_every_key_of_an_admission_across_user_team_and_provider_caps_sits_in_one_slot(on_cluster, alice, chat_feature):
    team = Team.objects.create(name="Support")
    TeamMembership.objects.create(team=team, user=alice)
    TeamQuota.objects.create(team=team, period="month", max_requests=100)
    Quota.objects.create(period="day", max_requests=100)
    decision = admit(request(alice, chat_feature))
    assert decision.admitted

    client = cluster_client(on_cluster)
    keys = [key.decode() for key in client.scan_iter(match="*", target_nodes=RedisCluster.PRIMARIES)]
    assert any(":team:" in key for key in keys) and any(":user:" in key for key in keys)
    assert all(key.startswith("{ceiling}:") for key in keys), keys
    assert len({client.keyslot(key) for key in keys}) == 1
    # The ledger keeps the names the guard uses, the same on one Redis and on a cluster.
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert all(key.startswith("ceiling:c:") for key in row.counter_keys)


def test_200_concurrent_admissions_from_threads_and_processes_admit_exactly_50_on_a_cluster(
    on_cluster, alice, chat_feature, settings
):
    Quota.objects.create(period="day", max_requests=50)
    env = stack.child_env(
        DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL, CEILING_COUNTERS_URL=on_cluster.url,
        CEILING_GUARD_TIMEOUT_S="2",
    )
    args = [str(alice.pk), str(chat_feature.pk), "50", "12", "10", "10"]
    processes = [
        subprocess.Popen([sys.executable, "-m", "tests.guard_load", *args], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    local = admit_in_threads([request(alice, chat_feature) for _ in range(50)], threads=12)
    remote = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in processes]

    admitted = sum(d.admitted for d in local) + sum(r["admitted"] for r in remote)
    refused = sum(not d.admitted for d in local) + sum(r["refused"] for r in remote)
    assert (admitted, refused) == (50, 150)
    assert {d.code for d in local if not d.admitted} <= {"user_requests_per_day"}
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    assert state.reserved.requests == 50


def test_counters_lost_on_the_cluster_are_rebuilt_equal_to_the_ledger(on_cluster, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=40)
    first = admit_in_threads([request(alice, chat_feature) for _ in range(20)], threads=12)
    for decision in first[:10]:
        finish(decision, 3)
    client = cluster_client(on_cluster)
    lost = list(client.scan_iter(match="{ceiling}:c:*", target_nodes=RedisCluster.PRIMARIES))
    assert lost
    client.delete(*lost)  # one slot: one DEL

    after = admit_in_threads([request(alice, chat_feature) for _ in range(60)], threads=12)
    assert sum(d.admitted for d in first) + sum(d.admitted for d in after) == 40
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    assert used.requests == 10 and reserved.requests == 30


def test_an_admission_its_lagging_replica_did_not_acknowledge_is_released_and_refused(on_cluster, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=5)
    assert admit(request(alice, chat_feature)).admitted
    replica = on_cluster.replica_of(on_cluster.master_of_key("{ceiling}"))
    on_cluster.pause(replica)  # still listed, so it could be promoted: serving without it would risk that
    try:
        decision = admit(request(alice, chat_feature))
    finally:
        on_cluster.resume(replica)
    assert not decision.admitted and decision.code == "guard_unavailable"
    assert "try again" in decision.message
    assert TokenLog.objects.get(request_id=decision.request_id).status == TokenLog.Status.REFUSED
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert state.reserved.requests == 1 == reserved.requests  # released at once, not left to expire
    assert admit(request(alice, chat_feature)).admitted  # the replica caught up: admitting again


def test_a_settlement_its_lagging_replica_did_not_acknowledge_is_settled_again_by_reconciliation(
    on_cluster, alice, chat_feature
):
    Quota.objects.create(period="day", max_requests=5)
    decision = admit(request(alice, chat_feature))
    assert decision.admitted
    replica = on_cluster.replica_of(on_cluster.master_of_key("{ceiling}"))
    on_cluster.pause(replica)
    try:
        finish(decision, 4)
    finally:
        on_cluster.resume(replica)
    row = TokenLog.objects.get(request_id=decision.request_id)
    assert not row.counters_settled  # left for reconciliation: a failover could lose this settlement

    assert retry_unsettled(now=timezone.now() + timedelta(minutes=5)) == 1
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    assert state.used.requests == 1 and state.reserved.requests == 0


def test_a_planned_failover_loses_nothing_and_admissions_go_on(on_cluster, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=10)
    assert admit(request(alice, chat_feature)).admitted
    on_cluster.hand_over(on_cluster.master_of_key("{ceiling}"))

    # The guard's client still sends to the old master, which now answers MOVED. The first call to
    # meet it is the reference cache's version read (budgets/refcache.py, the counters' slot): a
    # read, after which the layout is read again and the admission goes on. Had the Lua call met it,
    # that admission would be refused (fail closed, nothing retried blindly). Nothing is lost either way.
    first = admit(request(alice, chat_feature))
    assert first.admitted or first.code == "guard_unavailable"
    assert admit(request(alice, chat_feature)).admitted
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    assert reserved.requests == 2 + first.admitted


# --- the bus and the caches -------------------------------------------------------------------------


def test_frames_pushed_by_a_worker_reach_a_web_process_inbox_on_the_cluster(on_cluster):
    sender = ChannelSender()  # its own loop and client, on the cluster
    request_id = uuid.uuid4().hex

    async def round_trip() -> list[dict]:
        inbox = StreamInbox()
        queue = inbox.open(request_id)
        for n in range(3):
            sent = await asyncio.to_thread(sender.send_frame, inbox.key, request_id,
                                           {"type": "token", "request_id": request_id, "text": str(n)}, wait=True)
            assert sent
        frames = [await asyncio.wait_for(queue.get(), 10) for _ in range(3)]
        inbox.close(request_id)
        return frames

    try:
        frames = asyncio.run(round_trip())
    finally:
        sender.loop.call_soon_threadsafe(sender.loop.stop)
    assert [f["text"] for f in frames] == ["0", "1", "2"]


def test_a_cancellation_is_recorded_and_published_on_the_cluster(on_cluster):
    heard: list[str] = []
    stop = threading.Event()
    listener = threading.Thread(target=listen_for_cancellations, args=(heard.append, stop), daemon=True)
    listener.start()
    try:
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + 10
        while request_id not in heard and time.monotonic() < deadline:
            request_cancel(request_id)  # again until the listener has subscribed
            time.sleep(0.2)
    finally:
        stop.set()
        listener.join(5)
    assert request_id in heard
    assert is_cancel_requested(request_id)


def test_claims_and_engine_stats_spread_over_every_master_are_all_found(on_cluster):
    client = bus_clients.redis_client()
    request_ids = [uuid.uuid4().hex for _ in range(12)]
    for request_id in request_ids:
        client.hset(RUNNING_KEY.format(request_id), mapping={"worker": "gone:1:x", "tokens": 7, "inbox": ""})
    workers = [f"w{n}" for n in range(6)]
    for worker in workers:
        client.set(STATS_KEY_PREFIX + worker, json.dumps({"running": 1}), ex=30)
    masters = {on_cluster.master_of_key(RUNNING_KEY.format(r)) for r in request_ids}
    assert len(masters) > 1  # the scan must visit more than one node

    lost = {claim.request_id: claim.tokens for claim in lost_claims()}
    assert lost == dict.fromkeys(request_ids, 7)
    assert sorted(stats["worker"] for stats in read_engine_stats()) == workers


def test_an_answer_cached_on_the_cluster_is_found_again(on_cluster, alice, chat_feature):
    from inference.web import caches

    chat_feature.cache_ttl_s = 60
    chat_feature.save(update_fields=["cache_ttl_s"])
    key = caches.cache_key(chat_feature, alice, "test-model", 32, [{"role": "user", "content": "Hello  there"}])
    assert caches.lookup(chat_feature, key) is None
    caches.store(chat_feature, key, text="Hi!", completion_tokens=2, cost_micro_usd=5, request_id="r1")
    hit = caches.lookup(chat_feature, key)
    assert hit is not None and (hit.text, hit.kind) == ("Hi!", "exact")


def test_a_cluster_with_no_node_answering_fails_like_one_dead_redis(cluster, settings, alice, chat_feature):
    """Closed for the guard, a miss for the caches, a RedisError for the bus (redis-py's own
    RedisClusterException is not one, and would escape every `except RedisError`)."""
    from inference.web import caches

    doomed = LocalCluster(BASE_PORT + 30, replicas=0)  # 7130-7132, its own: all of it dies here
    doomed.start()
    try:
        settings.CEILING_COUNTERS_URL = doomed.url
        settings.CEILING_COUNTERS_WAIT_REPLICAS = 0
        _forget_clients()
        Quota.objects.create(period="day", max_requests=10)
        chat_feature.cache_ttl_s = 60
        chat_feature.save(update_fields=["cache_ttl_s"])
        assert admit(request(alice, chat_feature)).admitted  # the clients know the cluster now
        key = caches.cache_key(chat_feature, alice, "test-model", 32, [{"role": "user", "content": "hi"}])
        caches.store(chat_feature, key, text="Hi!", completion_tokens=2, cost_micro_usd=5, request_id="r1")
        assert caches.lookup(chat_feature, key) is not None
    finally:
        doomed.stop()

    refused = admit(request(alice, chat_feature))
    assert not refused.admitted and refused.code == "guard_unavailable"
    assert caches.lookup(chat_feature, key) is None
    with pytest.raises(redis.RedisError):
        is_cancel_requested("r1")
    with pytest.raises(redis.RedisError):
        lost_claims()

    async def blocking_read() -> None:
        client = bus_clients.async_client()
        try:
            await client.blpop(["{x}"], timeout=1)
        finally:
            await client.aclose()

    with pytest.raises(redis.RedisError):
        asyncio.run(blocking_read())

    # And a cluster that never answered: the guard cannot even build its client, and says so.
    settings.CEILING_COUNTERS_URL = f"redis+cluster://127.0.0.1:{BASE_PORT + 99}/0"
    _forget_clients()
    started = time.perf_counter()
    never = admit(request(alice, chat_feature))
    assert not never.admitted and never.code == "guard_unavailable"
    assert time.perf_counter() - started < 1.0
    _forget_clients()


# --- failover (last: it kills a master, which comes back as a replica) ----------------------------


def test_a_master_killed_under_load_fails_over_with_no_overshoot_and_counters_equal_the_ledger(
    on_cluster, alice, chat_feature
):
    # Far more room than the load uses before the kill: admissions are fast enough that a small cap
    # could be filled between the promotion and the moment the test reads the count.
    cap, before_kill = 400, 60
    Quota.objects.create(period="day", max_requests=cap)
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def load() -> None:
        try:
            while not stop.is_set():
                decision = admit(request(alice, chat_feature))
                with lock:
                    outcomes["admitted" if decision.admitted else decision.code] += 1
                if decision.admitted and outcomes["admitted"] % 2:
                    finish(decision, 3)  # settlements cross the failover too
                time.sleep(0.01)
        finally:
            connection.close()

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        _wait_for(lambda: outcomes["admitted"] >= before_kill, f"{before_kill} admitted")
        master = on_cluster.master_of_key("{ceiling}")
        on_cluster.kill(master)
        on_cluster.wait_for_failover(master)
        admitted_at_failover = outcomes["admitted"]
        # The promoted master lists no replica, so none can take over from it with an old copy:
        # it admits without waiting, up to the cap.
        _wait_for(lambda: outcomes["user_requests_per_day"] >= 20, "the cap to refuse after the failover", 90)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)

    admitted_rows = TokenLog.objects.filter(admitted=True).count()
    assert outcomes["admitted"] == admitted_rows <= cap  # no overshoot across the failover
    assert outcomes["guard_unavailable"] > 0  # the failover window was refused, fail closed
    assert outcomes["admitted"] > admitted_at_failover  # and the promoted master admitted on its own

    # A killed admission whose reply was lost may still hold a reservation: reconciliation frees it,
    # then the counters equal the ledger and the cap admits exactly up to itself.
    counter_store.cache_clear()
    retry_unsettled(now=timezone.now() + timedelta(minutes=5))
    state, (used, reserved) = counter_and_ledger(alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)
    more = admit_in_threads([request(alice, chat_feature) for _ in range(cap)], threads=12)
    assert admitted_rows + sum(d.admitted for d in more) == cap

    on_cluster.restart(master)  # it rejoins as the new master's replica, which admissions wait for again
    assert on_cluster.replica_of(on_cluster.master_of_key("{ceiling}")) == master


def _wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)
