"""The worker's side of streaming: ids → text pieces, and the channel-layer sender's ordering."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from channels.layers import get_channel_layer

from inference import bus
from inference.generation import FrameBuffer, IncrementalDecoder
from inference.tokenizer import get_tokenizer

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


async def _listen(group: str) -> str:
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(group, channel)
    return channel


async def _receive_all(channel: str, count: int) -> list[dict]:
    layer = get_channel_layer()
    return [await asyncio.wait_for(layer.receive(channel), timeout=10) for _ in range(count)]


async def _send_and_receive(sender: bus.ChannelSender, groups: list[str], tokens: int) -> dict[str, list[dict]]:
    channels = {group: await _listen(group) for group in groups}
    for seq in range(tokens):
        for group in groups:
            sender.send_token(group, {"type": "chat.token", "text": f"{seq} ", "seq": seq}, group, seq + 1)
    for group in groups:
        assert await asyncio.to_thread(sender.group_send, group, {"type": "chat.done", "frames": tokens})
    return {group: await _receive_all(channel, tokens + 1) for group, channel in channels.items()}


@pytest.mark.django_db
def test_each_groups_frames_arrive_in_order_and_the_final_frame_last(redis_db):
    sender = bus.ChannelSender()
    groups = [f"order-{uuid.uuid4().hex}" for _ in range(4)]
    received = asyncio.run(_send_and_receive(sender, groups, tokens=150))
    for messages in received.values():
        assert [m["seq"] for m in messages[:-1]] == list(range(150))
        assert messages[-1] == {"type": "chat.done", "frames": 150}


@pytest.fixture
def heartbeat():
    """Progress is recorded only by a worker that publishes a heartbeat (others cannot be checked)."""
    bus._heartbeat.set()
    yield
    bus._heartbeat.clear()


@pytest.mark.django_db
def test_progress_is_recorded_before_each_frame_and_never_after_the_claim_is_released(redis_db, heartbeat):
    sender = bus.ChannelSender()
    request_id = f"progress-{uuid.uuid4().hex}"
    group = bus.request_group(request_id)
    key = bus.RUNNING_KEY.format(request_id)
    bus.claim_request(request_id, ttl_s=60)
    for seq in range(20):
        sender.send_token(group, {"type": "chat.token", "text": "x", "seq": seq}, request_id, seq + 1)
    assert sender.group_send(group, {"type": "chat.done"})  # goes out after every token before it
    assert bus.redis_client().hget(key, "tokens") == b"20"
    assert 0 < bus.redis_client().ttl(key) <= 60

    bus.release_claim(request_id)
    sender.send_token(group, {"type": "chat.token", "text": "late", "seq": 20}, request_id, 21)
    assert sender.group_send(group, {"type": "chat.done"})
    assert not bus.redis_client().exists(key), "a late progress write must not leave a key without a TTL"


async def _failed_then_sent(sender: bus.ChannelSender, group: str) -> tuple[bool, bool, list[dict]]:
    channel = await _listen(group)
    # The real channel layer refuses a message it cannot serialise (msgpack knows no such object).
    failed = await asyncio.to_thread(sender.group_send, group, {"type": "chat.token", "n": 1, "bad": object()})
    sender.send_token(group, {"type": "chat.token", "n": 2}, "no-heartbeat", 1)
    sent = await asyncio.to_thread(sender.group_send, group, {"type": "chat.done", "n": 3})
    return failed, sent, await _receive_all(channel, 2)


@pytest.mark.django_db
def test_a_failed_send_is_reported_and_does_not_block_the_groups_later_frames(redis_db):
    failed, sent, received = asyncio.run(_failed_then_sent(bus.ChannelSender(), f"fail-{uuid.uuid4().hex}"))
    assert failed is False and sent is True
    assert received == [{"type": "chat.token", "n": 2}, {"type": "chat.done", "n": 3}]
