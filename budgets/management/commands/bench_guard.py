"""`manage.py bench_guard`: how fast the budget guard admits and settles, from one process.

Two levels, each an admit followed by a settle, timed together:

* counters — CounterStore.admit + CounterStore.settle: the two Lua scripts, three ceilings a request
  (user day, user month, provider month), under a private key prefix;
* guard — budgets.guard.admit + the settle path a worker takes without inference (do_record_usage,
  then guard.settle): the Lua scripts plus the ledger's database writes, for a throwaway user,
  feature and provider that are deleted afterwards. With `--scopes all` the user is in a capped
  team and every request comes with a capped API key and a capped tag: five scopes (user, team,
  key, tag, provider) checked in the one admission, what an organisation's request costs.

Nothing is ever refused: the limits are far above what the run can use. Requests go one at a time,
so admissions/s counts whole admit+settle cycles (two Redis round trips at the counters level).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import redis
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.utils import timezone

from accounts.actions import do_create_api_key
from accounts.management.database import DatabaseCommand
from accounts.models import ApiKey
from budgets import guard, live
from budgets.actions import Usage as LedgerUsage
from budgets.actions import do_record_usage
from budgets.counters import CounterSpec, CounterStore, Limits, Usage
from budgets.ledger_writer import writer
from budgets.models import (
    Feature,
    ModelPrice,
    Period,
    Provider,
    Quota,
    TagQuota,
    Team,
    TeamMembership,
    TeamQuota,
    TokenLog,
)

LEVELS = ("counters", "guard")
SCOPES = ("user", "all")
WARMUP = 200
# Each level's targets (p99 ms, admit+settle cycles/s): the Lua scripts alone, and the guard with
# its ledger on PostgreSQL from 2 processes (issue #23: gateway rates on this 2-core machine).
TARGETS = {"counters": (2.0, 3000), "guard": (10.0, 1000)}
PROMPT_TOKENS = 120
MAX_TOKENS = 256
COMPLETION_TOKENS = 200
# Far above anything a run can spend, so every admission is granted in full.
HUGE = 10**15
MAX_REQUESTS = 10**9  # Quota.max_requests is a 32-bit column
BENCH_TTL_S = 3600  # the bench's own counters vanish by themselves if cleanup never runs
MODEL = "bench-model"
PRICE_IN, PRICE_OUT = 150_000, 600_000  # micro-dollars per million tokens: exercises the cost ceiling

Step = Callable[[int], None]


@dataclass(frozen=True)
class LevelResult:
    level: str
    n: int
    warmup: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    admissions_per_s: float
    p99_target_met: bool
    throughput_target_met: bool
    database: str | None  # the database vendor written to, None for Redis only


def _check_arguments(n: int, warmup: int, threads: int, processes: int = 1) -> None:
    if processes < 1:
        raise CommandError(f"--processes must be at least 1, got {processes}")
    if threads < 1:
        raise CommandError(f"--threads must be at least 1, got {threads}")
    if n < 1:
        raise CommandError(f"--n must be at least 1, got {n}")
    if warmup < 0:
        raise CommandError(f"--warmup cannot be negative, got {warmup}")


class Command(DatabaseCommand):
    help = "Benchmark the budget guard against the local Redis: admit+settle p50/p99 and admissions/s."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--n", type=int, default=5000, help="timed admissions per level (default 5000)")
        parser.add_argument("--level", choices=LEVELS, help="counters or guard (default: both)")
        parser.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed admissions first (default {WARMUP})")
        parser.add_argument("--json", dest="json_path", help="also write the numbers to this file as JSON")
        parser.add_argument(
            "--scopes", choices=SCOPES, default="user",
            help="guard level: the user and the provider (default), or all five scopes: user, team, API key, tag, provider",
        )
        parser.add_argument(
            "--threads", type=int, default=1,
            help="admit+settle cycles in flight at once from each process (default 1)",
        )
        parser.add_argument(
            "--processes", type=int, default=1,
            help="guard level: processes admitting at the same time, each with --threads threads, as web processes do (default 1)",
        )

    def needs_database(self, options: dict) -> bool:
        # The counters level is Redis alone; only the guard level writes ledger rows. Bad arguments
        # are left for handle() to explain first: they are wrong whatever the database holds.
        try:
            _check_arguments(options["n"], options["warmup"], options.get("threads", 1), options.get("processes", 1))
            _json_target(options["json_path"])
        except CommandError:
            return False
        return options["level"] != "counters"

    def handle(self, *args, n: int, level: str | None, warmup: int, json_path: str | None, threads: int = 1,
               processes: int = 1, **options) -> None:
        _check_arguments(n, warmup, threads, processes)
        self.threads = threads
        self.processes = processes
        self.scopes = options.get("scopes", "user")
        target = _json_target(json_path)
        store = _reachable_store()
        results = [self.run_level(name, store, n, warmup) for name in ([level] if level else LEVELS)]
        if target is not None:
            report = {**_report(n, warmup, results), "threads": threads, "processes": processes, "scopes": self.scopes}
            target.write_text(json.dumps(report, indent=2) + "\n")
            self.stdout.write(f"wrote {target}")

    def run_level(self, level: str, store: CounterStore, n: int, warmup: int) -> LevelResult:
        run_id = uuid.uuid4().hex[:12]
        context = counters_level(store, run_id) if level == "counters" else guard_level(run_id, self.scopes == "all")
        try:
            with context as step:
                if level == "guard" and self.processes > 1:
                    latencies_ms, wall_s = time_in_processes(step, n, warmup, self.processes, self.threads)
                else:
                    latencies_ms, wall_s = time_steps(step, n, warmup, self.threads)
        except redis.RedisError as exc:
            raise CommandError(f"Redis failed during the {level} benchmark: {exc}") from exc
        database = connection.vendor if level == "guard" else None
        result = summarize(level, latencies_ms, wall_s, warmup, database)
        self.print_result(result)
        return result

    def print_result(self, r: LevelResult) -> None:
        what = "Redis Lua only, 3 ceilings" if r.database is None else f"includes {_vendor_name(r.database)} writes"
        self.stdout.write(
            f"{r.level:<9} n={r.n}  p50 {r.p50_ms:.3f} ms  p99 {r.p99_ms:.3f} ms  "
            f"{r.admissions_per_s:,.0f} admissions/s  ({what})"
        )
        p99_ms, per_s = TARGETS[r.level]
        self.stdout.write(
            f"          p99 ≤ {p99_ms:g} ms: {_verdict(r.p99_target_met)};  "
            f"≥ {per_s:,} admissions/s: {_verdict(r.throughput_target_met)}"
        )


# --- the two levels: each yields a step(i) that admits and settles request i ----------------------


@contextmanager
def counters_level(store: CounterStore, run_id: str) -> Iterator[Step]:
    """The Lua scripts alone, on counters under ceiling:bench:<run_id>: so real counters are never touched."""
    # Under the store's own prefix ({ceiling} on a Redis Cluster: the bench's keys share the counters' slot).
    bench = CounterStore(store.client, prefix=f"{store.prefix}:bench:{run_id}", wait_replicas=store.wait_replicas,
                         wait_timeout_ms=store.wait_timeout_ms)
    specs = [
        CounterSpec(f"{bench.prefix}:user:day", Limits(requests=HUGE, tokens=HUGE), BENCH_TTL_S),
        CounterSpec(f"{bench.prefix}:user:month", Limits(requests=HUGE, tokens=HUGE), BENCH_TTL_S),
        CounterSpec(f"{bench.prefix}:provider:month", Limits(cost_micro_usd=HUGE), BENCH_TTL_S),
    ]
    keys = [spec.key for spec in specs]
    request_ids: list[str] = []
    used_cost = -(-(PROMPT_TOKENS * PRICE_IN + COMPLETION_TOKENS * PRICE_OUT) // 1_000_000)

    def step(i: int) -> None:
        request_id = f"{run_id}-{i}"
        request_ids.append(request_id)
        result = bench.admit(
            request_id, specs, prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS,
            price_in_per_million=PRICE_IN, price_out_per_million=PRICE_OUT,
        )
        _require_ok(result.status, request_id)
        bench.settle(request_id, keys, used_tokens=PROMPT_TOKENS + COMPLETION_TOKENS, used_cost_micro_usd=used_cost)

    try:
        for spec in specs:
            bench.install(spec.key, Usage(), Usage(), spec.ttl_s)
        yield step
    finally:
        markers = [m for rid in request_ids for m in (bench.admitted_marker(rid), bench.settled_marker(rid))]
        _delete_keys(store.client, keys + markers)


@contextmanager
def guard_level(run_id: str, all_scopes: bool = False) -> Iterator[Step]:
    """The full guard with its ledger writes, for a throwaway user, feature and provider (and, with
    all_scopes, a team, an API key and a tag, each capped far above what the run spends)."""
    name = f"bench-{run_id}"
    api_key, tags = None, ()
    with transaction.atomic():  # all or nothing, so a failed setup leaves no half-made cast behind
        user = get_user_model().objects.create_user(name)  # no password: nobody can log in as it
        provider = Provider.objects.create(name=name, monthly_limit_micro_usd=HUGE)
        feature = Feature.objects.create(name=name, description="bench_guard throwaway", provider=provider)
        for period in (Period.DAY, Period.MONTH):
            Quota.objects.create(user=user, feature=None, period=period, max_requests=MAX_REQUESTS, max_tokens=HUGE)
        ModelPrice.objects.create(
            provider=provider, model=MODEL, input_per_million_micro_usd=PRICE_IN,
            output_per_million_micro_usd=PRICE_OUT, effective_from=timezone.now() - timedelta(days=1),
        )
        if all_scopes:
            api_key, tags = _capped_team_key_and_tag(name, user)

    def step(i: int) -> None:
        request_id = f"{name}-{i}"
        decision = guard.admit(
            guard.AdmissionRequest(request_id, user, feature, MODEL, PROMPT_TOKENS, MAX_TOKENS, api_key=api_key, tags=tags)
        )
        _require_ok("ok" if decision.admitted else decision.code, request_id)
        # What a worker does when the answer ends, minus the model: record the usage, then settle.
        usage = LedgerUsage(prompt_tokens=PROMPT_TOKENS, completion_tokens=min(COMPLETION_TOKENS, decision.max_tokens))
        row = do_record_usage(request_id, status=TokenLog.Status.OK, usage=usage, finish_reason="stop",
                              admitted=decision.log)  # a worker has the row: it reads it when it starts
        guard.settle(row)  # the row as the usage's UPDATE … RETURNING left it, as a worker has it

    try:
        yield step
    finally:
        _delete_guard_run(name, user, feature, provider)


def _capped_team_key_and_tag(name: str, user) -> tuple[object, tuple[str, ...]]:
    """A team the user is in, an API key and a tag, each with caps that a run never reaches."""
    team = Team.objects.create(name=name)
    TeamMembership.objects.create(team=team, user=user)
    for period in (Period.DAY, Period.MONTH):
        TeamQuota.objects.create(team=team, period=period, max_requests=MAX_REQUESTS, max_tokens=HUGE,
                                 max_cost_micro_usd=HUGE)
    api_key, _ = do_create_api_key(user, name)
    ApiKey.objects.filter(pk=api_key.pk).update(
        max_requests_per_day=MAX_REQUESTS, max_cost_per_day_micro_usd=HUGE, max_cost_per_month_micro_usd=HUGE
    )
    api_key.refresh_from_db()
    TagQuota.objects.create(tag=name, max_cost_micro_usd=HUGE)
    return api_key, (name,)


def _delete_guard_run(name: str, user, feature: Feature, provider: Provider) -> None:
    # Through the user's (user, created_at) index: request ids have no prefix index (migration 0019).
    rows = TokenLog.objects.filter(user=user, request_id__startswith=f"{name}-")
    request_ids = list(rows.values_list("request_id", flat=True))
    counter_keys = {key for keys in rows.values_list("counter_keys", flat=True) for key in keys}
    store = guard.counter_store()
    markers = [m for rid in request_ids for m in (store.admitted_marker(rid), store.settled_marker(rid))]
    # Counters first: they are keyed by this run's ids, so nothing real is lost.
    _delete_keys(store.client, sorted(store.redis_key(key) for key in counter_keys) + markers)
    rows.delete()  # TokenLog protects its feature, provider, price, team and key
    feature.delete()
    provider.delete()  # and its price
    Team.objects.filter(name=name).delete()  # and its membership and caps
    TagQuota.objects.filter(tag=name).delete()
    user.delete()  # and its quotas and keys


# --- timing -------------------------------------------------------------------------------------


def time_steps(step: Step, n: int, warmup: int, threads: int = 1, first: int = 0) -> tuple[list[float], float]:
    """Per-step latencies in ms after `warmup` untimed steps, and the wall time of the timed ones.

    With threads > 1 that many cycles are in flight at once: one cycle is two Redis round trips
    (≈0.17 ms each on loopback here), so one thread alone is bound by latency, not by Redis.
    """
    for i in range(first, first + warmup):
        step(i)
    first += warmup

    def timed(i: int) -> float:
        before = time.perf_counter()
        step(i)
        return (time.perf_counter() - before) * 1000

    started = time.perf_counter()
    if threads == 1:
        latencies_ms = [timed(i) for i in range(first, first + n)]
    else:
        with ThreadPoolExecutor(threads) as pool:
            latencies_ms = list(pool.map(timed, range(first, first + n)))
    return latencies_ms, time.perf_counter() - started


def time_in_processes(step: Step, n: int, warmup: int, processes: int, threads: int) -> tuple[list[float], float]:
    """time_steps in `processes` forked processes at once, each its share of n after its own warmup;
    the wall time runs from the first process's start to the last one's end."""
    context = multiprocessing.get_context("fork")
    _close_database_connections()  # each child opens its own; a shared socket would mix their replies
    ready = context.Barrier(processes)
    results = context.Queue()
    shares = [n // processes + (1 if k < n % processes else 0) for k in range(processes)]
    children = [
        context.Process(target=_timed_child, args=(step, k, shares[k], warmup, threads, ready, results))
        for k in range(processes)
    ]
    for child in children:
        child.start()
    reports = [results.get() for _ in children]
    for child in children:
        child.join()
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise CommandError(f"a benchmark process failed: {failed[0]}")
    writes, commits = sum(r["writes"] for r in reports), sum(r["commits"] for r in reports)
    if commits:
        print(f"ledger writer: {writes:,} writes in {commits:,} commits ({writes / commits:.1f} a commit)")
    latencies = [ms for r in reports for ms in r["latencies_ms"]]
    wall_s = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    return latencies, wall_s


def _close_database_connections() -> None:
    connections.close_all()
    for wrapper in connections.all():
        if hasattr(wrapper, "close_pool"):  # PostgreSQL's pool holds open sockets and threads of its own
            wrapper.close_pool()


CHILD_STRIDE = 10**8  # request numbers of child k start at k * CHILD_STRIDE: no two children share an id


def _timed_child(step: Step, k: int, share: int, warmup: int, threads: int, ready, results) -> None:
    try:
        offset = k * CHILD_STRIDE
        for i in range(warmup):
            step(offset + i)
        ready.wait()
        started = time.time()
        latencies_ms, _ = time_steps(lambda i: step(offset + i), share, 0, threads, first=warmup)
        results.put({"latencies_ms": latencies_ms, "started": started, "ended": time.time(),
                     "writes": writer.writes, "commits": writer.batches})
    except Exception as exc:  # noqa: BLE001 - the parent reports it; a child must always answer
        ready.abort()
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        writer.drain()  # the counters_settled marks queued without waiting
        live.flush()  # the metrics and dashboard points not yet sent (a forked child skips atexit)
        guard.flush_settled_marks()  # and the counters_settled marks
        connections.close_all()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was really measured, never an interpolation."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(level: str, latencies_ms: list[float], wall_s: float, warmup: int, database: str | None) -> LevelResult:
    ordered = sorted(latencies_ms)
    p99 = percentile(ordered, 0.99)
    rate = len(ordered) / wall_s
    return LevelResult(
        level=level,
        n=len(ordered),
        warmup=warmup,
        p50_ms=percentile(ordered, 0.50),
        p99_ms=p99,
        mean_ms=sum(ordered) / len(ordered),
        max_ms=ordered[-1],
        admissions_per_s=rate,
        p99_target_met=p99 <= TARGETS[level][0],
        throughput_target_met=rate >= TARGETS[level][1],
        database=database,
    )


# --- small helpers ------------------------------------------------------------------------------


def _json_target(json_path: str | None) -> Path | None:
    # Checked before the run, so a typo does not cost a whole benchmark.
    if json_path is None:
        return None
    target = Path(json_path)
    if not target.parent.is_dir():
        raise CommandError(f"--json {json_path!r}: the folder {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise CommandError(f"--json {json_path!r} is a folder; give a file name")
    return target


def _reachable_store() -> CounterStore:
    store = guard.counter_store()
    try:
        store.client.ping()
    except redis.RedisError as exc:
        raise CommandError(f"Redis does not answer at REDIS_URL: {exc}") from exc
    return store


def _require_ok(status: str, request_id: str) -> None:
    # A refusal would time a different (shorter) path and make the numbers meaningless.
    if status != "ok":
        raise CommandError(f"the guard did not admit {request_id} ({status}); the benchmark needs every admission granted")


def _delete_keys(client: redis.Redis, keys: list[str], batch: int = 1000) -> None:
    for start in range(0, len(keys), batch):
        client.unlink(*keys[start : start + batch])


def _report(n: int, warmup: int, results: list[LevelResult]) -> dict:
    return {
        "n": n,
        "warmup": warmup,
        "targets": {level: {"p99_ms": p99, "admissions_per_s": rate} for level, (p99, rate) in TARGETS.items()},
        "levels": {r.level: asdict(r) for r in results},
    }


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _vendor_name(vendor: str) -> str:
    return {"postgresql": "PostgreSQL", "sqlite": "SQLite"}.get(vendor, vendor)
