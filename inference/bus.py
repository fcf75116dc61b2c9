"""Side channels between web processes and workers, all through Redis.

- Cancellation: the consumer publishes a request id on one pub/sub channel; every worker listens
  and cancels it in its engine within one decode step. A short-lived key covers the race where the
  cancel arrives before the task has submitted the request.
- Engine stats: each worker writes its engine's stats under its own key every half second, with a
  TTL, so a dead worker disappears from the list by itself.
- Ownership: a worker records which process runs a request and how many tokens it has streamed,
  so a web process that hears nothing can tell a dead worker (its stats key expired) from a slow one.
- Streaming: the channel layer is asyncio; a worker thread hands messages to one long-lived event
  loop (one connection pool) instead of spinning up a loop and a connection per token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
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


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


def request_group(request_id: str) -> str:
    return f"req.{request_id}"


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


# --- streaming to the channel layer from worker threads ------------------------------------------


class ChannelSender:
    """One event loop thread that performs every group_send of this process.

    Messages to one group go out in the order they were handed over, each after the one before it
    finished; messages to different groups go out side by side. The hand-over never waits for Redis,
    so a worker's streaming threads (one per chat) spend no time blocked on the channel layer and
    its round trips overlap on the loop instead of taking turns for the GIL.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="channel-sender", daemon=True)
        self.thread.start()
        self.layer = get_channel_layer()
        self._last_send: dict[str, asyncio.Task] = {}  # group → its newest send (loop thread only)
        self._redis: aioredis.Redis | None = None  # the loop's own client, for progress records

    def group_send(self, group: str, message: dict, timeout: float = 5.0, wait: bool = True) -> bool:
        """Send after the group's earlier messages; wait for it unless wait=False. False if it failed."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._enqueue, group, message, None, done)
        if not wait:
            return True
        try:
            return done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            log.warning("channel layer send to %s took over %.0f s", group, timeout)
            return False

    def send_token(self, group: str, message: dict, request_id: str, tokens_streamed: int) -> None:
        """Hand a token frame over and return at once; its progress record is written before it is sent."""
        progress = (request_id, tokens_streamed) if _heartbeat.is_set() else None
        self.loop.call_soon_threadsafe(self._enqueue, group, message, progress, None)

    def _enqueue(self, group: str, message: dict, progress, done) -> None:
        previous = self._last_send.get(group)
        task = self.loop.create_task(self._send_after(previous, group, message, progress, done))
        self._last_send[group] = task
        task.add_done_callback(lambda finished: self._forget(group, finished))

    def _forget(self, group: str, finished: asyncio.Task) -> None:
        if self._last_send.get(group) is finished:
            del self._last_send[group]

    async def _send_after(self, previous, group: str, message: dict, progress, done) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # never raises: the previous send caught its own failure
        sent = False
        try:
            if progress is not None:
                await self._record_progress(*progress)
            await self.layer.group_send(group, message)
            sent = True
        except Exception as exc:  # noqa: BLE001 - the channel layer is at-most-once; the ledger is not
            log.warning("channel layer send to %s failed: %s", group, exc)
        if done is not None and not done.done():
            done.set_result(sent)

    async def _record_progress(self, request_id: str, tokens: int) -> None:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
        try:
            await self._redis.eval(RECORD_PROGRESS_LUA, 1, RUNNING_KEY.format(request_id), tokens)
        except redis.RedisError as exc:
            log.warning("could not record the progress of %s: %s", request_id, exc)


_sender: ChannelSender | None = None
_sender_lock = threading.Lock()


def channel_sender() -> ChannelSender:
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = ChannelSender()
        return _sender
