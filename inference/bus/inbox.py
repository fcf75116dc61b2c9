"""Streaming, the web side: one Redis list per event loop, read by one task, frames sorted out by request.

A request's dispatch names the inbox; the worker pushes that request's frames there (outbox.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import uuid
import weakref

import redis
import redis.asyncio as aioredis

from .clients import async_client, blocking_read
from .stats import worker_id

log = logging.getLogger(__name__)

INBOX_KEY_PREFIX = "ceiling:inbox:"


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
            # In a context of its own: the reader serves every request of this process, not the one
            # that happened to start it, so its log lines and its Redis calls (traced, when tracing is
            # on) must not be that request's.
            self._reader = asyncio.get_running_loop().create_task(self._read_while_open(), context=contextvars.Context())
        return inbox

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read_while_open(self) -> None:
        client = async_client(blocking_read(self.BLOCK_S))
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
            # What is lost meanwhile, each request recovers from the ledger (inference/chat/relay.py).
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
