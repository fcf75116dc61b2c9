"""Per-process cache of the reference rows every admission reads: quotas, teams and their caps, tag
caps, prices, providers.

Admissions read the same few rows thousands of times a second, and staff change them a few times a
day. Each process keeps what it read, tagged with a version per table kept in Redis:

* every write sets its table's version to a new random token: post_save / post_delete (save(), the admin, fixtures,
  cascades), ReferenceQuerySet's update / bulk_create / bulk_update / delete (the bulk paths,
  which send no signals) and post_migrate (migrations, raw data changes shipped with them);
* an admission hands the versions it computed its ceilings under to its own Lua call
  (`versions_to_check()`), which decides nothing when one moved and answers with the current
  ones: the admission reads the rows again and retries, so the check and the decision are one
  atomic step and cost no round trip of their own; `refresh()` reads every version in one MGET
  for lookups outside admissions; either way a newer version makes older entries stale, and an
  entry remembers the version it was read under, so a read that raced a write is never kept
  under the newer version.

A bump is sent at once and again after the writer's transaction commits: a process that reloads
between the two would otherwise cache the rows as they were before the commit under the new
version. MAX_AGE_S bounds what a lost bump (a writer killed between its commit and its bump, a
Redis blip, a hand-written SQL UPDATE) can leave stale.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import redis
from django.db import transaction

from .counter_store import counter_store

log = logging.getLogger(__name__)

# The tables an admission reads, by the name their version has in Redis.
TABLES = ("quota", "team", "teammembership", "teamquota", "tagquota", "modelprice", "provider", "feature")
# Under the counter store's prefix: "ceiling" on one Redis, the hash tag "{ceiling}" on a Redis
# Cluster, so the one MGET finds every version in the counters' one slot.
VERSION_KEY = "{prefix}:refcache:v:{table}"
MAX_ENTRIES = 10_000  # per namespace: one entry per user is the largest, and old ones go first
MAX_AGE_S = 60.0
# A lookup outside an admission (a rate-limit header, a page) refreshes first when the last
# refresh is older than this, so no caller sees a write later than that.
REFRESH_LAG_S = 1.0

_MISSING = object()


class RefCache:
    """Namespaced lookups, each depending on some of TABLES; thread-safe."""

    def __init__(self, client: Callable[[], redis.Redis], prefix: Callable[[], str] = lambda: "ceiling",
                 max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S) -> None:
        self.client = client
        self.prefix = prefix
        self.max_entries = max_entries
        self._refreshed_at = -1e9
        self._redis_down = False
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._versions: dict[str, bytes | None] = {}
        self._entries: dict[str, OrderedDict] = {}
        self._depends_on: dict[str, tuple[str, ...]] = {}
        self._bypass = threading.local()  # set while Redis cannot tell us the versions
        self._version_keys: dict[str, tuple[str, ...]] = {}  # by prefix
        self.hits = 0
        self.misses = 0

    def refresh(self) -> None:
        """Read every table's version (one MGET); entries read under an older one are not used again."""
        try:
            versions = self.client().mget([version_key(t, self.prefix()) for t in TABLES])
        except redis.RedisError as exc:
            # Without versions the cache cannot be trusted: read the database until Redis answers.
            if not self._redis_down:  # once per outage, not once per admission
                log.warning("reference cache bypassed: Redis did not answer (%s)", exc)
            self._redis_down = True
            self._bypass.on = True
            return
        self._redis_down = False
        self._bypass.on = False
        with self._lock:
            self._versions = dict(zip(TABLES, versions, strict=True))
            self._refreshed_at = time.monotonic()

    def versions_to_check(self) -> tuple[tuple[str, str], ...] | None:
        """(version key, the value this process last read there, "" for none) of every table, for an
        admission to check in its own Lua call (CounterStore.admit's versions): the check and the
        decision are one atomic step, and the MGET of refresh() is not needed before it. None while
        the cache is bypassed (every lookup reads the database then)."""
        if getattr(self._bypass, "on", False):
            return None
        try:
            prefix = self.prefix()  # the counter store's: making its client may find no cluster node
        except redis.RedisError:
            return None  # the admission's own call fails the same way, and refuses
        keys = self._version_keys.get(prefix)
        if keys is None:
            keys = self._version_keys[prefix] = tuple(version_key(t, prefix) for t in TABLES)
        with self._lock:
            values = [self._versions.get(t) for t in TABLES]
        return tuple((key, value.decode() if value else "") for key, value in zip(keys, values, strict=True))

    def install(self, values: tuple[str, ...]) -> None:
        """The versions an admission found in Redis, in TABLES order: as refresh() would have read them."""
        with self._lock:
            self._versions = {t: value.encode() if value else None for t, value in zip(TABLES, values, strict=True)}
            self._refreshed_at = time.monotonic()

    def confirm(self) -> None:
        """An admission found every version as this process holds it: as good as a refresh."""
        self._refreshed_at = time.monotonic()

    def get(self, namespace: str, depends_on: tuple[str, ...], key: Hashable, load: Callable[[], Any]) -> Any:
        if time.monotonic() - self._refreshed_at > REFRESH_LAG_S:
            self.refresh()
        if getattr(self._bypass, "on", False):
            return load()
        tag = self._tag(depends_on)
        with self._lock:
            entries = self._entries.setdefault(namespace, OrderedDict())
            self._depends_on[namespace] = depends_on
            found = entries.get(key, _MISSING)
            if found is not _MISSING:
                entry_tag, loaded_at, value = found
                if entry_tag == tag and time.monotonic() - loaded_at < self.max_age_s:
                    entries.move_to_end(key)
                    self.hits += 1
                    return value
        self.misses += 1
        value = load()  # outside the lock
        with self._lock:
            entries[key] = (tag, time.monotonic(), value)
            entries.move_to_end(key)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)
        return value

    def forget(self, table: str) -> None:
        """This process wrote `table`: its own next read must not wait for the next refresh."""
        with self._lock:
            self._versions[table] = b"local:" + str(time.monotonic_ns()).encode()
            # Also drop the entries: should the bump not reach Redis, the next refresh would bring
            # back the old version, and with it the entries read before this write.
            for namespace, depends_on in self._depends_on.items():
                if table in depends_on:
                    self._entries.get(namespace, OrderedDict()).clear()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._versions.clear()

    def _tag(self, depends_on: tuple[str, ...]) -> tuple:
        with self._lock:
            return tuple(self._versions.get(t) for t in depends_on)


