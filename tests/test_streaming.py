"""Streaming: ids → text pieces on the worker, the sender's bundles and ordering, the web process's inbox."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from inference.bus import stats
from inference.bus.clients import redis_client
from inference.bus.inbox import INBOX_KEY_PREFIX, StreamInbox, stream_inbox
from inference.bus.outbox import INBOX_EXPIRY_S, ChannelSender
from inference.bus.ownership import RUNNING_KEY, claim_request, release_claim
from inference.engine.detokenizer import IncrementalDecoder
from inference.web.tokenizer import get_tokenizer
from inference.worker.generation import FrameBuffer

TEXTS = [
    "Hello there! How can I help you today?",
    "Grüße aus Köln — déjà vu, naïve café.",
    "数学很有趣。日本語のテキストも。",
    "Emoji 🎉🚀 and a family 👨‍👩‍👧 in one line.\nNew line,  two spaces, tab\tend.",
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_pieces_add_up_to_the_whole_decode(text, chunk):
    tokenizer = get_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(pieces) == decoder.text() == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)


def test_an_incomplete_character_is_held_back_until_it_completes():
    tokenizer = get_tokenizer()
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test to mean anything"
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([token]) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "🎉"


def test_special_tokens_add_no_text():
    tokenizer = get_tokenizer()
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push([tokenizer.eos_token_id]) == ""
    assert decoder.push(tokenizer.encode(" ok", add_special_tokens=False)) == " ok"


def _frames(text: str, interval: int) -> list[tuple[str, int]]:
    """(frame text, tokens it covers) as _stream sends them, one token per engine step."""
    tokenizer = get_tokenizer()
    decoder, buffer = IncrementalDecoder(tokenizer), FrameBuffer(interval)
    frames, covered = [], 0
    for token in tokenizer.encode(text, add_special_tokens=False):
        covered += 1
        sent = buffer.add(decoder.push([token]), 1)
        if sent:
            frames.append((sent, covered))
            covered = 0
    rest = buffer.take()
    if rest:
        frames.append((rest, covered))
    return frames


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_interval_of_one_sends_every_piece_as_it_comes(text):
    tokenizer = get_tokenizer()
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push([token]) for token in tokenizer.encode(text, add_special_tokens=False)]
    assert [frame for frame, _ in _frames(text, 1)] == [piece for piece in pieces if piece]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("interval", [2, 4])
def test_a_longer_interval_sends_the_first_piece_at_once_then_every_n_tokens(text, interval):
    frames = _frames(text, interval)
    tokenizer = get_tokenizer()
    assert "".join(frame for frame, _ in frames) == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    first_piece = _frames(text, 1)[0]
    assert frames[0] == first_piece  # never later than with interval 1: TTFT does not move
    assert all(covered >= interval for _, covered in frames[1:-1])  # the last one is whatever is left
    assert len(frames) <= 2 + sum(covered for _, covered in frames[1:]) // interval


def _token(request_id: str, seq: int) -> dict:
    return {"type": "chat.token", "request_id": request_id, "text": f"{seq} ", "seq": seq}


async def _receive_all(queue: asyncio.Queue, count: int) -> list[dict]:
    return [await asyncio.wait_for(queue.get(), timeout=10) for _ in range(count)]


async def _send_and_receive(sender: ChannelSender, request_ids: list[str], tokens: int) -> dict[str, list[dict]]:
    inbox = stream_inbox()
    queues = {request_id: inbox.open(request_id) for request_id in request_ids}
    for seq in range(tokens):
        for request_id in request_ids:
            sender.send_frame(inbox.key, request_id, _token(request_id, seq), tokens_streamed=seq + 1)
    for request_id in request_ids:
        done = {"type": "chat.done", "request_id": request_id, "frames": tokens}
        assert await asyncio.to_thread(sender.send_frame, inbox.key, request_id, done, wait=True)
    return {request_id: await _receive_all(queue, tokens + 1) for request_id, queue in queues.items()}


@pytest.mark.django_db
def test_each_requests_frames_arrive_in_order_and_the_final_frame_last(redis_db):
    sender = ChannelSender()
    request_ids = [f"order-{uuid.uuid4().hex}" for _ in range(4)]
    received = asyncio.run(_send_and_receive(sender, request_ids, tokens=150))
    for request_id, messages in received.items():
        assert [m["seq"] for m in messages[:-1]] == list(range(150))
        assert messages[-1] == {"type": "chat.done", "request_id": request_id, "frames": 150}


def _bundles(key: str) -> list[list[dict]]:
    return [json.loads(raw) for raw in redis_client().lrange(key, 0, -1)]


@pytest.mark.django_db
def test_frames_handed_over_together_go_out_together_one_push_per_inbox(redis_db):
    """An engine step's frames for every request of a web process arrive in one bundle, not one each."""
    sender = ChannelSender()
    inboxes = [f"{INBOX_KEY_PREFIX}test-{uuid.uuid4().hex}" for _ in range(2)]
    request_ids = {inbox: [f"r{i}-{uuid.uuid4().hex}" for i in range(10)] for inbox in inboxes}
    for step in range(3):
        for inbox in inboxes:
            for request_id in request_ids[inbox]:
                sender.send_frame(inbox, request_id, _token(request_id, step))
    assert sender.send_frame(inboxes[0], "last", {"type": "chat.done", "request_id": "last"}, wait=True)
    for inbox in inboxes:
        bundles = _bundles(inbox)
        frames = [frame for bundle in bundles for frame in bundle]
        assert {frame["request_id"] for frame in frames} >= set(request_ids[inbox])
        assert {frame["request_id"] for frame in frames} <= set(request_ids[inbox]) | {"last"}
        for request_id in request_ids[inbox]:
            assert [f["seq"] for f in frames if f["request_id"] == request_id] == [0, 1, 2]
        assert len(bundles) < len(frames) / 5, f"{len(frames)} frames in {len(bundles)} pushes"
        assert 0 < redis_client().ttl(inbox) <= INBOX_EXPIRY_S


