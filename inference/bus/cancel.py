"""Cancellation: a web process publishes a request id; every worker cancels it within one step.

A short-lived key covers the race where the cancel arrives before the task has submitted the request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from .clients import async_client, redis_client

log = logging.getLogger(__name__)

CANCEL_CHANNEL = "ceiling:cancel"
CANCEL_KEY = "ceiling:cancelled:{}"


async def arequest_cancel(request_id: str) -> None:
    # The key first, then the message (two commands: a cluster pipeline cannot carry PUBLISH).
    client = async_client()
    try:
        await client.set(CANCEL_KEY.format(request_id), 1, ex=600)
        await client.publish(CANCEL_CHANNEL, request_id)
    finally:
        await client.aclose()


def request_cancel(request_id: str) -> None:
    client = redis_client()
    client.set(CANCEL_KEY.format(request_id), 1, ex=600)
    client.publish(CANCEL_CHANNEL, request_id)


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


