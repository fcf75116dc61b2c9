"""A feature served by a remote OpenAI-compatible server, the remote being a second Ceiling.

The serving side is the real stack's own /v1/chat/completions (bob's API key); the client side is
the same stack's worker streaming from it for alice's feature "remote-chat". Both sides keep their
own ledger row, so one answer shows up twice: alice's on the remote provider, bob's on the local one.

Celery workers share one queue, so any worker may take alice's request and each must have the key
in its environment. It is set here, at import: pytest imports every test module before the session
stack starts, and the stack's processes copy os.environ.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from accounts.models import ApiKey, hash_key
from budgets.estimates import text_estimate
from budgets.guard import counter_store
from budgets.models import Feature, ModelPrice, Provider, Quota, TokenLog
from inference.models import Transcript
from inference.worker.remote import CONNECT_TIMEOUT_S
from project.stack import free_port
from tests.conftest import session_cookie, wait_for
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, send

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "SmolLM2-135M-Instruct"
KEY_ENV = "CEILING_PROVIDER_KEY_TEST_REMOTE"
REMOTE_KEY = "ck_remote-engine-tests-fixed-key-not-a-secret"
os.environ.setdefault(KEY_ENV, REMOTE_KEY)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


def remote_feature(base_url: str, api_key_env: str = KEY_ENV) -> Feature:
    provider = Provider.objects.create(
        name="second-ceiling",
        kind=Provider.Kind.OPENAI_COMPATIBLE,
        base_url=base_url,
        remote_model=MODEL,
        api_key_env=api_key_env,
    )
    # The remote's price: $1 per million prompt tokens and $2 per million completion tokens.
    ModelPrice.objects.create(
        provider=provider,
        model=MODEL,
        input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=2_000_000,
        effective_from=timezone.now() - timedelta(days=1),
    )
    return Feature.objects.create(name="remote-chat", provider=provider)


@pytest.fixture
def bobs_key(bob) -> ApiKey:
    """bob's key on the serving Ceiling, with the fixed text every worker has in its environment."""
    return ApiKey.objects.create(
        user=bob, name="remote engine", prefix=REMOTE_KEY[:8], hashed_key=hash_key(REMOTE_KEY), created_at=timezone.now()
    )


@pytest.fixture
def alice_capped(alice) -> Quota:
    # A cap gives alice a counter in Redis, so the tests can see her reservation released.
    return Quota.objects.create(user=alice, period="day", max_tokens=1_000_000)


def settled(request_id: str) -> TokenLog | None:
    row = TokenLog.objects.get(request_id=request_id)
    return row if row.status != TokenLog.Status.RUNNING else None


def assert_released(row: TokenLog) -> None:
    assert row.counter_keys, "the request was reserved against a counter"
    # The mark is written with the settling process's others, within budgets.guard.SETTLED_MARKS_EVERY_S.
    wait_for(lambda: TokenLog.objects.get(pk=row.pk).counters_settled, timeout=5)
    store = counter_store()
    for key in row.counter_keys:
        assert store.state(key).reserved.tokens == 0
        assert row.request_id not in store.held(key)


