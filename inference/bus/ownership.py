"""Which worker runs a request, and how far it got.

A worker records itself as the owner when it starts a request, with the inbox of the web process
waiting for it, and the tokens streamed as they go (outbox.py writes the progress before each frame),
so a web process that hears nothing can tell a dead worker (its heartbeat expired) from a slow one,
and the ledger counts what the user saw. Every live worker also sweeps these records
(inference/worker/lost.py), so a dead worker's requests are settled even when no web process waits.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import redis

from .clients import redis_client
from .stats import heartbeat, is_worker_alive, worker_id

log = logging.getLogger(__name__)

RUNNING_KEY = "ceiling:running:{}"


def claim_request(request_id: str, ttl_s: int, inbox: str = "") -> None:
    """Record this worker as the request's owner (only a worker with a heartbeat can be checked).

    inbox: the stream inbox of the web process waiting for the request ("" when none waits), so a
    sweeping worker can tell that process when this one dies.
    """
    if not heartbeat.is_set():
        return
    with _held_lock:
        _held[request_id] = (ttl_s, inbox)
    key = RUNNING_KEY.format(request_id)
    try:
        with redis_client().pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"worker": worker_id(), "tokens": 0, "inbox": inbox})
            pipe.expire(key, ttl_s)
            pipe.execute()
    except redis.RedisError as exc:  # the stream goes on; only dead-worker detection is lost
        log.warning("could not record the owner of %s: %s", request_id, exc)


# The tokens streamed so far: what the ledger counts if the worker dies before settling. Written only
# while the claim exists: a late write after release_claim must not leave a key with no TTL behind.
RECORD_PROGRESS_LUA = """
if redis.call('exists', KEYS[1]) == 1 then redis.call('hset', KEYS[1], 'tokens', ARGV[1]) end
"""


# The claims this process holds. Its heartbeat puts back one that Redis lost (a restart, a failover)
# within a beat, and its own sweep never takes one of them for a request no worker picked up: without
# this, a healthy answer running past the first-token timeout was failed there, unbilled, and its user
# got an error after the whole answer.
_held: dict[str, tuple[int, str]] = {}
_held_lock = threading.Lock()

REASSERT_LUA = """
if redis.call('exists', KEYS[1]) == 1 then return 0 end
redis.call('hset', KEYS[1], 'worker', ARGV[1], 'tokens', 0, 'inbox', ARGV[2])
redis.call('expire', KEYS[1], tonumber(ARGV[3]))
return 1
"""


def holds(request_id: str) -> bool:
    """Whether this process runs the request (whatever Redis says)."""
    return request_id in _held


def reassert_claims(client: redis.Redis | None = None) -> int:
    """Put back this process's claims that Redis lost; how many were missing. Runs with each heartbeat."""
    with _held_lock:
        held = list(_held.items())
    if not held:
        return 0
    client = client or redis_client()
    with client.pipeline(transaction=False) as pipe:
        for request_id, (ttl_s, inbox) in held:
            pipe.eval(REASSERT_LUA, 1, RUNNING_KEY.format(request_id), worker_id(), inbox, ttl_s)
        restored = sum(pipe.execute())
    if restored:
        log.warning("put back %d request claims that Redis had lost", restored)
    return restored


def release_claim(request_id: str) -> None:
    with _held_lock:
        _held.pop(request_id, None)
    try:
        redis_client().delete(RUNNING_KEY.format(request_id))
    except redis.RedisError:
        pass  # it expires by itself


def unclaimed(request_ids: list[str]) -> list[str]:
    """Those of the requests that no worker has claimed (one round trip); raises redis.RedisError."""
    if not request_ids:
        return []
    with redis_client().pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.exists(RUNNING_KEY.format(request_id))
        found = pipe.execute()
    return [request_id for request_id, exists in zip(request_ids, found, strict=True) if not exists]


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




@dataclass(frozen=True)
class LostClaim:
    """A request whose owner's heartbeat is gone: the tokens it had streamed, and who waits for it."""

    request_id: str
    worker: str
    tokens: int
    inbox: str


def lost_claims(scan_count: int = 500) -> list[LostClaim]:
    """Every recorded request whose owning worker is dead (its heartbeat expired); two round trips
    per scanned batch, whatever the number of claims."""
    client = redis_client()
    prefix = RUNNING_KEY.format("")
    keys = list(client.scan_iter(match=prefix + "*", count=scan_count))
    if not keys:
        return []
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
        claims = pipe.execute()
    owned = [(key.decode()[len(prefix):], claim) for key, claim in zip(keys, claims, strict=True) if claim.get(b"worker")]
    workers = sorted({claim[b"worker"].decode() for _, claim in owned})
    alive = dict(zip(workers, (is_worker_alive(w) for w in workers), strict=True))
    return [
        LostClaim(request_id, claim[b"worker"].decode(), int(claim.get(b"tokens", 0)), claim.get(b"inbox", b"").decode())
        for request_id, claim in owned
        if not alive[claim[b"worker"].decode()]
    ]