def _client() -> redis.Redis:
    return counter_store().client


def _prefix() -> str:
    return counter_store().prefix


def version_key(table: str, prefix: str | None = None) -> str:
    return VERSION_KEY.format(prefix=prefix or _prefix(), table=table)


cache = RefCache(_client, _prefix)


def refresh() -> None:
    """Once per admission, before its lookups."""
    cache.refresh()


def changed(table: str) -> None:
    """A write to `table`: tell every process now, and again once the writer's transaction commits."""
    cache.forget(table)
    _bump(table)
    transaction.on_commit(lambda: _bump(table), robust=True)


_announcing = threading.Event()  # set while Redis takes the bumps: a failure is then news worth a warning
_announcing.set()


def _bump(table: str) -> None:
    try:
        # A fresh random token, not INCR: a Redis that restarts empty would count again from 1
        # and hand out versions that entries already carry.
        _client().set(version_key(table), uuid.uuid4().hex)
    except redis.RedisError as exc:
        # Once per outage, not once per table and write: `make run` migrates and seeds before its Redis
        # starts, and said so 95 times on a new machine.
        report = log.warning if _announcing.is_set() else log.debug
        _announcing.clear()
        report("could not tell other processes that %s changed (they see it within %g s; further failures are "
               "logged at debug level until Redis answers again): %s", table, MAX_AGE_S, exc)
    else:
        if not _announcing.is_set():
            _announcing.set()
            log.info("Redis answers again: changes to the reference tables are announced at once")
    cache.forget(table)


def changed_everything(**_: object) -> None:
    """After migrations (and `flush`): they may have changed any table with SQL that sends no
    signals. They run outside any transaction of ours, so the bump needs no second send."""
    for table in TABLES:
        _bump(table)


def on_row_written(sender, **_: object) -> None:
    changed(sender._meta.model_name)


def connect(models: list[type]) -> None:
    from django.db.models.signals import post_delete, post_migrate, post_save

    for model in models:
        uid = f"budgets.refcache.{model._meta.model_name}"
        post_save.connect(on_row_written, sender=model, dispatch_uid=uid + ".save")
        post_delete.connect(on_row_written, sender=model, dispatch_uid=uid + ".delete")
    post_migrate.connect(changed_everything, dispatch_uid="budgets.refcache.migrate")
