"""Redis clients for the bus, built in one place with named timeout policies.

They talk to CEILING_COUNTERS_URL (else REDIS_URL), which may be a Redis Cluster: every command and
script of the bus touches one key, so each goes to the node that holds it; a pipeline over many
keys (traces, stats, claims) is split by node, and a SCAN visits every master.

Every command of the bus is short, except the inbox's blocking read, which waits up to its block
time on purpose: its socket timeout must outlast that wait, or an idle inbox would read as a fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from budgets.redis_clients import async_client as any_async_client
from budgets.redis_clients import counters_url, sync_client


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    read_s: float


# A command that should answer at once: cancel, claim, progress, stats, a pushed bundle.
SHORT = Timeouts(connect_s=5, read_s=5)


def blocking_read(block_s: float) -> Timeouts:
    """For a BLPOP of block_s: the socket waits the block time plus the SHORT allowance."""
    return Timeouts(connect_s=SHORT.connect_s, read_s=block_s + 10)


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis | RedisCluster:
    """The process's shared synchronous client (thread-safe, pooled), SHORT timeouts."""
    return sync_client(counters_url(), socket_timeout=SHORT.read_s, socket_connect_timeout=SHORT.connect_s)


def async_client(timeouts: Timeouts = SHORT) -> aioredis.Redis | AsyncRedisCluster:
    """A new asyncio client: each event loop needs its own; the caller closes it (aclose)."""
    return any_async_client(counters_url(), socket_timeout=timeouts.read_s, socket_connect_timeout=timeouts.connect_s)
