"""A Celery worker killed (SIGKILL) mid-stream: the user hears so quickly, the ledger keeps the tokens
streamed, the reservation is released, the task is not run again, and a new worker takes new work."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from django.conf import settings

from budgets.models import Quota, TokenLog
from inference.models import Transcript
from tests.conftest import session_cookie, wait_for
from tests.faults import PrivateRedis, daily_counter_and_ledger, frames_text, kill, start_private_stack
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, read_until_end, send

pytestmark = pytest.mark.django_db(transaction=True)

LONG_ANSWER = "Write a long story about a lighthouse keeper and a storm, with many details."


def live_workers(private) -> list[int]:
    """The numbers of the private stack's workers that are still running."""
    return [number for number, worker in enumerate(private.workers) if worker.poll() is None]


@pytest.fixture
def worker_stack(fault_stack):
    """daphne and its one first worker, both running: the fault modules' stack (tests/conftest.py; a
    start is a minute on 2 cores) where it is so, else a stack of its own."""
    if fault_stack.daphne.poll() is None and len(fault_stack.workers) == 1 and live_workers(fault_stack) == [0]:
        fault_stack.forget_reference_rows()
        yield fault_stack
        return
    private_redis = PrivateRedis.start()
    private = start_private_stack("killed-again", private_redis)
    try:
        yield private
    finally:
        private.stop()
        private_redis.stop()


async def chat_until_killed(private, cookie: str, after_tokens: int) -> tuple[list[dict], float]:
    """Stream an answer, SIGKILL the worker after a few token frames; (frames, seconds to the end)."""
    async with chat_socket(private.live, cookie) as ws:
        await send(ws, chat_frame(LONG_ANSWER, 400))
        frames = [await next_frame(ws)]
        while sum(f["type"] == "token" for f in frames) < after_tokens:
            frames.append(await next_frame(ws))
            assert frames[-1]["type"] == "token", frames[-1]
        kill(private.workers[0])
        killed_at = time.monotonic()
        frames += await read_until_end(ws, timeout=90)
        return frames, time.monotonic() - killed_at


def test_the_celery_settings_never_rerun_a_generation_but_keep_idempotent_tasks():
    from budgets.tasks import send_alert_email
    from inference.tasks import generate
    from project.celery import app

    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_transport_options["visibility_timeout"] > settings.CEILING_TASK_TIME_LIMIT_S
    assert generate.acks_late is False and generate.reject_on_worker_lost is False
    assert send_alert_email.acks_late is True and send_alert_email.reject_on_worker_lost is True


def test_a_worker_killed_mid_stream_fails_the_request_with_the_tokens_streamed(worker_stack, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=20)
    cookie = session_cookie(alice)
    frames, seconds = asyncio.run(chat_until_killed(worker_stack, cookie, after_tokens=3))

    end = frames[-1]
    assert end["type"] == "error" and end["code"] == "worker_lost", end
    assert "stopped unexpectedly" in end["message"] and "try again" in end["message"]
    # Silence check (5 s) + the dead worker's heartbeat expiring (5 s), far from the 60 s timeout.
    assert seconds < 30, seconds
    row = TokenLog.objects.get(request_id=frames[0]["request_id"])
    token_frames = sum(f["type"] == "token" for f in frames)
    assert row.status == TokenLog.Status.FAILED and "worker" in row.error
    # Each frame carries at least one token; the worker recorded every token it streamed.
    assert row.completion_tokens >= token_frames >= 3
    assert Transcript.objects.get(log=row).response_text == frames_text(frames)

    client = worker_stack.redis.client()
    state, (used, reserved) = daily_counter_and_ledger(client, alice, chat_feature)
    assert reserved.requests == 0 and state.reserved.requests == 0  # the reservation was released
    assert (state.used, state.reserved) == (used, reserved)
    assert used.tokens == row.prompt_tokens + row.completion_tokens

    # A new worker takes new requests; the killed task is not handed to it (acked on receipt).
    worker_stack.start_worker()
    assert live_workers(worker_stack) == [1]
    again = asyncio.run(chat(worker_stack.live, cookie, chat_frame("Say hello.", 8)))
    assert again[-1]["type"] == "done", again
    time.sleep(1)
    assert "worker_lost" not in worker_stack.worker_log(1)
    assert frames[0]["request_id"] not in worker_stack.worker_log(1)
    row.refresh_from_db()
    assert row.status == TokenLog.Status.FAILED  # still: nobody ran it again
    wait_for(lambda: daily_counter_and_ledger(client, alice, chat_feature)[0].reserved.requests == 0, timeout=10)
    state, (used, reserved) = daily_counter_and_ledger(client, alice, chat_feature)
    assert (state.used, state.reserved) == (used, reserved) and used.requests == 2


