"""Side channels between web processes and workers, all through Redis.

- Cancellation: the consumer publishes a request id on one pub/sub channel; every worker listens
  and cancels it in its engine within one decode step. A short-lived key covers the race where the
  cancel arrives before the task has submitted the request.
- Engine stats: each worker writes its engine's stats under its own key every half second, with a
  TTL, so a dead worker disappears from the list by itself.
- Ownership: a worker records which process runs a request and how many tokens it has streamed,
  so a web process that hears nothing can tell a dead worker (its stats key expired) from a slow one.
- Streaming: every web process (per event loop) reads one Redis list, its inbox; a request's
  dispatch names the inbox, and the worker pushes that request's frames there. A worker thread
  hands each frame to one long-lived event loop, which sends all the frames handed over within a
  few milliseconds (an engine step's worth, for every request it is running) in one pipelined round
  trip: one push per inbox, each request's progress record before its frames. Per token, that is a
  fraction of one Redis command instead of the channel layer's five, and one wake-up of the web
  process per step instead of one per token; both sides share the two cores with the engine here.
  The channel layer remains for the dashboards' groups.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import redis
import redis.asyncio as aioredis
from channels.layers import get_channel_layer
from django.conf import settings

log = logging.getLogger(__name__)

CANCEL_CHANNEL = "ceiling:cancel"
CANCEL_KEY = "ceiling:cancelled:{}"
STATS_KEY_PREFIX = "ceiling:engine:"
STATS_TTL_S = 5
RUNNING_KEY = "ceiling:running:{}"
INBOX_KEY_PREFIX = "ceiling:inbox:"


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


# --- cancellation -------------------------------------------------------------------------------


async def arequest_cancel(request_id: str) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    try:
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(CANCEL_KEY.format(request_id), 1, ex=600)
            pipe.publish(CANCEL_CHANNEL, request_id)
            await pipe.execute()
    finally:
        await client.aclose()


def request_cancel(request_id: str) -> None:
    pipe = redis_client().pipeline(transaction=False)
    pipe.set(CANCEL_KEY.format(request_id), 1, ex=600)
    pipe.publish(CANCEL_CHANNEL, request_id)
    pipe.execute()


def is_cancel_requested(request_id: str) -> bool:
    return bool(redis_client().exists(CANCEL_KEY.format(request_id)))


def listen_for_cancellations(on_cancel: Callable[[str], object], stop: threading.Event) -> None:
    """Run in a thread: call on_cancel(request_id) for every published cancellation; reconnects."""
    while not stop.is_set():
        try:
            pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CANCEL_CHANNEL)
            while not stop.is_set():
                message = pubsub.get_message(timeout=0.5)
                if message and message["type"] == "message":
                    on_cancel(message["data"].decode())
        except redis.RedisError as exc:
            log.warning("cancellation listener lost Redis (%s); reconnecting", exc)
            stop.wait(1.0)


# --- which worker runs a request, and how far it got ----------------------------------------------

# Set once this process publishes its stats: only then can others tell whether it is alive.
_heartbeat = threading.Event()


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def claim_request(request_id: str, ttl_s: int) -> None:
    """Record this worker as the request's owner (only a worker with a heartbeat can be checked)."""
    if not _heartbeat.is_set():
        return
    key = RUNNING_KEY.format(request_id)
    try:
        with redis_client().pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"worker": worker_id(), "tokens": 0})
            pipe.expire(key, ttl_s)
            pipe.execute()
    except redis.RedisError as exc:  # the stream goes on; only dead-worker detection is lost
        log.warning("could not record the owner of %s: %s", request_id, exc)


# The tokens streamed so far: what the ledger counts if the worker dies before settling. Written only
# while the claim exists: a late write after release_claim must not leave a key with no TTL behind.
RECORD_PROGRESS_LUA = """
if redis.call('exists', KEYS[1]) == 1 then redis.call('hset', KEYS[1], 'tokens', ARGV[1]) end
"""


def release_claim(request_id: str) -> None:
    try:
        redis_client().delete(RUNNING_KEY.format(request_id))
    except redis.RedisError:
        pass  # it expires by itself


