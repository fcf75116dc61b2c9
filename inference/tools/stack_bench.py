"""The bench's `stack` and `remote` modes: the workload through every real process a request goes through.

stack: websocket clients → daphne → session + guard → Celery worker → engine → stream inbox → websocket.
remote: the same burst sent twice in one run, with one client (inference/engine/bench/peer.py): straight
to an OpenAI-compatible peer, and through Ceiling's /v1 (API key → guard → Celery worker → the
remote adapter → the peer → stream inbox → daphne → server-sent events) on a feature whose remote
provider is that peer; the difference is Ceiling's own overhead, split by stage (inference/bus/trace.py).
The bench starts its own daphne and worker (the command lines `make run` uses) on the configured
database and Redis, as a user "bench" without caps on a feature "bench" without answer caches, so the
guard does all its work but never refuses. The worker runs with CEILING_IGNORE_EOS so every answer
has exactly the workload's length, as in the other modes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from django.conf import settings

from inference.engine.bench.measure import (
    BenchError,
    ModeResult,
    RequestTiming,
    percentile,
    process_cpu_s,
    process_peak_rss_mb,
    summarise,
    timing_rows,
)
from inference.engine.bench.modes import batch_figures
from inference.engine.bench.peer import check_peer, replay, stream_one
from inference.engine.bench.workload import MAX_OUTPUT_TOKENS, BenchRequest, labelled
from project import stack

BENCH_USER = "bench"
BENCH_FEATURE = "bench"
REMOTE_FEATURE = "bench-remote"
REMOTE_PROVIDER = "bench-peer"


def run_stack(requests: list[BenchRequest], *, threads: int, engine_env: dict[str, str], log_dir: Path,
              progress=print) -> ModeResult:
    cookie = prepare_bench_user(engine_env.get("CEILING_QUANTIZATION", settings.CEILING_QUANTIZATION))
    with bench_stack(len(requests), threads, engine_env, log_dir, progress) as (port, processes, worker):
        url = f"ws://127.0.0.1:{port}/ws/chat/"
        origin = f"http://127.0.0.1:{port}"
        warm_up = RequestTiming(-1, time.perf_counter())
        asyncio.run(_warm_up(url, origin, cookie, replace(requests[0], output_tokens=2), warm_up))
        if warm_up.error:
            raise BenchError(f"the stack's warm-up chat failed: {warm_up.error}")
        sampler = WorkerSampler(worker)
        sampler.start()
        # The wall clock beside perf_counter: the ledger's timestamps are wall-clock times.
        wall_minus_perf = time.time() - time.perf_counter()
        cpu_before = [process_cpu_s(p.pid) for p in processes] + [process_cpu_s(os.getpid())]
        timings, connect_ms = asyncio.run(replay_over_websockets(url, origin, cookie, requests))
        cpu_used = [process_cpu_s(p.pid) for p in processes] + [process_cpu_s(os.getpid())]
        sampler.stop()
        # daphne + the worker: everything this mode needs beyond the clients.
        peak_rss = sum(process_peak_rss_mb(p.pid) for p in processes)
    extra = sampler.figures() | {
        "connect_ms_p50": round(percentile(connect_ms, 50), 1), "connect_ms_p99": round(percentile(connect_ms, 99), 1),
    } | cpu_per_token(cpu_before, cpu_used, timings) | ttft_parts(timings, wall_minus_perf) | done_after_last_token(timings)
    return ModeResult(summarise(timings, peak_rss), extra=extra, timings=timing_rows(timings))


def done_after_last_token(timings: list[RequestTiming]) -> dict:
    """How long after a request's last token its `done` frame came (p50 and max ms): the ledger's
    settlement, which the stack does before it says done and which the user does not wait for to read
    the answer. Reported beside e2e, which ends at the last token as the peer's does."""
    gaps = [t.done_after_last_token_ms for t in timings if t.error is None and t.done_after_last_token_ms is not None]
    if not gaps:
        return {}
    return {"done_after_last_token_p50_ms": round(percentile(gaps, 50), 1),
            "done_after_last_token_max_ms": round(max(gaps), 1)}


