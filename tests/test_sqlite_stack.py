"""`make run`'s default database is SQLite, shared by daphne and a worker with 32 threads. Before WAL, a
busy timeout and BEGIN IMMEDIATE (project/settings.py), 60 chats arriving at once made the worker log
`OperationalError: database is locked`. Here 32 chats arrive at once on a stack of its own, on a SQLite
file: none locks, and every one leaves its ledger row (the demo's cap of 20 requests a day holds too).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from django.conf import settings

from project import stack as processes
from tests.conftest import start_stack

pytestmark = pytest.mark.django_db(transaction=True)

CHATS = 32
DEMO_PASSWORD = "sqlite-demo-password-1"


def manage(database_url: str, *args: str) -> str:
    env = processes.child_env(DATABASE_URL=database_url, REDIS_URL=settings.REDIS_URL, CEILING_DEMO_PASSWORD=DEMO_PASSWORD)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    done = subprocess.run([sys.executable, "manage.py", *args], env=env, cwd=settings.BASE_DIR, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def own_redis(redis_db):
    """The Redis database next to the suite's: this stack's users have the ids of the suite's own, and
    must not share their counters."""
    number = redis_db.connection_pool.connection_kwargs.get("db", 15)
    client = redis.Redis.from_url(settings.REDIS_URL.rsplit("/", 1)[0] + f"/{(number - 1) % 16}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def sqlite_stack(tmp_path, live_stack, own_redis):
    database = tmp_path / "ceiling.sqlite3"
    url = f"sqlite:///{database}"
    manage(url, "migrate", "--noinput")
    manage(url, "seed_demo", "--no-history")
    key = manage(url, "create_api_key", "alice").strip().splitlines()[-1]
    redis_url = own_redis.connection_pool.connection_kwargs
    redis_url = f"redis://{redis_url['host']}:{redis_url['port']}/{redis_url['db']}"
    started_stack, started = start_stack(own_redis, "sqlite", "test-sqlite@%h", queue="inference-sqlite",
                                         DATABASE_URL=url, REDIS_URL=redis_url)
    yield started_stack, database, key
    processes.stop_all(started)


def test_32_chats_at_once_on_sqlite_lock_nothing_and_lose_no_row(sqlite_stack):
    live, database, key = sqlite_stack

    def ask(n: int) -> httpx.Response:
        return httpx.post(f"{live.http_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=240,
                          json={"messages": [{"role": "user", "content": f"Say hello to number {n}."}], "max_tokens": 8})

    with ThreadPoolExecutor(CHATS) as pool:
        answers = list(pool.map(ask, range(CHATS)))

    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 429}, [a.text[:300] for a in answers if a.status_code not in (200, 429)]
    with sqlite3.connect(database) as db:
        rows = dict(db.execute("SELECT status, COUNT(*) FROM budgets_tokenlog GROUP BY status").fetchall())
    assert sum(rows.values()) == CHATS  # every request left its row
    assert rows.get("ok", 0) == statuses.count(200) == 20  # the demo's cap for alice, exactly
    assert rows.get("refused", 0) == statuses.count(429) == CHATS - 20
    for log in (live.daphne_output(), live.worker_output()):
        assert "database is locked" not in log and "Traceback" not in log