def test_a_remote_feature_streams_and_both_sides_account_for_it(live_stack, alice, bob, bobs_key, chat_feature):
    feature = remote_feature(f"{live_stack.http_url}/v1")

    frames = asyncio.run(
        chat(live_stack, session_cookie(alice), chat_frame("What is the capital of France?", 24, feature="remote-chat"))
    )

    accepted, *tokens, done = frames
    assert accepted["type"] == "accepted" and accepted["max_tokens"] == 24
    assert tokens and all(f["type"] == "token" for f in tokens)
    assert [f["seq"] for f in tokens] == list(range(len(tokens)))
    assert done["type"] == "done", done

    mine = TokenLog.objects.get(request_id=accepted["request_id"])
    assert mine.status == TokenLog.Status.OK and mine.user == alice
    assert mine.feature == feature and mine.provider == feature.provider
    assert done["usage"] == {"prompt_tokens": mine.prompt_tokens, "completion_tokens": mine.completion_tokens, "cached_tokens": 0}
    assert done["finish_reason"] == mine.finish_reason in ("stop", "length")
    assert done["ttft_ms"] == mine.ttft_ms and 0 < mine.ttft_ms <= mine.total_ms
    # Costed at the remote provider's price.
    assert mine.cost_micro_usd == feature.provider.prices.get().cost_micro_usd(mine.prompt_tokens, mine.completion_tokens) > 0
    assert done["cost_usd"] == mine.cost_usd

    serving = TokenLog.objects.get(user=bob)
    assert serving.status == TokenLog.Status.OK
    assert serving.feature == chat_feature and serving.provider == Provider.default()
    # The counts are the remote's own: the same as its ledger says.
    assert mine.completion_tokens == serving.completion_tokens > 0
    assert mine.prompt_tokens == serving.prompt_tokens > 0
    assert mine.finish_reason == serving.finish_reason
    assert TokenLog.objects.count() == 2

    transcript = Transcript.objects.get(log=mine)
    assert "".join(f["text"] for f in tokens) == transcript.response_text == serving.transcript.response_text
    assert "Paris" in transcript.response_text
    assert transcript.completion_ids == []  # the remote's token ids are not ours to keep


def test_cancelling_a_remote_answer_cancels_it_on_both_sides(live_stack, alice, bob, bobs_key, chat_feature):
    remote_feature(f"{live_stack.http_url}/v1")
    cookie = session_cookie(alice)

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            await send(ws, chat_frame("Write a very long story about a lighthouse keeper.", 300, feature="remote-chat"))
            accepted = await next_frame(ws)
            received = [await next_frame(ws) for _ in range(3)]
            await send(ws, {"type": "cancel"})
            return accepted, received, time.time()

    accepted, received, cancelled_at = asyncio.run(scenario())
    assert accepted["type"] == "accepted"
    assert [f["type"] for f in received] == ["token"] * 3

    mine = wait_for(lambda: settled(accepted["request_id"]), timeout=10)
    assert mine.status == TokenLog.Status.CANCELLED and mine.finish_reason == "cancelled"
    assert mine.finished_at.timestamp() - cancelled_at < 2.0
    assert 3 <= mine.completion_tokens < 300

    # The worker hung up, so the serving Ceiling stopped generating too.
    serving = wait_for(lambda: TokenLog.objects.filter(user=bob).exclude(status=TokenLog.Status.RUNNING).first(), timeout=10)
    assert serving.status == TokenLog.Status.CANCELLED
    assert serving.finished_at.timestamp() - cancelled_at < 5.0
    assert 3 <= serving.completion_tokens < 300


def test_a_remote_that_refuses_the_key_fails_the_request_with_a_clear_message(live_stack, alice, alice_capped, bob, chat_feature):
    remote_feature(f"{live_stack.http_url}/v1")  # bob's key does not exist on the remote: 401

    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Hello?", 16, feature="remote-chat")))

    accepted, error = frames
    assert accepted["type"] == "accepted"
    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "the remote provider 'second-ceiling' refused our credentials (HTTP 401" in error["message"]
    row = TokenLog.objects.get(request_id=accepted["request_id"])
    assert row.status == TokenLog.Status.FAILED and "HTTP 401" in row.error
    assert row.completion_tokens == 0
    assert_released(row)
    assert TokenLog.objects.count() == 1  # the remote refused before admitting anything


def test_an_unreachable_remote_fails_within_the_connect_timeout(live_stack, alice, alice_capped):
    remote_feature(f"http://127.0.0.1:{free_port()}/v1")  # nothing listens there

    started = time.monotonic()
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Hello?", 16, feature="remote-chat")))
    elapsed = time.monotonic() - started

    accepted, error = frames
    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "could not connect to the remote provider 'second-ceiling'" in error["message"]
    assert elapsed < CONNECT_TIMEOUT_S + 5
    row = TokenLog.objects.get(request_id=accepted["request_id"])
    assert row.status == TokenLog.Status.FAILED and "could not connect" in row.error
    assert_released(row)


