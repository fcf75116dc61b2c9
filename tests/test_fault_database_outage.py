"""PostgreSQL briefly unreachable (a TCP proxy between the stack and the database is cut): requests
are refused with a clear error and leave no ledger rows, a stream that ends during the outage is
settled once the database is back, and service resumes by itself."""

from __future__ import annotations

import asyncio
import time

import pytest

from budgets.models import TokenLog
from inference.models import Transcript
from tests.conftest import _test_database_url, session_cookie, wait_for
from tests.faults import CuttableProxy, PrivateRedis, frames_text, start_private_stack
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, read_until_end, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def proxied_stack(django_db_setup):
    """daphne and a worker that reach PostgreSQL only through a proxy the test can cut."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    proxy = CuttableProxy(database["HOST"] or "127.0.0.1", int(database["PORT"] or 5432))
    url = _test_database_url().replace(f":{database['PORT'] or 5432}/", f":{proxy.port}/")
    private_redis = PrivateRedis.start()
    private = start_private_stack("db-outage", private_redis, database_url=url)
    try:
        yield private, proxy
    finally:
        proxy.restore()
        private.stop()
        private_redis.stop()
        proxy.close()


async def ask_while_cut(live, cookie: str, proxy: CuttableProxy) -> list[dict]:
    """A user already connected asks while the database is unreachable."""
    async with chat_socket(live, cookie) as ws:
        proxy.cut()
        await asyncio.sleep(0.5)
        await send(ws, chat_frame("Hello?", 8))
        return await read_until_end(ws, timeout=60)


async def stream_across_a_cut(private, cookie: str, proxy: CuttableProxy) -> list[dict]:
    """The database goes away after the first token, and comes back once the worker, at the end of
    the stream, has found it gone and is retrying its ledger write."""
    async with chat_socket(private.live, cookie) as ws:
        await send(ws, chat_frame("Tell me about the sea in three sentences.", 24))
        frames = [await next_frame(ws)]
        while frames[-1]["type"] not in ("token", "done", "error"):
            frames.append(await next_frame(ws))
        proxy.cut()
        for _ in range(600):
            if "retrying the ledger write" in private.worker_log(0):
                break
            await asyncio.sleep(0.1)
        proxy.restore()
        return frames + await read_until_end(ws, timeout=120)


def test_a_database_outage_refuses_cleanly_and_service_resumes_by_itself(proxied_stack, alice, chat_feature):
    private, proxy = proxied_stack
    cookie = session_cookie(alice)
    assert asyncio.run(chat(private.live, cookie, chat_frame("Say hello.", 4)))[-1]["type"] == "done"
    rows_before = TokenLog.objects.count()

    started = time.monotonic()
    refused = asyncio.run(ask_while_cut(private.live, cookie, proxy))
    assert [f["type"] for f in refused] == ["error"] and refused[0]["code"] == "database_unavailable", refused
    assert "try again" in refused[0]["message"]
    assert time.monotonic() - started < 30  # refused, not left hanging
    assert TokenLog.objects.count() == rows_before  # no partial ledger row

    proxy.restore()
    # Nobody restarts anything: the next request simply works.
    resumed = wait_for(lambda: _answered(private.live, cookie), timeout=60, every=1)
    assert resumed[-1]["type"] == "done"

    frames = asyncio.run(stream_across_a_cut(private, cookie, proxy))
    assert "retrying the ledger write" in private.worker_log(0)
    assert frames[-1]["type"] == "done", frames[-1]
    row = TokenLog.objects.get(request_id=frames[0]["request_id"])
    assert row.status == TokenLog.Status.OK and row.completion_tokens == frames[-1]["usage"]["completion_tokens"] > 0
    assert Transcript.objects.get(log=row).response_text.startswith(frames_text(frames))
    assert not TokenLog.objects.filter(status=TokenLog.Status.RUNNING).exists()
    assert proxy.connections > 0  # the stack really went through the proxy


def _answered(live, cookie: str):
    try:
        frames = asyncio.run(chat(live, cookie, chat_frame("Say hello again.", 4)))
    except Exception:  # noqa: BLE001 - the handshake itself needs the database
        return None
    return frames if frames[-1]["type"] == "done" else None