# --- nobody listening: the live workers sweep the dead one's requests -------------------------------


@pytest.fixture
def two_worker_stack(fault_stack):
    """daphne and two running workers: the fault modules' stack (tests/conftest.py), with workers added
    until two run (after the test above, its replacement worker and one more)."""
    assert fault_stack.daphne.poll() is None, "daphne was killed by an earlier test"
    while len(live_workers(fault_stack)) < 2:
        fault_stack.start_worker()
    fault_stack.forget_reference_rows()
    return fault_stack


async def stream_then_kill_its_worker_and_the_web(private, cookie: str, after_tokens: int):
    """Stream an answer; after a few token frames SIGKILL daphne and the worker that owns the request.

    Returns (frames received, the moment of the kills, the killed worker)."""
    ws_context = chat_socket(private.live, cookie)
    ws = await ws_context.__aenter__()
    await send(ws, chat_frame(LONG_ANSWER, 400))
    frames = [await next_frame(ws)]
    while sum(f["type"] == "token" for f in frames) < after_tokens:
        frames.append(await next_frame(ws))
        assert frames[-1]["type"] == "token", frames[-1]
    owner = private.redis.client().hget(f"ceiling:running:{frames[0]['request_id']}", "worker").decode()
    [worker] = [w for w in private.workers if w.pid == int(owner.split(":")[1])]
    kill(private.daphne)  # no web process is left to notice anything
    kill(worker)
    killed_at = time.monotonic()
    try:
        await ws_context.__aexit__(None, None, None)
    except Exception:  # noqa: BLE001 - the server side is gone
        pass
    return frames, killed_at, worker


def test_a_dead_workers_request_nobody_waits_for_is_settled_within_30_s_with_its_streamed_tokens(
    two_worker_stack, alice, chat_feature
):
    Quota.objects.create(period="day", max_requests=20)
    frames, killed_at, killed = asyncio.run(
        stream_then_kill_its_worker_and_the_web(two_worker_stack, session_cookie(alice), after_tokens=3)
    )
    request_id = frames[0]["request_id"]

    def settled():
        row = TokenLog.objects.get(request_id=request_id)
        return row if row.status != TokenLog.Status.RUNNING else None

    row = wait_for(settled, timeout=60, every=0.25)
    seconds = time.monotonic() - killed_at
    print(f"\nsettled {seconds:.1f} s after the kill, {row.completion_tokens} tokens")
    # Its heartbeat expires (5 s), the other worker's next sweep (every 5 s) settles it; not 600 s.
    assert seconds < 30, seconds
    token_frames = sum(f["type"] == "token" for f in frames)
    assert row.status == TokenLog.Status.FAILED and "worker" in row.error
    assert row.completion_tokens >= token_frames >= 3  # what the worker streamed, not 0

    client = two_worker_stack.redis.client()
    state, (used, reserved) = daily_counter_and_ledger(client, alice, chat_feature)
    assert reserved.requests == 0 and state.reserved.requests == 0  # the reservation was released
    assert (state.used, state.reserved) == (used, reserved)
    assert used.tokens == row.prompt_tokens + row.completion_tokens
    assert not client.exists(f"ceiling:running:{request_id}")

    # The web process that waited is told too (its inbox holds the frame until it expires).
    pushed = [raw for key in client.scan_iter(match="ceiling:inbox:*") for raw in client.lrange(key, 0, -1)]
    lost = [f for raw in pushed for f in json.loads(raw) if f["request_id"] == request_id and f.get("code") == "worker_lost"]
    assert lost and f"after {row.completion_tokens} tokens" in lost[0]["message"]
    [survivor] = [number for number in live_workers(two_worker_stack) if two_worker_stack.workers[number] is not killed]
    assert request_id in two_worker_stack.worker_log(survivor) and "is gone" in two_worker_stack.worker_log(survivor)
