"""CEILING_STREAM_INTERVAL through the real stack: fewer, longer frames, the same answer, TTFT first."""

from __future__ import annotations

import asyncio
import math

import pytest

from budgets.models import TokenLog
from inference.models import Transcript
from tests.conftest import SHARED_STREAM_INTERVAL as INTERVAL
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def interval_stack(live_stack, shared_stack):
    # The shared stack streams four tokens a frame (CEILING_STREAM_INTERVAL), on a queue of its own:
    # only its worker takes its chats (tests/conftest.py).
    return shared_stack


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
