"""The shared cast and the real stack: PostgreSQL, Redis, a Celery worker and daphne, as processes.

The worker and daphne are started with the same command lines `make run` uses (project/stack.py),
pointed at pytest's test database. Tests that talk to them use `transactional_db`, so what they
write is committed and visible to those processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from django.conf import settings

from inference.engines import model_dir
from project import stack

LOG_DIR = Path(settings.BASE_DIR) / "var" / "test-logs"
WORKER_CONCURRENCY = 16


def pytest_configure(config) -> None:
    """This process hashes the cast's passwords with few iterations (tests/hashers.py); it still
    checks any pbkdf2_sha256 hash, whatever its iteration count."""
    from django.contrib.auth.hashers import get_hashers, get_hashers_by_algorithm

    settings.PASSWORD_HASHERS = ["tests.hashers.QuickPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]
    get_hashers.cache_clear()
    get_hashers_by_algorithm.cache_clear()


@dataclass
class Stack:
    host: str
    port: int
    daphne_log: Path
    worker_log: Path
    worker_id: str = ""  # its worker's id in ceiling:engine:<id> (engine_stats)

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/ws/chat/"

    def daphne_output(self) -> str:
        return self.daphne_log.read_text(errors="replace")

    def worker_output(self) -> str:
        return self.worker_log.read_text(errors="replace")


def _test_database_url() -> str:
    return stack.database_url(settings.DATABASES["default"])


@pytest.fixture(scope="session")
def redis_db():
    """The Redis database the suite owns (REDIS_URL, db 15 under `make test`), emptied once per run."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()


def stack_log_dir() -> Path:
    """var/test-logs/<test database>: two suites on one machine never share a log file."""
    folder = LOG_DIR / Path(settings.DATABASES["default"]["NAME"]).name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def stack_env(queue: str | None = None, **settings_env: str) -> dict[str, str]:
    """The environment of a test stack's processes (see start_stack)."""
    env = stack.child_env(**{
        "DATABASE_URL": _test_database_url(),
        "REDIS_URL": settings.REDIS_URL,
        # Short enough that a broken test fails fast, long enough for a loaded 2-core machine.
        "CEILING_FIRST_TOKEN_TIMEOUT_S": "60",
        "CEILING_ENGINE_FIRST_TOKEN_S": "50",
        "CEILING_METRICS_TOKEN": "test-metrics-token",
        # Tests drive reconciliation and alert sending by hand; a worker's own sweep would race them.
        "CEILING_RECONCILE_EVERY_S": "0",
        # Likewise a worker re-pricing local tokens in the middle of another test; tests/test_engine.py
        # drives the report by hand.
        "CEILING_THROUGHPUT_EVERY_S": "0",
        **({"CEILING_INFERENCE_QUEUE": queue} if queue else {}),
        **settings_env,  # may replace any of the above (a stack on its own database, say)
    })
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def start_worker(redis_client: redis.Redis, log: Path, worker_name: str, env: dict[str, str],
                 queues: str | None = None) -> tuple[subprocess.Popen, str]:
    """One Celery worker as `make run` starts it; returns once its engine publishes (process, its worker id)."""
    before = set(redis_client.scan_iter(match="ceiling:engine:*"))
    process = subprocess.Popen(stack.worker_argv(WORKER_CONCURRENCY, worker_name, **({"queues": queues} if queues else {})),
                               env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    found: set[bytes] = set()
    try:
        stack.wait_until(lambda: found.update(set(redis_client.scan_iter(match="ceiling:engine:*")) - before) or found,
                         timeout=180, what=f"the engine of {worker_name}")
    except BaseException:
        stack.stop_all([process])
        raise
    return process, sorted(found)[0].decode().removeprefix("ceiling:engine:")


def start_stack(redis_client: redis.Redis, name: str, worker_name: str, queue: str | None = None,
                **settings_env: str) -> tuple[Stack, list[subprocess.Popen]]:
    """A daphne and a Celery worker on the test database, started as `make run` starts them.

    With `queue`, the pair has a Celery queue of its own (no other test worker takes its chats), and
    `settings_env` sets CEILING_* settings for both processes.
    """
    log_dir = stack_log_dir()
    port = stack.free_port()
    env = stack_env(queue, **settings_env)
    # As `make run` does: convert the model before the processes start (a fresh checkout has none),
    # so the waits below time the start and not a one-off conversion.
    model_dir()
    daphne_log, worker_log = log_dir / f"{name}-daphne.log", log_dir / f"{name}-worker.log"
    daphne = subprocess.Popen(stack.daphne_argv("127.0.0.1", port), env=env, stdout=daphne_log.open("w"), stderr=subprocess.STDOUT)
    processes = [daphne]
    try:
        worker, worker_id = start_worker(redis_client, worker_log, worker_name, env, queue)
        processes.insert(0, worker)
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=60, what="daphne")
    except BaseException:
        stack.stop_all(processes)
        raise
    return Stack("127.0.0.1", port, daphne_log, worker_log, worker_id), processes