@pytest.fixture
def heartbeat():
    """Progress is recorded only by a worker that publishes a heartbeat (others cannot be checked)."""
    stats.heartbeat.set()
    yield
    stats.heartbeat.clear()


@pytest.mark.django_db
@pytest.mark.parametrize("inbox", ["", "ceiling:inbox:progress-test"])
def test_progress_is_recorded_before_each_frame_and_never_after_the_claim_is_released(redis_db, heartbeat, inbox):
    """Also with nobody listening (a batch item): the ledger of a dead worker needs the count."""
    sender = ChannelSender()
    request_id = f"progress-{uuid.uuid4().hex}"
    key = RUNNING_KEY.format(request_id)
    claim_request(request_id, ttl_s=60)
    for seq in range(20):
        sender.send_frame(inbox, request_id, _token(request_id, seq), tokens_streamed=seq + 1)
    assert sender.send_frame(inbox, request_id, {"type": "chat.done"}, wait=True)  # after every token before it
    assert redis_client().hget(key, "tokens") == b"20"
    assert 0 < redis_client().ttl(key) <= 60

    release_claim(request_id)
    sender.send_frame(inbox, request_id, _token(request_id, 20), tokens_streamed=21)
    assert sender.send_frame(inbox, request_id, {"type": "chat.done"}, wait=True)
    assert not redis_client().exists(key), "a late progress write must not leave a key without a TTL"
    redis_client().delete(inbox or "unused")


async def _unsendable_then_sent(sender: ChannelSender, request_id: str) -> tuple[bool, bool, list[dict]]:
    inbox = stream_inbox()
    queue = inbox.open(request_id)
    failed = sender.send_frame(inbox.key, request_id, {"type": "chat.token", "request_id": request_id, "bad": object()})
    sender.send_frame(inbox.key, request_id, {"type": "chat.token", "request_id": request_id, "n": 2}, tokens_streamed=1)
    done = {"type": "chat.done", "request_id": request_id, "n": 3}
    sent = await asyncio.to_thread(sender.send_frame, inbox.key, request_id, done, wait=True)
    return failed, sent, await _receive_all(queue, 2)


