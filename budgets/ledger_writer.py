"""Group commit for the guard's ledger writes: many admissions' rows in one transaction.

Every admission writes its TokenLog row before its Redis reservation, and marks it admitted after;
alone, each is a statement and a commit of its own. Here one thread per process takes what every
admission thread has queued and writes it together: the new rows in one multi-row INSERT, the
`admitted` marks in one UPDATE, in one transaction, one commit. The caller waits for the commit
that holds its write (group commit, what databases do with their own log), so the guarantees stay
those of one row at a time: the row is in the ledger before the Redis call, and marked admitted
before admit() returns, before any token can leave.

No batch waits for company: while one commits, the next gathers, so an idle process pays one
thread hop and a busy one shares each commit among everyone who arrived during the last.

Writes whose loss reconciliation repairs (`counters_settled`, retried by budgets/reconcile.py)
are queued without waiting.

Only outside a transaction and on PostgreSQL (CEILING_LEDGER_GROUP_COMMIT): a caller inside its
own transaction must see its row there, and SQLite takes one writer at a time anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, IntegrityError, connection, connections, transaction
from django.db.utils import load_backend

from . import ledger_sql
from .models import TokenLog

log = logging.getLogger(__name__)

MAX_BATCH = 500
IDLE_CLOSE_S = 1.0  # the writer keeps its connection while busy and hands it back after this long idle
WAIT_S = 10.0  # a caller gives up on a writer that does not answer (the database is away)
ADMITTED_FIELDS = ("admitted", "max_tokens", "reserved_tokens", "reserved_cost_micro_usd")


@dataclass
class _Write:
    kind: str  # insert | admitted | settled | barrier (writes nothing: drain() waits for it)
    row: TokenLog | None = None
    row_id: int | None = None
    done: threading.Event | None = None
    error: BaseException | None = field(default=None)


class LedgerWriter:
    def __init__(self, max_batch: int = MAX_BATCH) -> None:
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._pending = 0  # submitted and not yet committed
        self._active = 0  # admissions' ledger writes under way (counted())
        self.batches = 0
        self.writes = 0

    # --- what callers use ---------------------------------------------------------------------

    def insert(self, row: TokenLog) -> None:
        """INSERT `row` (its pk is set) and return once committed; raises what the INSERT raised."""
        self._wait(_Write("insert", row=row, done=threading.Event()))

    def mark_admitted(self, row: TokenLog) -> None:
        """UPDATE the row's ADMITTED_FIELDS from `row` and return once committed."""
        self._wait(_Write("admitted", row=row, done=threading.Event()))

    def mark_settled_later(self, row_id: int) -> None:
        """counters_settled=True, without waiting: if lost, reconciliation settles again (a no-op)."""
        self._submit(_Write("settled", row_id=row_id))

    def drain(self) -> None:
        """Return once everything queued before this call is committed (a process about to exit)."""
        if self._thread is not None and self._thread.is_alive():
            self._wait(_Write("barrier", done=threading.Event()))

    # --- the writer thread --------------------------------------------------------------------

    def _wait(self, write: _Write) -> None:
        self._submit(write)
        if not write.done.wait(WAIT_S):
            raise DatabaseError(f"the ledger writer did not commit within {WAIT_S:g} s")
        if write.error is not None:
            raise write.error

    def _submit(self, write: _Write) -> None:
        self._ensure_started()
        with self._count_lock:
            self._pending += 1
        self._queue.put(write)

    def _ensure_started(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
                self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether another ledger write of this process is in flight (through the writer or not):
        then a new one is better off sharing a commit."""
        return self._pending > 0 or self._active > 0

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Around every admission's ledger write, direct or not, so that `busy` sees it."""
        with self._count_lock:
            self._active += 1
        try:
            yield
        finally:
            with self._count_lock:
                self._active -= 1

    def _run(self) -> None:
        use_own_connection()
        while True:
            try:
                first = self._queue.get(timeout=IDLE_CLOSE_S)
            except queue.Empty:
                # Idle: hand the connection back (to the pool, by default), as a request's end does.
                connection.close()
                continue
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._flush(batch)

    def _flush(self, batch: list[_Write]) -> None:
        try:
            try:
                with transaction.atomic():
                    _write_together(batch)
            except IntegrityError:
                # One bad row (a duplicate request id) must not fail the others: one at a time.
                for write in batch:
                    try:
                        with transaction.atomic():
                            _write_together([write])
                    except DatabaseError as exc:
                        write.error = exc
        except Exception as exc:  # noqa: BLE001 - every waiter must hear of it; the thread lives on
            log.warning("ledger writer: a batch of %d failed: %s", len(batch), exc)
            for write in batch:
                write.error = write.error or exc
            connection.close()
        self.batches += 1
        self.writes += len(batch)
        for write in batch:
            if write.kind == "settled" and write.error is not None:
                log.warning("counters_settled not written for row %s (reconciliation retries): %s",
                            write.row_id, write.error)
            if write.done is not None:
                write.done.set()
        with self._count_lock:
            self._pending -= len(batch)


def _write_together(batch: list[_Write]) -> None:
    inserts = [w.row for w in batch if w.kind == "insert"]
    if inserts:
        ledger_sql.insert_many(inserts)  # one prepared INSERT … RETURNING: every row gets its pk
    admitted = [w.row for w in batch if w.kind == "admitted"]
    if admitted:
        TokenLog.objects.bulk_update(admitted, ADMITTED_FIELDS)
    settled = [w.row_id for w in batch if w.kind == "settled"]
    if settled:
        ledger_sql.mark_settled(settled)


def use_own_connection() -> None:
    """Give this thread (the writer's, budgets.guard's settled marks') a connection of its own,
    outside the pool and kept open.

    From the pool it could deadlock: admissions hold pooled connections while they wait for the
    writer, and with the pool exhausted the writer would wait for one of theirs (tests with 48
    threads did, until the pool's timeout).
    """
    params = {**connections.settings[DEFAULT_DB_ALIAS]}
    params["OPTIONS"] = {k: v for k, v in params.get("OPTIONS", {}).items() if k != "pool"}
    params["CONN_MAX_AGE"] = None  # closed on an error, or after IDLE_CLOSE_S idle
    params["CONN_HEALTH_CHECKS"] = False
    connections[DEFAULT_DB_ALIAS] = load_backend(params["ENGINE"]).DatabaseWrapper(params, DEFAULT_DB_ALIAS)


writer = LedgerWriter()


def group_commit_applies() -> bool:
    """Whether this thread's ledger write goes through the writer (see the module's docstring).

    Only while another ledger write of this process is under way: a write that would commit alone
    gains nothing from the thread hop, which cost ~2.5 ms a cycle in `bench_guard` from one thread
    (docs/benchmarks.md). Under load writes overlap, and they gather behind the writer's commit.
    """
    return (
        settings.CEILING_LEDGER_GROUP_COMMIT
        and connection.vendor == "postgresql"
        and not connection.in_atomic_block
        and writer.busy
    )
