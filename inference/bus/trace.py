"""Where a request's time to first token goes: a timestamp per stage, when CEILING_TTFT_TRACE is on.

Off by default (a production request records nothing). `manage.py bench --modes remote` turns it on
in the daphne and worker it starts, and reads each request's stages back to split its TTFT:

    admitted     the guard said yes (web process)
    dispatched   the Celery task is being published to the broker (web process; stamped before
                 the publish, which a free worker can overtake)
    picked       a worker thread started the task
    sent         the worker sent the request to the remote server
    connected    the remote answered with its status and headers
    first_byte   the remote's first piece of the answer was read
    first_frame  the worker handed the first token frame to its sender

Each is one HSET of a wall-clock time (time.time(): every process of a bench runs on one machine)
under a key that expires by itself.
"""

from __future__ import annotations

import logging
import time

import redis
from django.conf import settings

from .clients import redis_client

log = logging.getLogger(__name__)

TRACE_KEY = "ceiling:trace:{}"
TRACE_TTL_S = 600
STAGES = ("admitted", "dispatched", "picked", "sent", "connected", "first_byte", "first_frame")


def mark(request_id: str, stage: str, at: float | None = None) -> None:
    """Record when the request reached this stage (now, unless `at` says when)."""
    if not settings.CEILING_TTFT_TRACE:
        return
    key = TRACE_KEY.format(request_id)
    try:
        with redis_client().pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, stage, repr(time.time() if at is None else at))
            pipe.expire(key, TRACE_TTL_S)
            pipe.execute()
    except redis.RedisError as exc:  # a trace is never worth failing a request for
        log.warning("could not trace %s of %s: %s", stage, request_id, exc)


def read_traces(request_ids: list[str]) -> dict[str, dict[str, float]]:
    """request id → {stage: wall-clock time} for the stages it recorded."""
    with redis_client().pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.hgetall(TRACE_KEY.format(request_id))
        found = pipe.execute()
    return {
        request_id: {name.decode(): float(value) for name, value in stages.items()}
        for request_id, stages in zip(request_ids, found, strict=True)
    }
