"""Hypothesis sends arbitrary frames to the live sockets: text, JSON of any shape, near-valid chats, binary.

On /ws/chat/ every frame gets an `error` frame or a valid flow (accepted … done, or refused), the one
socket stays usable through the whole run, nothing raises in daphne, and a ledger row is written
exactly for the frames that were admitted or refused by the guard. /ws/dashboard/ ignores whatever
a client sends and keeps pushing.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from budgets.models import TokenLog
from inference.web.frames import CancelFrame, FrameError, parse_frame
from tests.conftest import session_cookie
from tests.wsclient import chat_frame, chat_socket, next_frame, read_until_end

pytestmark = pytest.mark.django_db(transaction=True)

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
QUIET_S = 1.0  # a cancel frame with nothing streaming gets no answer: wait this long to be sure

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
# Values a field of a chat frame is sometimes given: right ones, wrong types, edge numbers, markup, NUL.
odd_strings = st.sampled_from(["", " ", "chat", "no-such-feature", "\x00", "\ud800", "<script>alert(1)</script>", "x" * 65])
contents = st.one_of(text, odd_strings, json_values)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "wizard", None]), "content": contents}),
    max_size=3,
)
chat_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["chat", "cancel", "Chat", ""])},
    optional={
        "feature": st.one_of(st.just("chat"), odd_strings, json_values),
        "messages": st.one_of(messages, json_values),
        "max_tokens": st.one_of(st.integers(-3, 1100), st.sampled_from([0, 2**63, 1.5, "2", True]), json_values),
        "loop_id": st.one_of(odd_strings, json_values),
    },
)
frames = st.one_of(
    chat_frames.map(json.dumps),
    json_values.map(json.dumps),
    text,
    st.binary(max_size=64),
)


def expected_reply(frame: str | bytes) -> str:
    """'error', 'silence' (a cancel) or 'flow' (a chat frame the server must act on)."""
    try:
        parsed = parse_frame(frame if isinstance(frame, str) else None)
    except FrameError:
        return "error"
    return "silence" if isinstance(parsed, CancelFrame) else "flow"


async def exchange(ws, frame: str | bytes) -> list[dict]:
    await ws.send(frame)
    try:
        first = await asyncio.wait_for(ws.recv(), timeout=QUIET_S)
    except TimeoutError:
        return []
    reply = json.loads(first)
    return [reply] if reply["type"] in ("error", "refused", "done") else [reply, *await read_until_end(ws)]


def test_any_frame_gets_an_error_or_a_valid_flow_and_the_socket_survives(live_stack, alice, chat_feature):
    chat_feature.max_output_tokens = 2  # admitted examples run the real model: keep them short
    chat_feature.save(update_fields=["max_output_tokens"])
    loop = asyncio.new_event_loop()
    socket = chat_socket(live_stack, session_cookie(alice))
    ws = loop.run_until_complete(socket.__aenter__())
    seen = {"frames": 0, "error": 0, "silence": 0, "admitted": 0, "refused": 0}

    @FUZZ
    @given(frame=frames)
    @example(frame=b"\x00\xff")
    @example(frame=json.dumps(chat_frame("a NUL \x00 inside")))
    @example(frame=json.dumps(chat_frame("a lone \ud800 surrogate")))
    @example(frame=json.dumps(chat_frame("hi", feature="\x00")))
    @example(frame=json.dumps(chat_frame("hi", loop_id="\udfff")))
    @example(frame=json.dumps(chat_frame("Say hi.", 2)))
    def fuzz(frame):
        rows_before = TokenLog.objects.count()
        replies = loop.run_until_complete(exchange(ws, frame))
        added = TokenLog.objects.count() - rows_before
        expected = expected_reply(frame)
        seen["frames"] += 1
        if expected == "error":
            assert len(replies) == 1 and replies[0]["type"] == "error" and replies[0]["message"], replies
            assert added == 0
            seen["error"] += 1
        elif expected == "silence":
            assert replies == [] and added == 0
            seen["silence"] += 1
        else:
            assert replies, "a chat frame got no answer"
            first, last = replies[0]["type"], replies[-1]["type"]
            if first == "error":  # e.g. an unknown feature: found only in the database, still nothing logged
                assert added == 0, replies
            else:
                assert (first, last) in (("accepted", "done"), ("refused", "refused")), replies
                assert added == 1
                seen["admitted" if first == "accepted" else "refused"] += 1

    try:
        fuzz()
        # The same socket still chats after everything it was sent.
        loop.run_until_complete(ws.send(json.dumps(chat_frame("Say ok.", 2))))
        final = loop.run_until_complete(read_until_end(ws))
        assert final[0]["type"] == "accepted" and final[-1]["type"] == "done"
    finally:
        loop.run_until_complete(socket.__aexit__(None, None, None))
        loop.close()
    print("chat socket fuzz:", seen)
    assert seen["admitted"] >= 1 and seen["error"] >= 10
    assert "Traceback" not in live_stack.daphne_output()


def test_the_dashboard_ignores_what_staff_clients_send(live_stack, staff):
    url = live_stack.ws_url.replace("/ws/chat/", "/ws/dashboard/")
    headers = {"Cookie": f"sessionid={session_cookie(staff)}"}
    sent = []

    @FUZZ
    @given(frame=frames)
    def collect(frame):
        sent.append(frame)

    collect()

    async def scenario():
        async with connect(url, origin=live_stack.http_url, additional_headers=headers, open_timeout=10) as ws:
            for frame in sent:
                await ws.send(frame)
            # Still open and still pushing engine stats after all of it.
            while (reply := await next_frame(ws, timeout=10))["type"] != "engine":
                pass
            return reply

    assert asyncio.run(scenario())["type"] == "engine"
    assert len(sent) >= 50
    assert "Traceback" not in live_stack.daphne_output()
