"""Streaming, the worker's side: worker threads → one sender loop → each web process's inbox.

A worker thread hands each frame to one long-lived event loop, which sends all the frames handed
over within a few milliseconds (an engine step's worth, for every request it is running) in one
pipelined round trip: one push per inbox, each request's progress record before its frames. Per
token, that is a fraction of one Redis command instead of the channel layer's five, and one wake-up
of the web process per step instead of one per token; both sides share the two cores with the
engine here. The same loop sends the staff dashboards' points to their channel-layer group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from dataclasses import dataclass

import redis.asyncio as aioredis
from channels.layers import get_channel_layer
from django.conf import settings

from .clients import async_client
from .ownership import RECORD_PROGRESS_LUA, RUNNING_KEY
from .stats import heartbeat

log = logging.getLogger(__name__)


# How long the sender waits after a frame before it sends: the other requests' frames of the same
# engine step arrive within it (each from its own thread), and they all go out in one round trip.
# Small next to a decode step (45-500 ms here), so it moves no latency anyone can see.
COALESCE_S = 0.003

# Push one bundle of frames onto an inbox unless it already holds `capacity` bundles (a web process
# that stopped reading, or one that is gone): the send is dropped, as the channel layer drops past
# its capacity, and the list expires by itself once nobody pushes to it.
PUSH_BUNDLE_LUA = """
if redis.call('llen', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('rpush', KEYS[1], ARGV[1])
redis.call('expire', KEYS[1], ARGV[3])
return 1
"""
INBOX_EXPIRY_S = 60


@dataclass
class _Frame:
    inbox: str  # "" when nobody listens (batch items): only the progress is recorded
    request_id: str
    payload: str  # the frame as JSON, serialised by the thread that handed it over
    progress: int | None  # tokens streamed so far, recorded before the frame is pushed
    delivered: concurrent.futures.Future | None  # set once it was pushed (True) or dropped (False)


class ChannelSender:
    """One event loop thread that performs every send of this process to Redis.

    Frames (send_frame) go out in bundles: everything handed over within COALESCE_S, one pipelined
    round trip per bundle, bundles one after another, so each request's frames keep their order and
    its final frame comes after its tokens. Dashboard points (group_send) go to a channel-layer
    group. The hand-over never waits for Redis, so a worker's streaming threads (one per chat) spend
    no time blocked on it.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="channel-sender", daemon=True)
        self.thread.start()
        self.layer = get_channel_layer()
        # Frames handed over and not yet taken, from any thread. The loop is woken once per bundle,
        # not once per frame: a flush is scheduled by the first frame after the last one was taken.
        self._handed: list[_Frame] = []
        self._handed_lock = threading.Lock()
        self._flush_scheduled = False
        self._flusher: asyncio.Task | None = None  # referenced, so it is not collected mid-flush
        self._redis: aioredis.Redis | None = None  # the loop's own client

    # --- frames to web processes' inboxes ---------------------------------------------------------

    def send_frame(self, inbox: str, request_id: str, frame: dict, *, tokens_streamed: int | None = None,
                   wait: bool = False, timeout: float = 5.0) -> bool:
        """Hand one frame over; with wait, block until it was pushed. False if it could not be sent.

        With tokens_streamed, the request's progress record is written before the frame is pushed:
        if this worker dies, the ledger counts every token a user saw.
        """
        try:
            payload = json.dumps(frame)
        except (TypeError, ValueError) as exc:
            log.warning("cannot send a frame of %s: %s", request_id, exc)
            return False
        progress = tokens_streamed if heartbeat.is_set() else None
        delivered = concurrent.futures.Future() if wait else None
        self._hand_over(_Frame(inbox, request_id, payload, progress, delivered))
        if delivered is None:
            return True
        return _result_within(delivered, timeout, f"sending the final frame of {request_id}")

    def _hand_over(self, frame: _Frame) -> None:
        with self._handed_lock:
            self._handed.append(frame)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self.loop.call_soon_threadsafe(self._start_flushing)

    def _start_flushing(self) -> None:
        self._flusher = self.loop.create_task(self._flush_while_handed())

    def _take_handed(self) -> list[_Frame]:
        with self._handed_lock:
            frames, self._handed = self._handed, []
            if not frames:
                self._flush_scheduled = False  # the next frame schedules a new flush
            return frames

    async def _flush_while_handed(self) -> None:
        while True:
            await asyncio.sleep(COALESCE_S)
            bundle = self._take_handed()
            if not bundle:
                return
            try:
                await self._push(bundle)
            except Exception:  # a bug here must not stop every later frame of this process
                log.exception("sending %d frames failed", len(bundle))
                for frame in bundle:
                    if frame.delivered is not None and not frame.delivered.done():
                        frame.delivered.set_result(False)

    async def _push(self, frames: list[_Frame]) -> None:
        if self._redis is None:
            self._redis = async_client()
        progress: dict[str, int] = {}
        by_inbox: dict[str, list[_Frame]] = {}
        for frame in frames:
            if frame.progress is not None:
                progress[frame.request_id] = frame.progress  # the newest count is the one that matters
            if frame.inbox:
                by_inbox.setdefault(frame.inbox, []).append(frame)
        pipe = self._redis.pipeline(transaction=False)
        for request_id, tokens in progress.items():
            pipe.eval(RECORD_PROGRESS_LUA, 1, RUNNING_KEY.format(request_id), tokens)
        for inbox, inbox_frames in by_inbox.items():
            bundle = "[" + ",".join(frame.payload for frame in inbox_frames) + "]"
            pipe.eval(PUSH_BUNDLE_LUA, 1, inbox, bundle, settings.CEILING_CHANNEL_CAPACITY, INBOX_EXPIRY_S)
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - streaming is at-most-once; the ledger is not
            log.warning("sending %d frames failed: %s", len(frames), exc)
            results = [exc] * (len(progress) + len(by_inbox))
        pushed = dict(zip(by_inbox, results[len(progress) :], strict=True))
        for inbox, result in pushed.items():
            if result != 1:
                log.warning("%d frames to %s dropped: %s", len(by_inbox[inbox]), inbox,
                            result if isinstance(result, Exception) else "its inbox is full")
        for frame in frames:
            if frame.delivered is not None and not frame.delivered.done():
                frame.delivered.set_result(not frame.inbox or pushed[frame.inbox] == 1)

    # --- dashboard points to channel-layer groups ---------------------------------------------------

    def group_send(self, group: str, message: dict, timeout: float = 5.0, wait: bool = True) -> bool:
        """Send to a channel-layer group; wait for it unless wait=False. False if it failed."""
        future = asyncio.run_coroutine_threadsafe(self._group_send(group, message), self.loop)
        if not wait:
            return True
        return _result_within(future, timeout, f"channel layer send to {group}")

    async def _group_send(self, group: str, message: dict) -> bool:
        try:
            await self.layer.group_send(group, message)
            return True
        except Exception as exc:  # noqa: BLE001 - dashboards are best-effort
            log.warning("channel layer send to %s failed: %s", group, exc)
            return False


def _result_within(future: concurrent.futures.Future, timeout: float, what: str) -> bool:
    """A send's outcome from the sender loop, or False (logged) if it takes longer than timeout."""
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        log.warning("%s took over %.0f s", what, timeout)
        return False


_sender: ChannelSender | None = None
_sender_lock = threading.Lock()


def channel_sender() -> ChannelSender:
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = ChannelSender()
        return _sender
