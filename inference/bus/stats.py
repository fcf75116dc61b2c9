"""Engine stats: each worker writes its engines' stats under its own key every half second, with a TTL.

The key is also the worker's heartbeat: it expires STATS_TTL_S after the process stops, so a dead
worker disappears from the list by itself, and ownership.py can tell it is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

import redis

from .clients import redis_client

log = logging.getLogger(__name__)

STATS_KEY_PREFIX = "ceiling:engine:"
STATS_TTL_S = 5

# Set once this process publishes its stats: only then can others tell whether it is alive.
heartbeat = threading.Event()


# host:pid alone may come back: a restarted container often has the same hostname and pid, and its
# heartbeat would make the dead process's requests look alive. A token per process start tells them apart.
_START_TOKEN = uuid.uuid4().hex[:6]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_START_TOKEN}"


def is_worker_alive(worker: str) -> bool:
    return bool(redis_client().exists(STATS_KEY_PREFIX + worker))


def worker_stats_key() -> str:
    return f"{STATS_KEY_PREFIX}{worker_id()}"


def publish_stats_forever(read_stats: Callable[[], dict], stop: threading.Event, every_s: float = 0.5,
                          with_beat: Callable[[redis.Redis, str], None] | None = None) -> None:
    """Also this worker's heartbeat: the key expires STATS_TTL_S after the process stops.

    with_beat(client, worker id), if given, runs after each beat (the worker marks its queues served).
    """
    key = worker_stats_key()
    while True:
        try:
            redis_client().set(key, json.dumps(read_stats()), ex=STATS_TTL_S)
            heartbeat.set()
            if with_beat is not None:
                with_beat(redis_client(), worker_id())
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
    # One GET per worker in one pipeline, not MGET: on a cluster the workers' keys sit on different slots.
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
        found = pipe.execute()
    return [json.loads(raw) | {"worker": key.decode()[len(STATS_KEY_PREFIX) :]} for key, raw in zip(keys, found, strict=True) if raw]


