"""`manage.py loadtest --web N --workers M`: a scale-out simulation on loopback, with processes killed.

It starts what a scaled-out Ceiling runs, with the command lines `make run` uses:

    a stub remote engine (a real HTTP server streaming at a fixed rate: inference/engine/bench/stub_peer.py)
    N daphne processes            (the web tier, each on its own port)
    M Celery workers              (each streams the stub's answers; the remote adapter, no local model work)

all on the configured PostgreSQL and Redis, and one run's cast: --users users, each with an API key
and a daily request cap, half of them in a team with a daily team cap. A client then sends --requests
streamed /v1 chats, --concurrency at a time, spread over the web processes, from users drawn from a
long-tailed (Zipf) distribution, as real traffic is: a few users ask a lot and meet their cap, and
the team meets its own. During the run it SIGKILLs one web process, then one worker (and, with
--kill naming it, one Redis Cluster master of CEILING_COUNTERS_URL when that is a cluster).

The report (JSON) says what a person running this at scale must know:
- admissions per second (ledger rows admitted ÷ the span of their admission times), and the guard's
  decisions per second (every row, admitted or refused, ÷ the span of all rows);
- TTFT p50/p99 through Ceiling, the same burst's TTFT straight to the stub, and the difference;
- overshoot: requests admitted beyond any user's or the team's cap (must be 0);
- rows lost: answers a client received with no ledger row, and rows never settled (must be 0);
- counters = ledger: every counter of the run's users and team against its ledger rebuild;
- what each kill cost (requests cut, how they ended).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from budgets.reconcile import SETTLE_RETRY_AFTER_S
from inference.worker.lost import UNCLAIMED_GRACE_S
from project import stack

FEATURE = "loadtest"
PROVIDER = "loadtest-stub"
KILLABLE = ("web", "worker", "redis-master")
# The stub answers within a second: the run's processes give up on a first token after 15 s, not 60,
# so a request lost with a killed web process (admitted, never dispatched) is settled by the workers'
# sweep (inference/worker/lost.py) within the report's wait.
FIRST_TOKEN_TIMEOUT_S = 15
ENGINE_FIRST_TOKEN_S = 10
SWEEP_EVERY_S = 2
SETTLE_TIMEOUT_S = FIRST_TOKEN_TIMEOUT_S + UNCLAIMED_GRACE_S + 4 * SWEEP_EVERY_S + 10
# A settlement the cluster's replicas did not acknowledge in a failover is left to reconciliation,
# which replays it SETTLE_RETRY_AFTER_S after the request finished: the run's workers reconcile every
# 5 s, and the report waits for them before it compares counters with the ledger.
RECONCILE_EVERY_S = 5
RECONCILE_WAIT_S = SETTLE_RETRY_AFTER_S + 3 * RECONCILE_EVERY_S + 10


@dataclass(frozen=True)
class ScalePlan:
    web: int = 3
    workers: int = 3
    users: int = 1000
    requests: int = 1500
    concurrency: int = 48
    user_cap: int = 4  # requests per user per day
    team_cap: int = 300  # requests per day for the team (half of the users)
    max_tokens: int = 8
    first_byte_ms: int = 100  # the stub's time to its first token …
    token_ms: int = 10  # … and between tokens
    kill: tuple[str, ...] = ("web", "worker")
    seed: int = 7
    log_dir: Path = field(default_factory=lambda: Path(settings.VAR_DIR) / "loadtest")

    def check(self) -> None:
        if min(self.web, self.workers, self.users, self.requests, self.concurrency, self.max_tokens) < 1:
            raise ValueError("--web, --workers, --users, --requests, --concurrency and --max-tokens must be at least 1")
        if min(self.user_cap, self.team_cap) < 1:
            raise ValueError("--user-cap and --team-cap must be at least 1")
        unknown = set(self.kill) - set(KILLABLE)
        if unknown:
            raise ValueError(f"--kill: {', '.join(sorted(unknown))} is not one of {', '.join(KILLABLE)}")
        if "web" in self.kill and self.web < 2:
            raise ValueError("killing a web process needs --web 2 or more (the others take over)")
        if "worker" in self.kill and self.workers < 2:
            raise ValueError("killing a worker needs --workers 2 or more (the others take over)")
        if "redis-master" in self.kill and not counters_on_cluster():
            raise ValueError("--kill redis-master needs CEILING_COUNTERS_URL to name a Redis Cluster")


def counters_on_cluster() -> bool:
    from budgets.redis_clients import is_cluster_url

    return is_cluster_url(settings.CEILING_COUNTERS_URL or "")


# --- the cast ---------------------------------------------------------------------------------------


@dataclass
class Cast:
    run: str
    keys: list[str]  # plaintext API key per user, by index
    user_ids: list[int]
    team_id: int
    team_members: set[int]
    feature_id: int
    provider_id: int


def make_cast(plan: ScalePlan, stub_url: str) -> Cast:
    """The run's users (with keys and caps), its team (with its cap), and the feature on the stub."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password

    from accounts.models import KEY_PREFIX, SHOWN_CHARS, ApiKey, hash_key
    from budgets.models import Feature, Period, Provider, Quota, Team, TeamMembership, TeamQuota
    from inference.engine.bench.stub_peer import MODEL_ID

    run = timezone.now().strftime("%m%d%H%M%S") + secrets.token_hex(2)
    provider, _ = Provider.objects.update_or_create(
        name=PROVIDER,
        defaults={"kind": Provider.Kind.OPENAI_COMPATIBLE, "base_url": f"{stub_url}/v1", "remote_model": MODEL_ID,
                  "api_key_env": "", "monthly_limit_micro_usd": None},
    )
    feature, _ = Feature.objects.update_or_create(
        name=FEATURE,
        defaults={"description": "manage.py loadtest --web/--workers (a stub remote engine)", "enabled": True,
                  "mode": Feature.Mode.CHAT, "provider": provider, "max_input_tokens": 512,
                  "max_output_tokens": plan.max_tokens, "cache_ttl_s": 0},
    )
    unusable = make_password(None)
    users = get_user_model().objects.bulk_create(
        get_user_model()(username=f"lt{run}-{i:05d}", password=unusable) for i in range(plan.users)
    )
    keys = [KEY_PREFIX + secrets.token_urlsafe(24) for _ in users]
    now = timezone.now()
    ApiKey.objects.bulk_create(
        ApiKey(user=user, name="loadtest", prefix=key[:SHOWN_CHARS], hashed_key=hash_key(key), created_at=now)
        for user, key in zip(users, keys, strict=True)
    )
    # Each user's own rows replace the defaults: a daily request cap and no monthly one.
    Quota.objects.bulk_create(
        [Quota(user=user, period=Period.DAY, max_requests=plan.user_cap) for user in users]
        + [Quota(user=user, period=Period.MONTH) for user in users]
    )
    team = Team.objects.create(name=f"loadtest {run}")
    members = users[: len(users) // 2]
    TeamMembership.objects.bulk_create(TeamMembership(user=user, team=team) for user in members)
    TeamQuota.objects.create(team=team, period=Period.DAY, max_requests=plan.team_cap)
    return Cast(run, keys, [u.pk for u in users], team.pk, {u.pk for u in members}, feature.pk, provider.pk)


def drawn_users(plan: ScalePlan) -> list[int]:
    """Who sends each request: Zipf-like (s = 1.1) over the users, in a shuffled order of ranks."""
    rng = random.Random(plan.seed)
    ranks = list(range(plan.users))
    rng.shuffle(ranks)
    weights = [1 / (rank + 1) ** 1.1 for rank in ranks]
    return rng.choices(range(plan.users), weights=weights, k=plan.requests)


# --- the processes ----------------------------------------------------------------------------------


class Topology:
    """The stub, the web processes and the workers, with their logs; stopped together."""

    def __init__(self, plan: ScalePlan) -> None:
        self.plan = plan
        self.log_dir = plan.log_dir
        self.queue = f"loadtest-{os.getpid()}"  # no other worker on this Redis takes the run's chats
        self.stub: subprocess.Popen | None = None
        self.stub_url = ""
        self.webs: list[tuple[int, subprocess.Popen]] = []
        self.workers: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        env = stack.child_env(
            CEILING_INFERENCE_QUEUE=self.queue,
            DATABASE_URL=stack.database_url(settings.DATABASES["default"]),
            REDIS_URL=settings.REDIS_URL,
            CEILING_COMPILE_DECODE="0",
            CEILING_TORCH_THREADS="1",
            CEILING_IGNORE_EOS="1",
            CEILING_FIRST_TOKEN_TIMEOUT_S=str(FIRST_TOKEN_TIMEOUT_S),
            CEILING_ENGINE_FIRST_TOKEN_S=str(ENGINE_FIRST_TOKEN_S),
            CEILING_LOST_SWEEP_EVERY_S=str(SWEEP_EVERY_S),
            CEILING_RECONCILE_EVERY_S=str(RECONCILE_EVERY_S),
        )
        env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        return env

    def start_stub(self) -> str:
        port = stack.free_port()
        self.stub = self._spawn(
            [sys.executable, "-m", "inference.engine.bench.stub_peer", "--port", str(port),
             "--first-byte-ms", str(self.plan.first_byte_ms), "--token-ms", str(self.plan.token_ms)],
            "stub.log", stack.child_env(),
        )
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=20, what="the stub engine")
        self.stub_url = f"http://127.0.0.1:{port}"
        return self.stub_url

    def start_stack(self, progress) -> None:
        from inference.engines import model_dir
        from inference.tools.stack_bench import _live_workers

        model_dir(progress=progress)  # converted once, before the workers start (as `make run` does)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self.env()
        before = _live_workers()
        for i in range(self.plan.workers):
            argv = stack.worker_argv(max(16, self.plan.concurrency), f"loadtest{i}-{os.getpid()}@%h", queues=self.queue)
            self.workers.append(self._spawn(argv, f"worker-{i}.log", env))
        for i in range(self.plan.web):
            port = stack.free_port()
            self.webs.append((port, self._spawn(stack.daphne_argv("127.0.0.1", port), f"web-{i}.log", env)))
        progress(f"loadtest: {self.plan.web} daphne and {self.plan.workers} workers starting (logs in {self.log_dir})…")
        for port, _ in self.webs:
            stack.wait_until(lambda port=port: stack.port_answers("127.0.0.1", port), timeout=90, what="daphne")
        stack.wait_until(lambda: len(_live_workers() - before) >= self.plan.workers, timeout=300,
                         what=f"{self.plan.workers} workers")

    def web_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port, _ in self.webs]

    def kill_web(self, index: int) -> None:
        self.webs[index][1].send_signal(signal.SIGKILL)

    def kill_worker(self, index: int) -> None:
        self.workers[index].send_signal(signal.SIGKILL)

    def stop(self) -> None:
        stack.stop_all([p for _, p in self.webs] + self.workers + ([self.stub] if self.stub else []))

    def _spawn(self, argv: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(argv, env=env, stdout=(self.log_dir / log_name).open("w"), stderr=subprocess.STDOUT)


def kill_a_counters_master() -> str:
    """SIGKILL the Redis Cluster master that holds the guard's counters (their one slot, {ceiling});
    its replica takes over. Loopback only: the process is found by the pid the server reports."""
    from budgets.counters import CLUSTER_PREFIX
    from budgets.redis_clients import node_client, sync_client

    master = node_client(sync_client(settings.CEILING_COUNTERS_URL), CLUSTER_PREFIX)
    address = master.connection_pool.connection_kwargs
    if address.get("host") not in ("127.0.0.1", "localhost", "::1"):
        raise RuntimeError(f"the counters' master is at {address.get('host')}, not on this machine: kill it there")
    os.kill(int(master.info("server")["process_id"]), signal.SIGKILL)
    return f"{address['host']}:{address['port']}"


# --- the client -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    user: int
    web: int
    status: int = 0  # HTTP status; 0 when no answer came
    code: str = ""  # the refusal's or error's code
    request_id: str = ""
    ttft_ms: float | None = None
    tokens: int = 0
    finished: bool = False  # [DONE] arrived
    error: str = ""
    sent_at: float = 0.0


class Client:
    """Streams chats at the web processes, round robin over those still alive."""

    def __init__(self, plan: ScalePlan, urls: list[str], cast: Cast) -> None:
        self.plan, self.urls, self.cast = plan, urls, cast
        self.alive = list(range(len(urls)))
        self.sent = 0

    def pick_web(self, index: int) -> int:
        return self.alive[index % len(self.alive)]

    async def run(self, users: list[int], events: list[tuple[float, callable]]) -> list[Outcome]:
        import httpx

        limits = httpx.Limits(max_connections=self.plan.concurrency * 2, max_keepalive_connections=self.plan.concurrency)
        gate = asyncio.Semaphore(self.plan.concurrency)
        pending = sorted(events, key=lambda e: e[0])
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as http:
            async def one(index: int, user: int) -> Outcome:
                async with gate:
                    self.sent += 1
                    while pending and self.sent >= pending[0][0] * len(users):
                        pending.pop(0)[1]()
                    return await self.chat(http, index, user)
            return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(users))))

    async def chat(self, http, index: int, user: int) -> Outcome:
        import httpx

        outcome = Outcome(index, user, self.pick_web(index), sent_at=time.perf_counter())
        body = {"model": FEATURE, "feature": FEATURE, "stream": True, "max_tokens": self.plan.max_tokens,
                "messages": [{"role": "user", "content": f"Say {index}."}]}
        headers = {"Authorization": f"Bearer {self.cast.keys[user]}"}
        try:
            async with http.stream("POST", f"{self.urls[outcome.web]}/v1/chat/completions", json=body, headers=headers) as answer:
                outcome.status = answer.status_code
                outcome.request_id = answer.headers.get("x-request-id", "")
                if answer.status_code != 200:
                    outcome.code = error_code(await answer.aread())
                    return outcome
                await read_stream(answer, outcome)
        except httpx.ConnectError as exc:
            # Refused before anything was sent: this web process is gone; the next one takes it.
            self._drop(outcome.web)
            if self.alive:
                return await self.chat(http, index, user)
            outcome.error = f"connect: {exc}"
        except (httpx.HTTPError, OSError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome

    def _drop(self, web: int) -> None:
        if web in self.alive:
            self.alive.remove(web)


async def read_stream(answer, outcome: Outcome) -> None:
    async for line in answer.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            outcome.finished = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            outcome.code = chunk["error"].get("code") or "error"
            return
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            if outcome.ttft_ms is None:
                outcome.ttft_ms = (time.perf_counter() - outcome.sent_at) * 1000
            outcome.tokens += 1


def error_code(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"].get("code") or "error"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unparseable"


async def direct_ttfts(stub_url: str, plan: ScalePlan, count: int) -> list[float]:
    """The same kind of chat straight to the stub, as many at once as the run sends: the baseline."""
    import httpx

    from inference.engine.bench.stub_peer import MODEL_ID

    gate = asyncio.Semaphore(plan.concurrency)
    body = {"model": MODEL_ID, "stream": True, "max_tokens": plan.max_tokens, "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient(timeout=30.0) as http:
        async def one() -> float | None:
            async with gate:
                outcome = Outcome(-1, -1, -1, sent_at=time.perf_counter())
                async with http.stream("POST", f"{stub_url}/v1/chat/completions", json=body) as answer:
                    await read_stream(answer, outcome)
                return outcome.ttft_ms
        return [t for t in await asyncio.gather(*(one() for _ in range(count))) if t is not None]


# --- the verdict ------------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))], 1)


def wait_until_settled(cast: Cast, timeout_s: float = SETTLE_TIMEOUT_S) -> int:
    """Rows of the run still running after the wait (a killed worker's are settled by the sweep)."""
    from budgets.models import TokenLog

    rows = TokenLog.objects.filter(user_id__in=cast.user_ids, status=TokenLog.Status.RUNNING)
    deadline = time.monotonic() + timeout_s
    while rows.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    return rows.count()


def wait_until_counters_match(cast: Cast, timeout_s: float = RECONCILE_WAIT_S) -> dict:
    """Counters that disagreed with the ledger once every row was settled, and how long the workers'
    reconciliation took to bring them back (they disagree only after a failover: see above)."""
    first = readable_counter_mismatches(cast)
    started = time.monotonic()
    left = first
    while left and time.monotonic() - started < timeout_s:
        time.sleep(RECONCILE_EVERY_S)
        left = readable_counter_mismatches(cast)
    return {"mismatched": len(first), "examples": first[:5],
            "reconciled_after_s": round(time.monotonic() - started, 1) if first and not left else None}


def verdict(plan: ScalePlan, cast: Cast, outcomes: list[Outcome]) -> dict:
    from django.db.models import Count

    from budgets.models import TokenLog

    rows = TokenLog.objects.filter(user_id__in=cast.user_ids)
    admitted = rows.filter(admitted=True)
    per_user = dict(admitted.values_list("user_id").annotate(n=Count("id")))
    team_admitted = admitted.filter(team_id=cast.team_id).count()
    overshoot_users = sum(max(0, n - plan.user_cap) for n in per_user.values())
    overshoot_team = max(0, team_admitted - plan.team_cap)
    admitted_count, rows_count = sum(per_user.values()), rows.count()
    seconds = span_s(admitted)
    decided_s = span_s(rows)  # every request the guard decided on, admitted or refused by a cap
    known = set(rows.values_list("request_id", flat=True))
    answered = [o for o in outcomes if o.tokens > 0]
    lost = [o.request_id or f"#{o.index}" for o in answered if o.request_id not in known]
    return {
        "admitted": admitted_count,
        "admissions_per_s": round(admitted_count / seconds, 1) if seconds > 0 else None,
        "admission_span_s": round(seconds, 2),
        "guard_decisions_per_s": round(rows_count / decided_s, 1) if decided_s > 0 else None,
        "ledger_rows": rows_count,
        "rows_by_status": dict(Counter(rows.values_list("status", flat=True))),
        "team_admitted": team_admitted,
        "team_cap": plan.team_cap,
        "users_at_their_cap": sum(n >= plan.user_cap for n in per_user.values()),
        "overshoot": overshoot_users + overshoot_team,
        "rows_lost": len(lost),
        "rows_lost_ids": lost[:20],
        "rows_unsettled": rows.filter(status=TokenLog.Status.RUNNING).count(),
        "counter_mismatches": readable_counter_mismatches(cast),
    }


def span_s(rows) -> float:
    """Seconds from the first row's creation to the last's (0 for none or one)."""
    from django.db.models import Max, Min

    span = rows.aggregate(first=Min("created_at"), last=Max("created_at"))
    return (span["last"] - span["first"]).total_seconds() if span["first"] else 0.0


def readable_counter_mismatches(cast: Cast) -> list[str]:
    import redis

    try:
        return counter_mismatches(cast)
    except redis.RedisError as exc:  # e.g. a slot's master and replica both gone: say so, keep the report
        return [f"the counters could not be read: {exc}"]


def counter_mismatches(cast: Cast) -> list[str]:
    """Each counter of the run's users and team that disagrees with its ledger rebuild."""
    from django.contrib.auth import get_user_model

    from budgets.guard import applicable_ceilings, counter_store, ledger_snapshot, request_scopes
    from budgets.models import Feature

    feature = Feature.objects.select_related("provider").get(pk=cast.feature_id)
    store, now, seen, wrong = counter_store(), timezone.now(), set(), []
    for user in get_user_model().objects.filter(pk__in=cast.user_ids):
        for ceiling in applicable_ceilings(user, feature, feature.provider, now, scopes=request_scopes(user)):
            if ceiling.spec.key in seen:
                continue
            seen.add(ceiling.spec.key)
            state = store.state(ceiling.spec.key)
            if state is None:
                continue  # never built (a user who sent nothing): nothing to disagree with
            used, reserved, _ = ledger_snapshot(ceiling.ledger_filter)
            if (state.used.requests, state.reserved.requests) != (used.requests, reserved.requests):
                wrong.append(f"{ceiling.spec.key}: counter {state.used.requests}+{state.reserved.requests}, "
                             f"ledger {used.requests}+{reserved.requests}")
    return wrong


def latency(outcomes: list[Outcome], direct: list[float], plan: ScalePlan) -> dict:
    through = [o.ttft_ms for o in outcomes if o.ttft_ms is not None]
    p50, p99, d50, d99 = percentile(through, 50), percentile(through, 99), percentile(direct, 50), percentile(direct, 99)
    return {
        "ttft_p50_ms": p50, "ttft_p99_ms": p99,
        "direct_ttft_p50_ms": d50, "direct_ttft_p99_ms": d99,
        "added_ttft_p50_ms": round(p50 - d50, 1) if p50 is not None and d50 is not None else None,
        "added_ttft_p99_ms": round(p99 - d99, 1) if p99 is not None and d99 is not None else None,
    }


def client_summary(outcomes: list[Outcome]) -> dict:
    ends = Counter(
        "done" if o.finished else (o.code or ("cut" if o.status == 200 else "no_answer")) for o in outcomes
    )
    return {"sent": len(outcomes), "ends": dict(ends), "errors": [o.error for o in outcomes if o.error][:10]}


# --- the run ----------------------------------------------------------------------------------------


def run_scaleout(plan: ScalePlan, progress=print) -> dict:
    plan.check()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the progress
    topology = Topology(plan)
    kills: list[dict] = []
    try:
        stub_url = topology.start_stub()
        cast = make_cast(plan, stub_url)
        progress(f"loadtest {cast.run}: {plan.users} users, team cap {plan.team_cap}, user cap {plan.user_cap}")
        topology.start_stack(progress)
        direct = asyncio.run(direct_ttfts(stub_url, plan, min(plan.requests, 4 * plan.concurrency)))
        started = time.perf_counter()
        events = kill_events(plan, topology, kills, lambda: time.perf_counter() - started, progress)
        client = Client(plan, topology.web_urls(), cast)
        outcomes = asyncio.run(client.run(drawn_users(plan), events))
        wall = time.perf_counter() - started
        progress(f"loadtest: {len(outcomes)} requests in {wall:.1f} s; waiting for every row to settle…")
        unsettled = wait_until_settled(cast)
        drift = wait_until_counters_match(cast)
        report = {
            "plan": {k: v for k, v in asdict(plan).items() if k != "log_dir"} | {"counters_on_cluster": counters_on_cluster()},
            "run": cast.run,
            "wall_s": round(wall, 2),
            "requests_per_s": round(len(outcomes) / wall, 1),
            "client": client_summary(outcomes),
            "latency": latency(outcomes, direct, plan),
            "ledger": verdict(plan, cast, outcomes),
            "kills": kills,
            "unsettled_after_wait": unsettled,
            "counters_before_reconciliation": drift,
        }
        report["ok"] = (report["ledger"]["overshoot"] == 0 and report["ledger"]["rows_lost"] == 0
                        and report["ledger"]["rows_unsettled"] == 0 and not report["ledger"]["counter_mismatches"])
        return report
    finally:
        topology.stop()


def kill_events(plan: ScalePlan, topology: Topology, kills: list[dict], clock, progress) -> list[tuple[float, callable]]:
    """(fraction of the requests sent, what to kill then): a web process at 30%, a worker at 50%, a
    counters master at 70%."""
    def record(what: str, detail: str):
        kills.append({"what": what, "detail": detail, "at_s": round(clock(), 2)})
        progress(f"loadtest: killed {what} ({detail})")

    events = []
    if "web" in plan.kill:
        events.append((0.3, lambda: (topology.kill_web(0), record("web", topology.web_urls()[0]))))
    if "worker" in plan.kill:
        events.append((0.5, lambda: (topology.kill_worker(0), record("worker", f"pid {topology.workers[0].pid}"))))
    if "redis-master" in plan.kill:
        events.append((0.7, lambda: record("redis-master", kill_a_counters_master())))
    return events