def cpu_per_token(before: list[float], after: list[float], timings: list[RequestTiming]) -> dict:
    """CPU ms per output token of the burst, by process: [the worker, daphne, this process (the clients)].

    On 2 cores every millisecond the web process and the clients take is one the engine's threads
    do not get: this says where the stack's tokens/s below the engine mode's goes.
    """
    tokens = sum(t.output_tokens for t in timings) or 1
    worker, daphne, clients = ((end - begin) * 1000 / tokens for begin, end in zip(before, after, strict=True))
    return {"daphne_cpu_ms_per_token": round(daphne, 3), "worker_cpu_ms_per_token": round(worker, 3),
            "clients_cpu_ms_per_token": round(clients, 3)}


def run_remote(peer_url: str, requests: list[BenchRequest], *, threads: int, engine_env: dict[str, str], log_dir: Path,
               progress=print) -> tuple[ModeResult, ModeResult]:
    """(direct, through the stack): the same burst straight to the peer, then through Ceiling to it."""
    model = check_peer(peer_url)
    # Each send and each warm-up with a label of its own (workload.labelled): the send through Ceiling
    # must not find the direct send's prompts in the peer's prompt cache.
    direct_requests, through_requests = labelled(requests, "direct"), labelled(requests, "through Ceiling")
    stream_one(peer_url, model, labelled(requests[:1], "warm-up")[0], RequestTiming(-1, time.perf_counter()), max_tokens=2)
    timings = replay(peer_url, model, direct_requests)
    direct = ModeResult(summarise(timings, peak_rss_mb=0.0), extra={"peer_url": peer_url, "peer_model": model},
                        timings=timing_rows(timings))

    api_key = prepare_remote_bench(peer_url, model, engine_env.get("CEILING_QUANTIZATION", settings.CEILING_QUANTIZATION))
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"feature": REMOTE_FEATURE}
    with bench_stack(len(requests), threads, {**engine_env, "CEILING_TTFT_TRACE": "1"}, log_dir, progress) as (port, processes, _):
        url = f"http://127.0.0.1:{port}"
        warm_up = RequestTiming(-1, time.perf_counter())
        stream_one(url, model, labelled(requests[:1], "warm-up through Ceiling")[0], warm_up, max_tokens=2,
                   headers=headers, extra_body=body)
        if warm_up.error or warm_up.first_token is None:
            raise BenchError(f"the stack's warm-up request to the peer failed: {warm_up.error or 'no answer'}")
        wall_minus_perf = time.time() - time.perf_counter()
        cpu_before = [process_cpu_s(p.pid) for p in processes]
        timings = replay(url, model, through_requests, headers=headers, extra_body=body)
        cpu_used = [process_cpu_s(p.pid) - before for p, before in zip(processes, cpu_before, strict=True)]
        peak_rss = sum(process_peak_rss_mb(p.pid) for p in processes)
    # CPU per request of the whole burst (admission to the last token), independent of how busy the machine is.
    worker_cpu, daphne_cpu = (round(used * 1000 / len(requests), 1) for used in cpu_used)
    extra = {"worker_cpu_ms_per_request": worker_cpu, "daphne_cpu_ms_per_request": daphne_cpu}
    through = ModeResult(summarise(timings, peak_rss), extra=extra | remote_ttft_parts(timings, wall_minus_perf),
                         timings=timing_rows(timings))
    return direct, through


# The remote path's stages, in order (inference/bus/trace.py); "sent" is the request's own send.
REMOTE_PARTS = (
    ("to_guard", "sent_by_client", "guard"),  # HTTP, the API key, parsing, the feature, tokenizing
    ("guard", "guard", "admitted"),  # the guard: the ledger row, the Lua check, the transcript
    ("dispatch", "admitted", "dispatched"),  # to the thread that publishes the Celery task
    ("queue", "dispatched", "picked"),  # the publish, the broker, and a free worker thread
    ("pickup", "picked", "sent"),  # the worker reads the row and opens the remote request
    ("connect", "sent", "connected"),  # the remote's status line and headers
    ("first_byte", "connected", "first_byte"),  # the remote's own time to its first piece
    ("to_frame", "first_byte", "first_frame"),  # the piece becomes a token frame in the worker
    ("relay", "first_frame", "first_token"),  # outbox → Redis → inbox → daphne → the client
)


