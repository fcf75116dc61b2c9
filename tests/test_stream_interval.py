"""CEILING_STREAM_INTERVAL through the real stack: fewer, longer frames, the same answer, TTFT first."""

from __future__ import annotations

import asyncio
import math

import pytest

from budgets.models import TokenLog
from inference.models import Transcript
from project import stack as processes
from tests.conftest import session_cookie, start_stack
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

INTERVAL = 4


@pytest.fixture
def interval_stack(live_stack, redis_db):
    # A queue of its own, so that only this worker (streaming four tokens a frame) takes its chats.
    started_stack, started = start_stack(
        redis_db, "interval", "test-interval@%h", queue="inference-interval", CEILING_STREAM_INTERVAL=str(INTERVAL)
    )
    yield started_stack
    processes.stop_all(started)


def test_a_stream_interval_sends_every_fourth_token_and_loses_nothing(interval_stack, alice, chat_feature):
    frames = asyncio.run(chat(interval_stack, session_cookie(alice), chat_frame("Write a long story about a dragon.", 40)))
    done = frames[-1]
    assert done["type"] == "done", frames
    tokens = [f for f in frames if f["type"] == "token"]
    generated = done["usage"]["completion_tokens"]
    assert generated >= 2 * INTERVAL + 1, "the answer must be long enough for the interval to show"
    assert "".join(f["text"] for f in tokens) == Transcript.objects.get(log__request_id=done["request_id"]).response_text
    assert [f["seq"] for f in tokens] == list(range(len(tokens))) and done["frames"] == len(tokens)
    # The first piece at once, then one frame per four tokens (the last one with what is left).
    assert len(tokens) <= 2 + math.ceil((generated - 1) / INTERVAL)
    assert len(tokens) < generated
    assert TokenLog.objects.get(request_id=done["request_id"]).status == TokenLog.Status.OK
