"""Redis restarted (killed, then started empty) while users chat: web and workers reconnect by
themselves, counters are rebuilt from the ledger before anyone is admitted, the cap holds, and
every request leaves exactly one ledger row that ends settled."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from budgets.models import Quota, TokenLog
from tests.conftest import session_cookie, wait_for
from tests.faults import PrivateRedis, daily_counter_and_ledger, start_private_stack
from tests.wsclient import chat, chat_frame, chat_socket, read_until_end, send

pytestmark = pytest.mark.django_db(transaction=True)

CAP = 10  # requests per user per day
CLIENTS = 6


@pytest.fixture
def restart_stack(fault_stack):
    """daphne and one worker on a private redis-server: the fault modules' stack (tests/conftest.py; a
    start is a minute on 2 cores) where it is so, else a stack of its own."""
    if fault_stack.daphne.poll() is None and [worker.poll() for worker in fault_stack.workers] == [None]:
        fault_stack.forget_reference_rows()
        yield fault_stack
        return
    private_redis = PrivateRedis.start()
    private = start_private_stack("redis-restart", private_redis)
    try:
        yield private
    finally:
        private.stop()
        private_redis.stop()


class Chatters:
    """CLIENTS websocket users asking short questions in a loop, reconnecting when a socket dies."""

    def __init__(self, live, cookie: str) -> None:
        self.live, self.cookie = live, cookie
        self.stop = threading.Event()
        self.outcomes: list[tuple[float, str, str, str]] = []  # (when, type, code, request_id)
        self.socket_failures = 0
        self.sent = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(n) for n in range(CLIENTS)))

    async def _one(self, number: int) -> None:
        while not self.stop.is_set():
            try:
                async with chat_socket(self.live, self.cookie) as ws:
                    while not self.stop.is_set():
                        self.sent += 1
                        await send(ws, chat_frame(f"Say one word about the number {number}.", 4))
                        frames = await read_until_end(ws, timeout=150)
                        request_id = next((f["request_id"] for f in frames if "request_id" in f), "")
                        end = frames[-1]
                        self.outcomes.append((time.monotonic(), frames[0]["type"], end.get("code", end["type"]), request_id))
                        await asyncio.sleep(0.3)
            except Exception:  # noqa: BLE001 - a socket cut by the fault; a user would reconnect
                self.socket_failures += 1
                await asyncio.sleep(0.5)


def test_redis_restarted_under_load_loses_nothing_and_admits_nothing_extra(restart_stack, alice, bob, chat_feature):
    Quota.objects.create(period="day", max_requests=CAP)
    chatters = Chatters(restart_stack.live, session_cookie(alice))
    chatters.thread.start()
    try:
        wait_for(lambda: TokenLog.objects.filter(user=alice, admitted=True).count() >= CAP // 2, timeout=180, every=0.2)
        restart_stack.redis.kill()
        time.sleep(2)
        restart_stack.redis.restart()
        restarted_at = time.monotonic()
        # Keep going until the cap, rebuilt from the ledger, refuses alice after the restart.
        wait_for(lambda: any(when > restarted_at and code == "user_requests_per_day" for when, _, code, _ in chatters.outcomes),
                 timeout=240, every=0.5)
    finally:
        chatters.stop.set()
        chatters.thread.join(180)

    # Web and workers reconnected by themselves: a user under the cap is answered.
    bobs = wait_for(lambda: _answered(restart_stack.live, session_cookie(bob)), timeout=90, every=2)
    assert bobs[-1]["type"] == "done"

    rows = TokenLog.objects.filter(user=alice)
    print("outcomes:", Counter((first, code) for _, first, code, _ in chatters.outcomes), "sent:", chatters.sent,
          "socket failures:", chatters.socket_failures, "rows:", Counter(rows.values_list("status", "refusal_code")))
    assert rows.filter(admitted=True).count() <= CAP  # nothing admitted beyond the cap, across the restart
    wait_for(lambda: not rows.filter(status=TokenLog.Status.RUNNING).exists(), timeout=120, every=1)
    accepted = [rid for _, first, _, rid in chatters.outcomes if first == "accepted"]
    refused = sum(first == "refused" for _, first, _, _ in chatters.outcomes)
    assert set(accepted) <= set(rows.values_list("request_id", flat=True))  # no admitted request lost a row
    assert len(accepted) == len(set(accepted))  # ... nor got two answers
    assert rows.count() >= len(accepted) + refused  # every decision the users saw is in the ledger
    assert rows.count() <= chatters.sent  # and no request left two rows
    # After everything settled, the rebuilt counter says exactly what the ledger says.
    client = restart_stack.redis.client()
    wait_for(lambda: daily_counter_and_ledger(client, alice, chat_feature)[0].reserved.requests == 0, timeout=60)
    state, (used, reserved) = daily_counter_and_ledger(client, alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved)


def _answered(live, cookie: str):
    try:
        frames = asyncio.run(chat(live, cookie, chat_frame("Say hello.", 4)))
    except Exception:  # noqa: BLE001 - still reconnecting
        return None
    return frames if frames[-1]["type"] == "done" else None