def remote_ttft_parts(timings: list[RequestTiming], wall_minus_perf: float) -> dict:
    """Where the remote path's TTFT goes: each stage's p50 and max (ms), from each request's trace."""
    from budgets.models import TokenLog
    from inference.bus.trace import read_traces

    traced = read_traces([t.request_id for t in timings if t.request_id and t.first_token is not None])
    # The guard's start is the ledger row's own time.
    for request_id, created_at in TokenLog.objects.filter(request_id__in=list(traced)).values_list("request_id", "created_at"):
        traced[request_id]["guard"] = created_at.timestamp()
    parts: dict[str, list[float]] = {name: [] for name, _, _ in REMOTE_PARTS}
    for timing in timings:
        stages = traced.get(timing.request_id)
        if not stages:
            continue
        stages = {**stages, "sent_by_client": timing.arrival + wall_minus_perf, "first_token": timing.first_token + wall_minus_perf}
        for name, begin, end in REMOTE_PARTS:
            if begin in stages and end in stages:
                parts[name].append((stages[end] - stages[begin]) * 1000)
    figures = {"traced_requests": sum("picked" in stages for stages in traced.values())}
    for name, values in parts.items():
        if values:
            figures[f"ttft_{name}_p50_ms"] = round(percentile(values, 50), 1)
            figures[f"ttft_{name}_max_ms"] = round(max(values), 1)
    return figures


def prepare_remote_bench(peer_url: str, model: str, quantization: str) -> str:
    """The bench user, its remote feature served by the peer, and a new API key (returned) to call /v1 with."""
    from django.contrib.auth import get_user_model

    from accounts.actions import do_create_api_key
    from budgets.models import Feature, Provider

    prepare_bench_user(quantization)
    provider, _ = Provider.objects.update_or_create(
        name=REMOTE_PROVIDER,
        defaults={"kind": Provider.Kind.OPENAI_COMPATIBLE, "base_url": f"{peer_url.rstrip('/')}/v1", "remote_model": model,
                  "api_key_env": "", "monthly_limit_micro_usd": None},
    )
    Feature.objects.update_or_create(
        name=REMOTE_FEATURE,
        defaults={
            "description": "manage.py bench --modes remote (the peer behind Ceiling)",
            "enabled": True,
            "mode": Feature.Mode.CHAT,
            "provider": provider,
            "max_input_tokens": 4096,
            "max_output_tokens": MAX_OUTPUT_TOKENS,
            "cache_ttl_s": 0,
        },
    )
    return do_create_api_key(get_user_model().objects.get(username=BENCH_USER), "manage.py bench")[1]


def ttft_parts(timings: list[RequestTiming], wall_minus_perf: float) -> dict:
    """Where the stack's TTFT goes, from each request's ledger row (p50 and max, ms).

    - to_guard: chat frame sent → the guard starts (TokenLog.created_at): the socket, the feature
      lookup and tokenizing in daphne;
    - guard_to_first_token: the worker's own TTFT (TokenLog.ttft_ms): the guard, the dispatch, the
      broker, the engine's queue and its prefill;
    - to_client: what is left of the client's TTFT, the first frame's way back.
    A burst's late start shows in guard_to_first_token: the engine gets the first chats while the
    rest are still being admitted on the same cores (docs/benchmarks.md).
    """
    from budgets.models import TokenLog

    rows = {r.request_id: r for r in TokenLog.objects.filter(request_id__in=[t.request_id for t in timings if t.request_id])}
    to_guard, in_worker, to_client = [], [], []
    for timing in timings:
        row = rows.get(timing.request_id)
        if row is None or row.ttft_ms is None or timing.first_token is None:
            continue
        before_guard = (row.created_at.timestamp() - (timing.arrival + wall_minus_perf)) * 1000
        to_guard.append(before_guard)
        in_worker.append(row.ttft_ms)
        to_client.append(timing.ttft_ms - before_guard - row.ttft_ms)
    parts = {}
    for name, values in (("to_guard", to_guard), ("guard_to_first_token", in_worker), ("to_client", to_client)):
        if values:
            parts[f"ttft_{name}_p50_ms"] = round(percentile(values, 50), 1)
            parts[f"ttft_{name}_max_ms"] = round(max(values), 1)
    return parts