@pytest.fixture(scope="session")
def live_stack(django_db_setup, redis_db) -> Stack:
    live, processes = start_stack(redis_db, "main", "test-inference@%h")
    try:
        yield live
    finally:
        stack.stop_all(processes)


# --- one stack for the modules whose settings combine -------------------------------------------------
#
# Starting a daphne and a worker takes 30-145 s on 2 cores. These modules each started a stack of
# their own for one setting or two, none of which changes what another module's tests see, so they
# share one, on a queue of its own, with all of those settings:
#   tests/test_stream_interval.py: four tokens a frame after the first;
#   tests/test_remote_ceiling.py: 200-tool lists (inputs and bodies above the defaults);
#   tests/test_tracing.py: traces exported over OTLP to a receiver in this process;
#   tests/test_scale_out.py: a second web server and worker beside live_stack's;
#   tests/test_variant_workers.py: its fp32 worker, beside an int8 one of its own.
# It is stopped after the last test that uses it (pytest_runtest_teardown below), so the modules
# after that one see no extra worker.

SHARED_QUEUE = "inference-shared"
SHARED_STREAM_INTERVAL = 4


def shared_stack_settings(otlp_endpoint: str) -> dict[str, str]:
    """The shared stack's settings (every worker started for it gets them too)."""
    return {
        "CEILING_STREAM_INTERVAL": str(SHARED_STREAM_INTERVAL),
        "CEILING_MAX_INPUT_TOKENS": "200000",
        "CEILING_MAX_FRAME_BYTES": str(1024 * 1024),
        # Tracing switched on the way an operator does: an OTLP endpoint.
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
        "OTEL_SERVICE_NAME": "ceiling-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


@pytest.fixture(scope="session")
def otlp_receiver() -> str:
    """The URL of the OTLP/HTTP receiver the shared stack exports its spans to (tests/otlp.py)."""
    from tests.otlp import start_receiver

    url, server = start_receiver()
    yield url
    server.shutdown()


_after_test: dict[str, list] = {}  # a test's node id → what to stop once it is over


def stop_after_its_last_test(request, stop) -> None:
    """Call stop() once the last test of this run that uses the requesting session fixture is over
    (pytest_runtest_teardown below), not at the end of the run: the modules after it see none of it.
    The fixture's own teardown should stop it too (a run cut short), so stop() must be idempotent."""
    users = [item for item in request.session.items if request.fixturename in getattr(item, "fixturenames", ())]
    _after_test.setdefault(users[-1].nodeid, []).append(stop)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        for stop in _after_test.pop(item.nodeid, []):
            stop()


@pytest.fixture(scope="session")
def shared_stack(request, django_db_setup, redis_db, otlp_receiver) -> Stack:
    live, processes = start_stack(redis_db, "shared", "test-shared@%h", queue=SHARED_QUEUE,
                                  **shared_stack_settings(otlp_receiver))
    stop_after_its_last_test(request, lambda: stack.stop_all(processes))
    try:
        yield live
    finally:
        stack.stop_all(processes)  # already stopped, unless the run ended before its last user


@pytest.fixture(scope="session")
def fault_stack(request, django_db_setup):
    """A private stack (tests/faults.py: its own redis-server, daphne, one worker) for the fault modules
    that need no setting of their own: test_fault_redis_restart, then test_fault_worker_killed. Each
    test gets it as the one before left it (Redis restarted, a worker killed and replaced…): the
    fixtures of those modules check what they need and start more where it is missing."""
    from tests.faults import PrivateRedis, start_private_stack

    private_redis = PrivateRedis.start()
    private = start_private_stack("faults", private_redis)

    def stop() -> None:
        private.stop()
        private_redis.stop()

    stop_after_its_last_test(request, stop)
    try:
        yield private
    finally:
        stop()


def engine_stats(client: redis.Redis) -> list[dict]:
    keys = list(client.scan_iter(match="ceiling:engine:*"))
    return [json.loads(raw) for raw in client.mget(keys) if raw] if keys else []


def wait_for(check, timeout: float = 30.0, every: float = 0.05):
    """Poll check() until it returns something truthy; return that, or fail the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"condition not met within {timeout} s")


# --- the cast -----------------------------------------------------------------------------------


@pytest.fixture
def chat_feature(transactional_db):
    from budgets.models import Feature

    return Feature.objects.create(name="chat", description="Chat with the model")


@pytest.fixture
def alice(transactional_db):
    from django.contrib.auth.models import User

    return User.objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def bob(transactional_db):
    from django.contrib.auth.models import User

    return User.objects.create_user("bob", password="bob-password-1")


@pytest.fixture
def staff(transactional_db):
    from django.contrib.auth.models import User

    return User.objects.create_user("staff", password="staff-password-1", is_staff=True)


def session_cookie(user) -> str:
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@pytest.fixture(autouse=True)
def _no_async_unsafe_leak():
    # Playwright's sync API runs an event loop in the test thread; only the browser tests opt in.
    yield
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@dataclass
class LoadedEngine:
    engine: object  # inference.engine.Engine (torch is imported only by the tests that ask for one)
    said: list[str]  # what its load reported (progress lines)


@pytest.fixture(scope="session")
def q4_engine_load() -> LoadedEngine:
    """The real model's q4 variant as the settings build it, on Ceiling's kernels with the bf16 copies
    for wide steps, its routes measured at load: loaded once (most of a minute on 2 cores) for the
    tests that look at it (test_lowbit_kernels, test_q4, test_wide_steps), not started. A test that
    starts it stops it again; a test that routes its layers by hand leaves every test after it the
    load's measured figures on the engine (q4_max_rows, wide_min_rows) and its weights unchanged."""
    from dataclasses import replace

    from inference.engine import Engine
    from inference.engine.patches.quantization import Q4
    from inference.engines import engine_config_from_settings

    config = replace(engine_config_from_settings(model_dir()), num_blocks=64, quantization=Q4, own_kernels=True,
                     q4_wide_bf16=True)
    engine = Engine(config)
    said: list[str] = []
    engine.load(progress=said.append)
    yield LoadedEngine(engine, said)
    engine.stop()


@pytest.fixture
def q4_engine(q4_engine_load):
    return q4_engine_load.engine


@pytest.fixture(scope="session", autouse=True)
def _stop_in_process_engine():
    """Tests that run generation in-process start this process's engine; stop it while logging still works."""
    yield
    from inference.engines import shutdown_engine

    shutdown_engine()


@pytest.fixture(autouse=True)
def _fresh_reference_cache():
    """A test's rolled-back or truncated rows send no signals: the caches of reference rows
    (budgets/refcache.py), this process's and a live stack's, must not carry one test's prices,
    quotas or providers into the next."""
    from budgets import refcache

    refcache.cache.clear()
    refcache.changed_everything()
    yield
    refcache.cache.clear()
