"""Which worker runs a request, and how far it got.

A worker records itself as the owner when it starts a request and the tokens streamed as they go
(outbox.py writes the progress before each frame), so a web process that hears nothing can tell a
dead worker (its heartbeat expired) from a slow one, and the ledger counts what the user saw.
"""

from __future__ import annotations

import logging

import redis

from .clients import redis_client
from .stats import heartbeat, is_worker_alive, worker_id

log = logging.getLogger(__name__)

RUNNING_KEY = "ceiling:running:{}"


def claim_request(request_id: str, ttl_s: int) -> None:
    """Record this worker as the request's owner (only a worker with a heartbeat can be checked)."""
    if not heartbeat.is_set():
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
        if is_worker_alive(claim[b"worker"].decode()):
            return None
    except redis.RedisError:
        return None  # cannot tell; the timeouts still end the request
    return int(claim.get(b"tokens", 0))


