"""Redis clients for a URL that names one Redis or a Redis Cluster (Valkey speaks the same protocol).

    redis://host:6379/0              one server (also rediss://, unix://)
    redis+cluster://host:7000/0      a cluster, found from this one node (also rediss+cluster://)

The guard's counters, the answer caches and the stream inboxes use CEILING_COUNTERS_URL, which may
name a cluster; Celery's broker and the channel layer stay on REDIS_URL, one server (docs/scaling.md).
URLs are checked in project/settings.py; only counters_url() reads Django's settings.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlparse(url).scheme in CLUSTER_SCHEMES


def counters_url() -> str:
    """CEILING_COUNTERS_URL, else REDIS_URL; read at each call, so a test that points REDIS_URL
    elsewhere moves the counters, caches and inboxes with it."""
    # Imported here: the rest of this module (which counters.py uses) knows nothing about Django.
    from django.conf import settings

    return settings.CEILING_COUNTERS_URL or settings.REDIS_URL


def cache_url() -> str:
    """CEILING_CACHE_URL, else the counters' Redis: the answer and retrieval caches, whose keys all
    expire, can live on a Redis of their own (any eviction policy) so they never crowd the counters."""
    from django.conf import settings

    return settings.CEILING_CACHE_URL or counters_url()


def _single_node_url(url: str) -> str:
    """redis+cluster://… → redis://…: the node redis-py asks for the cluster's layout."""
    scheme, rest = url.split("://", 1)
    return f"{CLUSTER_SCHEMES[scheme]}://{rest}"


class ClusterClient(RedisCluster):
    """RedisCluster whose failures are all RedisErrors, as one server's are: every caller that
    fails closed, or treats a cache as optional, on RedisError then does so on a cluster too."""

    def execute_command(self, *args, **kwargs):
        with cluster_errors_as_redis_errors():
            return super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def execute_with_redis_errors(*args, **kwargs):
            with cluster_errors_as_redis_errors():
                return execute(*args, **kwargs)

        pipe.execute = execute_with_redis_errors
        return pipe


class AsyncClusterClient(AsyncRedisCluster):
    """The asyncio twin of ClusterClient."""

    async def execute_command(self, *args, **kwargs):
        with cluster_errors_as_redis_errors():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def execute_with_redis_errors(*args, **kwargs):
            with cluster_errors_as_redis_errors():
                return await execute(*args, **kwargs)

        pipe.execute = execute_with_redis_errors
        return pipe


def sync_client(url: str, *, no_retries: bool = False, **options) -> redis.Redis | RedisCluster:
    """A pooled, thread-safe client; options are redis-py's (socket_timeout, …).

    no_retries: a failed command fails at once, which the guard needs to fail closed quickly (a
    cluster client otherwise retries a dead node's commands ten times)."""
    if is_cluster_url(url):
        if no_retries:
            options["retry"] = Retry(NoBackoff(), 0)
        with cluster_errors_as_redis_errors():
            return ClusterClient.from_url(_single_node_url(url), **options)  # reads the layout now
    if no_retries:
        options |= {"retry": None, "retry_on_timeout": False}
    return redis.Redis.from_url(url, **options)


@lru_cache(maxsize=16)
def shared_client(url: str, timeout_s: float) -> redis.Redis | RedisCluster:
    """One pooled client per URL and timeout for the process: a cluster client reads the cluster's
    layout when it is built, too slow to build for each command."""
    return sync_client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def async_client(url: str, **options) -> aioredis.Redis | AsyncRedisCluster:
    """A new asyncio client for the running event loop; the caller closes it (aclose)."""
    if is_cluster_url(url):
        return AsyncClusterClient.from_url(_single_node_url(url), **options)
    return aioredis.Redis.from_url(url, **options)


def node_client(client: redis.Redis | RedisCluster, key: str) -> redis.Redis:
    """The plain client of the server that holds `key`: commands sent through one of its pipelines
    share one connection, which WAIT needs (it waits for the writes of its own connection)."""
    if isinstance(client, RedisCluster):
        return client.get_node_from_key(key).redis_connection
    return client


def refresh_layout(client: redis.Redis | RedisCluster) -> None:
    """After a MOVED reply or a dead node: read which node holds which slot again, if a node answers
    (if none does, the next call fails and tries again)."""
    if isinstance(client, RedisCluster):
        try:
            client.nodes_manager.initialize()
        except (RedisClusterException, redis.RedisError):
            pass


@contextmanager
def cluster_errors_as_redis_errors():
    """redis-py raises RedisClusterException, which is no RedisError, when no node of a cluster
    answers or a slot has no master: callers that fail closed on RedisError see it as one."""
    try:
        yield
    except RedisClusterException as exc:
        raise redis.ConnectionError(str(exc)) from exc