def retire_bench_features() -> list[str]:
    """Switch the bench's own features off after a run (each run switches them on again): left on, the
    chat page offered them to every user, and runstack started a worker for their weights. Their
    ledger rows stay, so they are not deleted."""
    from budgets.models import Feature

    names = sorted(Feature.objects.filter(name__in=(BENCH_FEATURE, REMOTE_FEATURE), enabled=True).values_list("name", flat=True))
    Feature.objects.filter(name__in=names).update(enabled=False)
    return names


def prepare_bench_user(quantization: str) -> str:
    """The bench user (no caps) and feature (no caches); returns a session cookie for the user.

    The feature is served by the weight variant under test: a worker answers each feature with the
    feature's own variant, so a bench feature left at "none" would load and run the fp32 engine
    beside the variant the worker started with. (The bench's feature skips the evaluation gate; it
    is the bench's own, not one users call.)
    """
    from django.contrib.auth import get_user_model
    from django.test import Client

    from budgets.models import Feature, Period, Quota

    user, created = get_user_model().objects.get_or_create(username=BENCH_USER)
    if created:
        user.set_unusable_password()
        user.save()
    for period in (Period.DAY, Period.MONTH):
        # A user's own quota row replaces the defaults; one with no limits set means no user caps.
        Quota.objects.update_or_create(
            user=user, feature=None, period=period,
            defaults={"max_requests": None, "max_tokens": None, "max_cost_micro_usd": None},
        )
    Feature.objects.update_or_create(
        name=BENCH_FEATURE,
        defaults={
            "description": "manage.py bench (fixed-length answers)",
            "enabled": True,
            "mode": Feature.Mode.CHAT,
            "max_input_tokens": 4096,
            "max_output_tokens": MAX_OUTPUT_TOKENS,
            "cache_ttl_s": 0,
            "quantization": quantization,
        },
    )
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@contextmanager
def bench_stack(concurrency: int, threads: int, engine_env: dict[str, str], log_dir: Path, progress):
    log_dir.mkdir(parents=True, exist_ok=True)
    port = stack.free_port()
    # A queue of its own: another worker on the same Redis must not take (or slow) the bench's chats.
    queue = f"bench-{os.getpid()}"
    env = stack.child_env(
        CEILING_INFERENCE_QUEUE=queue,
        DATABASE_URL=stack.database_url(settings.DATABASES["default"]),
        REDIS_URL=settings.REDIS_URL,
        CEILING_IGNORE_EOS="1",
        CEILING_TORCH_THREADS=str(threads),
        **engine_env,
    )
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    workers_before = _live_workers()
    found: set[str] = set()
    # Every chat holds one worker thread while it streams: enough threads for the whole workload.
    processes = [
        subprocess.Popen(stack.worker_argv(max(16, concurrency), "bench@%h", queues=queue), env=env,
                         stdout=(log_dir / "bench-worker.log").open("w"), stderr=subprocess.STDOUT),
        subprocess.Popen(stack.daphne_argv("127.0.0.1", port), env=env,
                         stdout=(log_dir / "bench-daphne.log").open("w"), stderr=subprocess.STDOUT),
    ]
    try:
        progress(f"stack: daphne on 127.0.0.1:{port}, worker starting (logs in {log_dir})…")
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=60, what="daphne")
        stack.wait_until(lambda: found.update(_live_workers() - workers_before) or found, timeout=180,
                         what="the bench worker's engine")
        worker = sorted(found)[0]
        # As the engine mode does: measure the worker once its decode steps' compile is decided.
        stack.wait_until(lambda: _compile_state(worker) != "compiling", timeout=1800,
                         what="the bench worker's compiled decode steps")
        yield port, processes, worker
    finally:
        stack.stop_all(processes)


def _live_workers() -> set[str]:
    from inference.bus.stats import read_engine_stats

    return {stats["worker"] for stats in read_engine_stats() if stats.get("running") is not None}


def _compile_state(worker: str) -> str:
    from inference.bus.stats import read_engine_stats

    return next((stats.get("compiled_decode_state", "") for stats in read_engine_stats() if stats["worker"] == worker), "")