def test_a_provider_whose_key_is_missing_on_the_worker_says_so(live_stack, alice, alice_capped):
    remote_feature(f"{live_stack.http_url}/v1", api_key_env="CEILING_PROVIDER_KEY_TEST_UNSET")

    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Hello?", 16, feature="remote-chat")))

    accepted, error = frames
    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "CEILING_PROVIDER_KEY_TEST_UNSET is not set on this worker" in error["message"]
    row = TokenLog.objects.get(request_id=accepted["request_id"])
    assert row.status == TokenLog.Status.FAILED
    assert_released(row)


class TerseServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that, like some do, streams no usage chunk and no [DONE]."""

    received: list[tuple[str, dict, dict]] = []
    PIECES = ["Par", "is", " is", " the", " capital", "."]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        TerseServer.received.append((self.path, body, dict(self.headers)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b": keep-alive\n\n")
        for piece in self.PIECES:
            self.wfile.write(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}).encode() + b"\n\n")
        finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        self.wfile.write(b"data: " + json.dumps(finish).encode() + b"\n\n")
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def terse_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), TerseServer)
    TerseServer.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/"
    server.shutdown()
    server.server_close()


def test_a_remote_that_reports_no_usage_is_counted_by_its_chunks_or_its_size(live_stack, alice, terse_server):
    remote_feature(terse_server)

    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Capital of France?", 40, feature="remote-chat")))

    accepted, *tokens, done = frames
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    assert "".join(f["text"] for f in tokens) == "Paris is the capital."
    row = TokenLog.objects.get(request_id=accepted["request_id"])
    # At least a token a chunk, and three bytes a token: whichever is more (never past max_tokens).
    assert row.completion_tokens == max(len(TerseServer.PIECES), text_estimate("Paris is the capital.")) == 7
    assert row.prompt_tokens == accepted["prompt_tokens"]  # our estimate stands when the remote says nothing
    assert done["usage"]["completion_tokens"] == row.completion_tokens

    [(path, body, headers)] = TerseServer.received
    assert path == "/v1/chat/completions"  # base_url's trailing slash does not double up
    assert body["model"] == MODEL and body["stream"] is True and body["max_tokens"] == 40
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert headers["Authorization"] == f"Bearer {REMOTE_KEY}"


# --- OpenAI's parameters pass through to the remote (#20) -------------------------------------------


def api_client(live_stack, user, key: str | None = None):
    from openai import OpenAI

    from accounts.actions import do_create_api_key

    key = key or do_create_api_key(user, "tests")[1]
    return OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=key, max_retries=0, timeout=120)


STORY = [{"role": "user", "content": "Write a short story about a fox who finds a key in the forest."}]


def test_sampling_parameters_reach_the_remote_and_its_seeded_answer_is_the_direct_one(
    live_stack, alice, bob, bobs_key, chat_feature
):
    remote_feature(f"{live_stack.http_url}/v1")
    sampled = {"temperature": 1.2, "seed": 5, "top_p": 0.95, "presence_penalty": 0.3, "frequency_penalty": 0.2}

    through = api_client(live_stack, alice).chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=16, stop=["zzzz"], extra_body={"feature": "remote-chat", **sampled},
    )
    direct = api_client(live_stack, bob, REMOTE_KEY).chat.completions.create(model=MODEL, messages=STORY, max_tokens=16, **sampled)

    assert through.choices[0].message.content == direct.choices[0].message.content
    greedy = api_client(live_stack, bob, REMOTE_KEY).chat.completions.create(model=MODEL, messages=STORY, max_tokens=16)
    assert greedy.choices[0].message.content != direct.choices[0].message.content  # the sampling did something
    # The serving side stored what the remote engine was asked for.
    first_served = TokenLog.objects.filter(user=bob).order_by("created_at").first()
    assert first_served.transcript.params == {**sampled, "stop": ["zzzz"]}


class ToolServer(TerseServer):
    """A remote that answers with a tool call, streamed in pieces as OpenAI streams one, with logprobs."""

    DELTAS = [
        {"index": 0, "id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
    ]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        TerseServer.received.append((self.path, body, dict(self.headers)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        logprob = {"token": "Hm", "logprob": -0.25, "bytes": [72, 109], "top_logprobs": []}
        chunks = [{"choices": [{"index": 0, "delta": {"content": "Hm"}, "logprobs": {"content": [logprob]}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [delta]}}]} for delta in self.DELTAS]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 9}})
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture
def tool_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ToolServer)
    TerseServer.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_tools_go_to_the_remote_and_its_tool_calls_come_back_unchanged(live_stack, alice, tool_server):
    remote_feature(tool_server)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    client = api_client(live_stack, alice)

    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=32, tools=[tool],
        tool_choice="auto", logprobs=True, top_logprobs=0, user="end-user-1", extra_body={"feature": "remote-chat"},
    )

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [call.model_dump() for call in choice.message.tool_calls] == [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]
    assert choice.message.content == "Hm" and [e.logprob for e in choice.logprobs.content] == [-0.25]
    row = TokenLog.objects.get(request_id=completion.id.removeprefix("chatcmpl-"))
    assert row.finish_reason == "tool_calls" and (row.prompt_tokens, row.completion_tokens) == (11, 9)
    [(_, body, _)] = TerseServer.received
    assert body["tools"] == [tool] and body["tool_choice"] == "auto"
    assert body["logprobs"] is True and body.get("top_logprobs", 0) == 0
    assert "user" not in body  # the end user's id stays here, beside the ledger row

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=32, tools=[tool],
        stream=True, extra_body={"feature": "remote-chat"},
    )
    calls = [c.choices[0].delta.tool_calls for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert [[call.function.arguments for call in group] for group in calls] == [['{"city": "Paris"}']]


# --- one pooled client per worker (#20: burst latency through the gateway) ---------------------------


@pytest.fixture
def stub_peer():
    from inference.engine.bench.stub_peer import StubPeer

    server = StubPeer(first_byte_s=0.0, token_s=0.001).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_worker_reuses_one_pooled_connection_across_remote_requests(live_stack, alice, stub_peer):
    """A new client per request paid its setup (~60 ms of CPU) and a new connection every time."""
    remote_feature(f"{stub_peer.url}/v1")
    cookie = session_cookie(alice)

    for question in ("One?", "Two?", "Three?", "Four?"):
        frames = asyncio.run(chat(live_stack, cookie, chat_frame(question, 5, feature="remote-chat")))
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length", frames[-1]
        assert "".join(f["text"] for f in frames if f["type"] == "token") == "t0 t1 t2 t3 t4 "

    assert [received.body["messages"][-1]["content"] for received in stub_peer.received] == ["One?", "Two?", "Three?", "Four?"]
    # One after another, every request went over the connection the first one opened.
    assert len({received.client for received in stub_peer.received}) == 1


def test_a_remote_answer_cut_short_closes_its_pooled_connection(live_stack, alice, stub_peer):
    """Cancelling must still hang up on the remote (it stops generating), pool or not."""
    stub_peer.token_s = 0.05
    remote_feature(f"{stub_peer.url}/v1")
    cookie = session_cookie(alice)

    async def cancel_after_two_tokens():
        async with chat_socket(live_stack, cookie) as ws:
            await send(ws, chat_frame("Long?", 200, feature="remote-chat"))
            accepted = await next_frame(ws)
            [await next_frame(ws) for _ in range(2)]
            await send(ws, {"type": "cancel"})
            return accepted

    accepted = asyncio.run(cancel_after_two_tokens())
    row = wait_for(lambda: settled(accepted["request_id"]), timeout=10)
    assert row.status == TokenLog.Status.CANCELLED and row.completion_tokens < 200

    stub_peer.token_s = 0.001
    frames = asyncio.run(chat(live_stack, cookie, chat_frame("Again?", 3, feature="remote-chat")))
    assert frames[-1]["type"] == "done"
    first, second = stub_peer.received
    assert first.client != second.client  # the cut-short connection was not handed to the next request
