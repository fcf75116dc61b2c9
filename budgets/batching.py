"""A per-process batch that a thread of its own sends every few milliseconds while it holds anything.

For work that may lag its cause by a few tens of milliseconds and costs far less done for many at
once than one at a time: the settled rows' announcement (budgets/live.py), the `counters_settled`
marks (budgets/guard.py). Callers add and return at once; the thread sleeps on an event while the
process is idle. Forked children start empty (the parent sends what it held), and a process that
exits normally sends what is left (atexit; a forked child that skips atexit calls flush()).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


class Batch(Generic[Item]):
    def __init__(self, name: str, send: Callable[[list[Item]], None], every_s: float, max_items: int,
                 on_thread_start: Callable[[], None] | None = None, on_idle: Callable[[], None] | None = None,
                 idle_s: float = 1.0) -> None:
        self.name = name
        self.send = send  # called with up to max_items at a time; what it raises is logged
        self.every_s = every_s
        self.max_items = max_items
        self.on_thread_start = on_thread_start
        self.on_idle = on_idle  # in the thread, once nothing came for idle_s (hand a connection back)
        self.idle_s = idle_s
        self.forget()
        os.register_at_fork(after_in_child=self.forget)
        atexit.register(self.flush)

    def forget(self) -> None:
        """Empty, with no thread (a forked child: the parent's items and thread are not its own)."""
        self._lock = threading.Lock()
        self._items: list[Item] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, item: Item) -> None:
        with self._lock:
            self._items.append(item)
            first = len(self._items) == 1
        if first:  # the thread took everything before: wake it (later items ride along)
            self._ensure_thread()
            self._wake.set()

    def flush(self) -> None:
        """Send everything held, now, in this thread."""
        while True:
            with self._lock:
                taken, self._items = self._items[: self.max_items], self._items[self.max_items :]
            if not taken:
                return
            try:
                self.send(taken)
            except Exception:  # noqa: BLE001 - one failed send must not stop the next
                log.exception("%s: sending %d item(s) failed", self.name, len(taken))

    def _call(self, hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the thread must outlive a failing hook
            log.exception("%s: %s failed", self.name, getattr(hook, "__qualname__", hook))

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        idle = False
        while True:
            if not self._wake.wait(None if idle or self.on_idle is None else self.idle_s):
                self._call(self.on_idle)
                idle = True
                continue
            idle = False
            time.sleep(self.every_s)  # what is added meanwhile shares this send
            # Cleared before taking: an item added after this sets it again and gets a send of its own.
            self._wake.clear()
            self.flush()