class WorkerSampler(threading.Thread):
    """Reads the bench worker's published engine stats (every 0.5 s) while the workload runs."""

    def __init__(self, worker: str) -> None:
        super().__init__(daemon=True)
        self.worker = worker
        self.running: list[int] = []
        self.kv_blocks: list[int] = []
        self.kv_blocks_total = 0
        self.backoffs: list[int] = []  # the engine's count of steps dropped to one thread (owned/threads.py)
        self.decode_step_ms_p50: dict = {}  # the worker's latest, as its stats publish it
        self._stopped = threading.Event()

    def run(self) -> None:
        from inference.bus.stats import read_engine_stats

        while not self._stopped.wait(0.25):
            for stats in read_engine_stats():
                if stats["worker"] != self.worker:
                    continue
                self.decode_step_ms_p50 = stats.get("decode_step_ms_p50") or self.decode_step_ms_p50
                if stats.get("running"):
                    self.running.append(stats["running"])
                    self.kv_blocks.append(stats["kv_blocks_used"])
                    self.kv_blocks_total = stats["kv_blocks_total"]
                    self.backoffs.append(stats.get("thread_backoffs", 0))

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def figures(self) -> dict:
        # Back-offs during the run: another process (daphne, the clients) held a core through steps.
        backoffs = self.backoffs[-1] - self.backoffs[0] if self.backoffs else 0
        return batch_figures(self.running, self.kv_blocks, self.kv_blocks_total) | {
            "thread_backoffs": backoffs, "decode_step_ms_p50": self.decode_step_ms_p50}


async def replay_over_websockets(url: str, origin: str, cookie: str,
                                 requests: list[BenchRequest]) -> tuple[list[RequestTiming], list[float]]:
    """(timings, each socket's opening handshake in ms).

    Every client opens its socket before the clock starts, as the chat page does when it loads, and
    a request's clock starts when its chat frame is sent (vLLM's TTFT: from the request to its first
    token). The handshakes (TCP, HTTP upgrade, session and user lookup) are reported on their own.
    """
    async def open_socket():
        began = time.perf_counter()
        ws = await _connect(url, origin, cookie)
        return ws, (time.perf_counter() - began) * 1000

    opened = await asyncio.gather(*(open_socket() for _ in requests), return_exceptions=True)
    sockets = [item[0] for item in opened if not isinstance(item, BaseException)]
    try:
        failed = [item for item in opened if isinstance(item, BaseException)]
        if failed:
            raise BenchError(f"{len(failed)} of {len(requests)} chat sockets did not open: {failed[0]!r}")
        start = time.perf_counter()
        timings = [RequestTiming(r.index, arrival=start + r.arrival_s) for r in requests]

        async def at_arrival(ws, request: BenchRequest, timing: RequestTiming) -> None:
            await asyncio.sleep(max(0.0, timing.arrival - time.perf_counter()))
            await _one_chat(ws, request, timing)

        await asyncio.gather(*(at_arrival(ws, r, t) for ws, r, t in zip(sockets, requests, timings, strict=True)))
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return timings, [item[1] for item in opened]


def _connect(url: str, origin: str, cookie: str):
    """A chat socket as the bench user's browser opens one (await it, or use it with `async with`)."""
    from websockets.asyncio.client import connect

    return connect(url, origin=origin, additional_headers={"Cookie": f"sessionid={cookie}"},
                   open_timeout=30, max_size=4 * 1024 * 1024)


async def _warm_up(url: str, origin: str, cookie: str, request: BenchRequest, timing: RequestTiming) -> None:
    try:
        async with _connect(url, origin, cookie) as ws:
            await _one_chat(ws, request, timing)
    except (OSError, TimeoutError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"


async def _one_chat(ws, request: BenchRequest, timing: RequestTiming) -> None:
    frame = {"type": "chat", "feature": BENCH_FEATURE, "messages": request.messages, "max_tokens": request.output_tokens}
    try:
        await ws.send(json.dumps(frame))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=600))
            if timing.record_chat_frame(message, time.perf_counter()):
                return
    except (OSError, TimeoutError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
