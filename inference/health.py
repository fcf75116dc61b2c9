"""GET /healthz and GET /readyz, for load balancers and orchestrators (docs/scaling.md).

    /healthz   the process answers: 200 {"status": "ok"}, touching nothing else (a liveness probe:
               restart the process when it fails)
    /readyz    this web process can serve a chat: the database, Redis (the broker's and the
               counters', when they differ) and, for every weight variant in use, a live worker
               that serves its queue; 200 when all are, else 503, each check with its state (a
               readiness probe: send no traffic here while it fails)

Both are unauthenticated (a probe has no key) and say nothing secret: no URL, host name, worker id
or credential, only each check's state, its time and the error's kind (a sentence of ours for a
worker; the exception's class for the database and Redis, whose messages name hosts). They are cheap: one
`SELECT 1` and one query for the variants in use, a PING per Redis and two reads per variant, each
with a short timeout, so a dead dependency answers 503 in about a second rather than hanging the probe.

A worker is live while its heartbeat key exists (inference/bus/stats.py: rewritten every 0.5 s,
expiring STATS_TTL_S after the process stops); the variant's serving mark (inference/variants.py)
names the last worker that said it reads the variant's queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache

import redis
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache

from budgets.redis_clients import counters_url, sync_client

from . import variants
from .bus.stats import STATS_KEY_PREFIX

PROBE_TIMEOUT_S = 1.0


@never_cache
async def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@never_cache
async def readyz(request: HttpRequest) -> JsonResponse:
    checks = await database_sync_to_async(readiness, thread_sensitive=False)()
    ready = all(check["ok"] for check in _flat(checks))
    return JsonResponse({"status": "ready" if ready else "not_ready", "checks": checks}, status=200 if ready else 503)


def readiness() -> dict:
    """Every check by name; `workers` holds one check per weight variant in use."""
    database = _timed(_check_database)
    broker = _timed(lambda: _probe_client(settings.REDIS_URL).ping())
    checks: dict = {"database": database, "redis": broker}
    if counters_url() != settings.REDIS_URL:
        checks["counters_redis"] = _timed(lambda: _probe_client(counters_url()).ping())
    in_use = _variants_in_use() if database["ok"] else [variants.default_variant()]
    checks["workers"] = {variant: _timed(lambda v=variant: _check_variant(v)) for variant in in_use}
    return checks


def _flat(checks: dict) -> list[dict]:
    return [check for name, check in checks.items() if name != "workers"] + list(checks["workers"].values())


def _timed(check: Callable[[], object]) -> dict:
    """{"ok", "ms"} and, on failure, "error": what went wrong, without a host name."""
    started = time.perf_counter()
    try:
        detail = check()
    except NotReady as exc:
        return {"ok": False, "ms": _ms_since(started), "error": str(exc)}
    except (DatabaseError, redis.RedisError) as exc:
        return {"ok": False, "ms": _ms_since(started), "error": type(exc).__name__}
    result = {"ok": True, "ms": _ms_since(started)}
    if isinstance(detail, dict):
        result |= detail
    return result


class NotReady(Exception):
    """A check that reached its dependency and found it not ready."""


def _check_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _variants_in_use() -> list[str]:
    try:
        return variants.variants_in_use()
    except DatabaseError:
        return [variants.default_variant()]


def _check_variant(variant: str) -> dict:
    """The queue of this variant when a live worker serves it, else NotReady."""
    client = _probe_client(counters_url())
    queue = variants.variant_queue(variant)
    worker = client.get(variants.SERVING_KEY.format(queue))
    if worker is None:
        raise NotReady(f"no worker serves the queue {queue}")
    if not client.exists(STATS_KEY_PREFIX + worker.decode()):
        raise NotReady(f"the worker that served the queue {queue} stopped its heartbeat")
    return {"queue": queue}


@lru_cache(maxsize=8)
def _probe_client(url: str) -> redis.Redis:
    # Its own short timeouts: a probe must answer before the balancer's own timeout, and must not
    # wait out the 5 s the bus allows a command.
    return sync_client(url, no_retries=True, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)