@pytest.mark.django_db
def test_a_frame_that_cannot_be_sent_is_reported_and_does_not_block_the_later_frames(redis_db):
    request_id = f"fail-{uuid.uuid4().hex}"
    failed, sent, received = asyncio.run(_unsendable_then_sent(ChannelSender(), request_id))
    assert failed is False and sent is True
    assert received == [{"type": "chat.token", "request_id": request_id, "n": 2},
                        {"type": "chat.done", "request_id": request_id, "n": 3}]


@pytest.mark.django_db
def test_a_full_inbox_drops_the_send_and_says_so(redis_db, settings):
    """A web process that stopped reading must not grow a list without bound; the ledger has the rest."""
    settings.CEILING_CHANNEL_CAPACITY = 2
    sender = ChannelSender()
    inbox = f"{INBOX_KEY_PREFIX}full-{uuid.uuid4().hex}"
    results = [sender.send_frame(inbox, "r", _token("r", seq), wait=True) for seq in range(4)]
    assert results == [True, True, False, False]
    assert [bundle[0]["seq"] for bundle in _bundles(inbox)] == [0, 1]
    redis_client().delete(inbox)


async def _reader_lifecycle() -> list:
    inbox = stream_inbox()
    assert stream_inbox() is inbox  # one per event loop
    client = redis_client()
    seen = []
    queue = inbox.open("mine")
    client.rpush(inbox.key, b"not json", b'{"request_id": "mine"}', json.dumps([{"request_id": ["mine"]}, 7]),
                 json.dumps([{"request_id": "someone-elses", "n": 0}, {"request_id": "mine", "n": 1}]))
    seen.append(await asyncio.wait_for(queue.get(), timeout=5))
    inbox.close("mine")
    await asyncio.sleep(StreamInbox.BLOCK_S + 1.0)
    seen.append(inbox._reader is None)  # nothing open: no reader blocks on Redis
    queue = inbox.open("mine-again")
    client.rpush(inbox.key, json.dumps([{"request_id": "mine", "n": 2}, {"request_id": "mine-again", "n": 3}]))
    seen.append(await asyncio.wait_for(queue.get(), timeout=5))
    inbox.close("mine-again")
    return seen


@pytest.mark.django_db
def test_the_inbox_sorts_frames_out_by_request_and_reads_only_while_a_request_waits(redis_db):
    """Unreadable bundles and frames for requests that ended are dropped; the reader goes on."""
    assert asyncio.run(_reader_lifecycle()) == [{"request_id": "mine", "n": 1}, True, {"request_id": "mine-again", "n": 3}]


def test_a_frame_waits_for_its_milliseconds_after_the_first_and_loses_nothing():
    """CEILING_STREAM_FRAME_MS: the first piece at once, then a frame once 25 ms have passed since the
    last one; the held text goes out with the next frame, and the end whatever the time."""
    now = [0.0]
    buffer = FrameBuffer(1, frame_ms=25, clock=lambda: now[0])
    sent = []
    for piece in ["Hello", ",", " world", "!", " How", " are", " you"]:
        sent.append(buffer.add(piece, 1))
        now[0] += 0.010  # a token every 10 ms
    assert sent == ["Hello", "", "", ", world!", "", "", " How are you"]  # at 0, 30 and 60 ms
    assert buffer.add("?", 1) == ""  # 10 ms after the last frame: held, then the end sends it
    assert buffer.take() == "?" and "".join(sent) + "?" == "Hello, world! How are you?"


def test_the_frame_milliseconds_reach_the_worker_from_the_setting(settings):
    from budgets.models import TokenLog
    from inference.worker.generation import TokenStream

    settings.CEILING_STREAM_INTERVAL, settings.CEILING_STREAM_FRAME_MS = 2, 40
    stream = TokenStream(TokenLog(request_id="frames"), reply_to="")
    assert (stream.frames.interval, stream.frames.frame_s) == (2, 0.04)