def lost_request_progress(request_id: str) -> int | None:
    """Tokens streamed by the request's owner if that worker is dead; None if alive or unknown."""
    try:
        claim = redis_client().hgetall(RUNNING_KEY.format(request_id))
        if not claim or b"worker" not in claim:
            return None
        if redis_client().exists(STATS_KEY_PREFIX + claim[b"worker"].decode()):
            return None
    except redis.RedisError:
        return None  # cannot tell; the timeouts still end the request
    return int(claim.get(b"tokens", 0))


# --- engine stats ------------------------------------------------------------------------------


def worker_stats_key() -> str:
    return f"{STATS_KEY_PREFIX}{worker_id()}"


def publish_stats_forever(read_stats: Callable[[], dict], stop: threading.Event, every_s: float = 0.5) -> None:
    """Also this worker's heartbeat: the key expires STATS_TTL_S after the process stops."""
    key = worker_stats_key()
    while True:
        try:
            redis_client().set(key, json.dumps(read_stats()), ex=STATS_TTL_S)
            _heartbeat.set()
        except redis.RedisError as exc:
            log.warning("could not publish engine stats: %s", exc)
        except Exception:  # noqa: BLE001 - stats must never take the worker down
            log.exception("reading engine stats failed")
        if stop.wait(every_s):
            return


def read_engine_stats() -> list[dict]:
    """The live stats of every worker's engine (those that reported in the last few seconds)."""
    client = redis_client()
    keys = sorted(client.scan_iter(match=STATS_KEY_PREFIX + "*", count=100))
    if not keys:
        return []
    return [json.loads(raw) | {"worker": key.decode()[len(STATS_KEY_PREFIX) :]} for key, raw in zip(keys, client.mget(keys), strict=True) if raw]


# --- streaming: worker threads → one sender loop → each web process's inbox ----------------------

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
    inbox: str  # "" when nobody listens (batch and refine calls): only the progress is recorded
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
        progress = tokens_streamed if _heartbeat.is_set() else None
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
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
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


class StreamInbox:
    """The web side: one Redis list per event loop, read by one task, frames sorted out by request.

    A request opens a queue before it is dispatched (the dispatch names `key`) and closes it when it
    ends; frames for a request nobody holds open any more are dropped. The reader runs while any
    queue is open, so an idle process holds no blocking Redis connection.
    """

    BLOCK_S = 1.0  # how long one BLPOP waits; also how soon an idle reader stops
    DRAIN = 256  # bundles taken per round trip once one has arrived

    def __init__(self) -> None:
        self.key = f"{INBOX_KEY_PREFIX}{worker_id()}:{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    def open(self, request_id: str) -> asyncio.Queue:
        inbox = self._queues[request_id] = asyncio.Queue()
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_while_open())
        return inbox

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read_while_open(self) -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=self.BLOCK_S + 10, socket_connect_timeout=5)
        try:
            while self._queues:
                for raw in await self._next_bundles(client):
                    self._sort_out(raw)
        finally:
            self._reader = None  # before any await: a request opened from now on starts a new reader
            await client.aclose()

    async def _next_bundles(self, client: aioredis.Redis) -> list[bytes]:
        try:
            first = await client.blpop([self.key], timeout=self.BLOCK_S)
            if first is None:
                return []
            return [first[1], *(await client.lpop(self.key, self.DRAIN) or [])]
        except redis.RedisError as exc:
            # What is lost meanwhile, each request recovers from the ledger (session._relay).
            log.warning("reading the stream inbox %s failed (%s); retrying in 1 s", self.key, exc)
            await asyncio.sleep(1.0)
            return []

    def _sort_out(self, raw: bytes) -> None:
        try:
            frames = json.loads(raw)
        except ValueError:
            log.warning("dropped an unreadable bundle from %s", self.key)
            return
        if not isinstance(frames, list):
            frames = []
        for frame in frames:
            request_id = frame.get("request_id") if isinstance(frame, dict) else None
            queue = self._queues.get(request_id) if isinstance(request_id, str) else None
            if queue is not None:
                queue.put_nowait(frame)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamInbox] = weakref.WeakKeyDictionary()


def stream_inbox() -> StreamInbox:
    """The running event loop's inbox (daphne runs one loop; tests may run several, one after another)."""
    loop = asyncio.get_running_loop()
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = StreamInbox()
    return inbox
