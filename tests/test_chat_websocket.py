"""A chat end to end: websocket → daphne → Celery worker → engine → websocket, all real."""

from __future__ import annotations

import asyncio
import time

import pytest

from budgets.models import TokenLog
from inference.models import Transcript
from tests.conftest import engine_stats, session_cookie, wait_for
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, read_until_end, send

pytestmark = pytest.mark.django_db(transaction=True)


def test_tokens_stream_in_order_and_done_matches_the_ledger(live_stack, alice, chat_feature):
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("What is the capital of France?", 24)))

    accepted, *tokens, done = frames
    assert accepted["type"] == "accepted" and accepted["max_tokens"] == 24
    assert tokens and all(f["type"] == "token" for f in tokens)
    assert [f["seq"] for f in tokens] == list(range(len(tokens)))
    assert done["type"] == "done"

    log = TokenLog.objects.get(request_id=accepted["request_id"])
    assert log.status == TokenLog.Status.OK
    assert done["usage"] == {"prompt_tokens": log.prompt_tokens, "completion_tokens": log.completion_tokens, "cached_tokens": 0}
    assert log.prompt_tokens == accepted["prompt_tokens"] > 0
    assert 0 < log.completion_tokens <= 24
    assert done["ttft_ms"] == log.ttft_ms and done["total_ms"] == log.total_ms
    assert 0 < log.ttft_ms <= log.total_ms
    assert done["finish_reason"] == log.finish_reason in ("stop", "length")
    assert done["cost_usd"] == "0.000000" and done["cache"] == "miss"
    assert log.user == alice and log.feature == chat_feature

    transcript = Transcript.objects.get(log=log)
    assert "".join(f["text"] for f in tokens) == transcript.response_text
    assert "Paris" in transcript.response_text
    assert len(transcript.completion_ids) == log.completion_tokens


def test_eight_chats_started_together_run_in_one_batch(live_stack, redis_db, alice, chat_feature):
    cookie = session_cookie(alice)
    peak = {"running": 0}

    async def watch_engine():
        while True:
            for stats in engine_stats(redis_db):
                peak["running"] = max(peak["running"], stats["running"])
            await asyncio.sleep(0.05)

    async def scenario():
        watcher = asyncio.create_task(watch_engine())
        prompts = [f"Count from one to twenty in words, item {i}." for i in range(8)]
        results = await asyncio.gather(*(chat(live_stack, cookie, chat_frame(p, 48)) for p in prompts))
        watcher.cancel()
        return results

    results = asyncio.run(scenario())
    assert all(frames[-1]["type"] == "done" for frames in results)
    assert peak["running"] >= 8, f"at most {peak['running']} requests ran together"
    assert TokenLog.objects.filter(status=TokenLog.Status.OK).count() == 8


def _cancelled_log(request_id: str) -> TokenLog | None:
    log = TokenLog.objects.get(request_id=request_id)
    return log if log.status != TokenLog.Status.RUNNING else None


def test_cancel_frame_stops_the_request_within_a_second(live_stack, alice, chat_feature):
    cookie = session_cookie(alice)

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            await send(ws, chat_frame("Write a very long story about a lighthouse keeper.", 400))
            accepted = await next_frame(ws)
            received = [await next_frame(ws) for _ in range(3)]
            await send(ws, {"type": "cancel"})
            cancelled_at = time.time()
            # The socket stays usable after a cancel.
            await send(ws, chat_frame("Say hi.", 4))
            after = await read_until_end(ws)
            return accepted, received, cancelled_at, after

    accepted, received, cancelled_at, after = asyncio.run(scenario())
    assert [f["type"] for f in received] == ["token"] * 3
    assert after[0]["type"] == "accepted" and after[-1]["type"] == "done"

    log = wait_for(lambda: _cancelled_log(accepted["request_id"]), timeout=10)
    assert log.status == TokenLog.Status.CANCELLED
    assert log.finish_reason == "cancelled"
    assert log.finished_at.timestamp() - cancelled_at < 1.0
    assert 3 <= log.completion_tokens < 400
    assert len(log.transcript.completion_ids) == log.completion_tokens


def test_disconnect_mid_stream_cancels_the_request(live_stack, alice, chat_feature):
    cookie = session_cookie(alice)

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            await send(ws, chat_frame("Write a very long poem about the ocean.", 400))
            accepted = await next_frame(ws)
            await next_frame(ws)
            await next_frame(ws)
        return accepted, time.time()

    accepted, closed_at = asyncio.run(scenario())
    log = wait_for(lambda: _cancelled_log(accepted["request_id"]), timeout=10)
    assert log.status == TokenLog.Status.CANCELLED
    assert log.finished_at.timestamp() - closed_at < 1.0
    assert 2 <= log.completion_tokens < 400
