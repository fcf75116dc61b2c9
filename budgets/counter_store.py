"""The guard's counter store, one per process: below the guard, the reference cache (budgets/refcache.py)
and everything else that reads or writes the counters' Redis, so none of them imports the guard for it."""

from __future__ import annotations

from functools import lru_cache

import redis
from django.conf import settings

from . import redis_clients
from .counters import CounterStore


class EvictingRedis(redis.RedisError):
    """The counters' Redis may evict keys: a reservation or a counter could vanish, and the ceiling with it.

    A RedisError, so every caller treats it as a Redis it cannot use: admissions are refused (fail
    closed), settles are left for reconciliation.
    """


SAFE_EVICTION_POLICY = "noeviction"


def refuse_evicting_redis(client) -> None:
    """Raise EvictingRedis unless every node of the counters' Redis has maxmemory-policy noeviction.

    Read from INFO (managed Redis services often disable CONFIG). Counters, reservations and their
    settle markers carry TTLs, so even the volatile-* policies could evict them.
    """
    info = client.info("memory")
    nodes = info.values() if info and all(isinstance(value, dict) for value in info.values()) else [info]
    policies = {str(node.get("maxmemory_policy", SAFE_EVICTION_POLICY)) for node in nodes}
    unsafe = sorted(policies - {SAFE_EVICTION_POLICY})
    if unsafe:
        raise EvictingRedis(
            f"The guard's Redis has maxmemory-policy {', '.join(unsafe)}, which may evict counters and reservations "
            f"and so break the ceiling; set maxmemory-policy {SAFE_EVICTION_POLICY} on it (and put the answer caches "
            "on a Redis of their own with CEILING_CACHE_URL)."
        )


@lru_cache(maxsize=1)
def counter_store() -> CounterStore:
    """The guard's counters, on a Redis that is checked once per process never to evict them."""
    # Short timeouts and no retries: when Redis is gone the guard must say so quickly (fail closed).
    client = redis_clients.sync_client(
        redis_clients.counters_url(),
        socket_connect_timeout=settings.CEILING_GUARD_TIMEOUT_S,
        socket_timeout=settings.CEILING_GUARD_TIMEOUT_S,
        no_retries=True,
    )
    refuse_evicting_redis(client)  # raises: not cached, so the next call checks again
    return CounterStore(client, wait_replicas=settings.CEILING_COUNTERS_WAIT_REPLICAS,
                        wait_timeout_ms=settings.CEILING_COUNTERS_WAIT_MS)
