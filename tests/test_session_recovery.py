"""The channel layer may drop frames; the ledger does not: a settled request ends from the ledger."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from budgets.models import TokenLog
from inference.actions import do_admit_request, do_finish_request
from inference.chat.relay import recover_from_ledger
from inference.models import Transcript

pytestmark = pytest.mark.django_db(transaction=True)


def admitted(alice, chat_feature) -> str:
    request_id = uuid.uuid4().hex
    decision = do_admit_request(
        request_id=request_id, user=alice, feature=chat_feature, model="m",
        messages=[{"role": "user", "content": "Hi"}], prompt_ids=[1, 2, 3], max_tokens=16,
    )
    assert decision.admitted
    return request_id


def test_a_running_request_is_left_to_the_stream(alice, chat_feature):
    assert asyncio.run(recover_from_ledger(admitted(alice, chat_feature), "", 0)) == []


def test_a_settled_request_whose_last_frames_were_lost_ends_with_the_rest_of_its_text(alice, chat_feature):
    request_id = admitted(alice, chat_feature)
    do_finish_request(request_id, status=TokenLog.Status.OK, prompt_tokens=3, completion_ids=[5, 6, 7, 8],
                      text="Hello there!", finish_reason="stop", ttft_ms=40)
    token, done = asyncio.run(recover_from_ledger(request_id, "Hello", 2))
    assert token == {"type": "token", "request_id": request_id, "text": " there!", "seq": 2}
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 4 and done["finish_reason"] == "stop"


def test_a_failed_request_ends_with_an_error(alice, chat_feature):
    request_id = admitted(alice, chat_feature)
    do_finish_request(request_id, status=TokenLog.Status.FAILED, prompt_tokens=3, completion_ids=[],
                      text="", finish_reason="", ttft_ms=None, error="the engine stopped")
    [error] = asyncio.run(recover_from_ledger(request_id, "", 0))
    assert error["type"] == "error" and "the engine stopped" in error["message"]


def test_a_settled_request_without_a_transcript_still_ends_with_its_usage(alice, chat_feature):
    request_id = admitted(alice, chat_feature)
    do_finish_request(request_id, status=TokenLog.Status.OK, prompt_tokens=3, completion_ids=[5, 6],
                      text="Hi!", finish_reason="stop", ttft_ms=40)
    Transcript.objects.filter(log__request_id=request_id).delete()  # as for a row written before transcripts
    [done] = asyncio.run(recover_from_ledger(request_id, "Hi", 1))
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 2
