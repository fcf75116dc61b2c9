"""`manage.py bench_tag_index`: what rebuilding one tag's counter from the ledger costs, with the
trigram index on TokenLog.tags (migration 0018) and without it.

Inside one transaction that is rolled back at the end (the ledger is left as it was): ROWS synthetic
settled rows this month, one in --tagged-every carrying the measured tag, 1% look-alike tags
("support-x"), the rest other tags or none; ANALYZE; then the rebuild's own read (budgets.guard.ledger_snapshot on the tag's ledger filter)
REPEAT times with the index, and REPEAT times after DROP INDEX in a savepoint that is rolled back.
The table is vacuumed before and after, so rolled-back rows of this or an earlier run weigh on nothing.
Prints the medians, their ratio and the plans' shapes, and writes them as JSON (--json).

PostgreSQL only: SQLite has no trigram index. The machine is shared, so compare the two figures of
one run (the ratio), not figures of different runs.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from datetime import timedelta
from pathlib import Path

from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from accounts.management.database import DatabaseCommand
from budgets.guard import SETTLED, ledger_snapshot
from budgets.models import Period, TokenLog
from budgets.periods import period_bounds
from budgets.tags import tag_filter, tags_text

INDEX = "tokenlog_tags_trgm_idx"
TAG = "support"
OTHER_TAGS = ["sales", "beta", "mobile", "web", "batch-jobs"]
LOOK_ALIKES = ["support-x", "supports"]  # on 1 row in LOOK_ALIKE_EVERY: found by the index, dropped by its recheck
LOOK_ALIKE_EVERY = 100
BATCH = 5_000


class Rollback(Exception):
    """Raised to leave the benchmark's transaction without keeping anything."""


class Command(DatabaseCommand):
    help = "Time rebuilding a tag's counter from the ledger with and without the trigram index (PostgreSQL)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--rows", type=int, default=200_000, help="synthetic ledger rows this month")
        parser.add_argument("--tagged-every", type=int, default=1_000, help="one row in this many has the tag")
        parser.add_argument("--repeat", type=int, default=7)
        parser.add_argument("--json", type=Path, help="write the results here")

    def handle(self, *args, rows: int, tagged_every: int, repeat: int, json: Path | None, **options) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_tag_index measures a PostgreSQL index; DATABASE_URL points at "
                               f"{connection.vendor}.")
        if rows < 1 or tagged_every < 1 or repeat < 1:
            raise CommandError("--rows, --tagged-every and --repeat are whole numbers of at least 1.")
        if not _index_exists():
            raise CommandError(f"The index {INDEX} is missing: run `manage.py migrate` (and see migration 0018).")
        result: dict = {}
        _vacuum()  # what earlier runs left (their rows were rolled back: dead, still in heap and index)
        try:
            with transaction.atomic():
                _insert_rows(rows, tagged_every)
                with connection.cursor() as cursor:
                    # New entries wait in the GIN index's pending list until (auto)vacuum merges
                    # them; a live ledger's list is mostly merged, so measure it merged.
                    cursor.execute("SELECT gin_clean_pending_list(%s::regclass)", [INDEX])
                    cursor.execute("ANALYZE budgets_tokenlog")
                result = self._measure(rows, tagged_every, repeat)
                raise Rollback
        except Rollback:
            pass
        _vacuum()  # this run's rolled-back rows: leave the ledger's table as lean as it was
        self._report(result, json)

    def _measure(self, rows: int, tagged_every: int, repeat: int) -> dict:
        start, end = period_bounds(Period.MONTH, timezone.now())
        ledger_filter = {**tag_filter(TAG), "created_at__gte": start, "created_at__lt": end}
        with_index = _timed(ledger_filter, repeat)
        plan_with = _plan(ledger_filter)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"DROP INDEX {INDEX}")
            without_index = _timed(ledger_filter, repeat)
            plan_without = _plan(ledger_filter)
            transaction.set_rollback(True)  # the index comes back
        return {
            "rows": rows, "tagged_rows": rows // tagged_every, "repeat": repeat,
            "with_index_ms": with_index, "without_index_ms": without_index,
            "speedup": round(without_index / with_index, 1) if with_index else None,
            "plan_with_index": plan_with, "plan_without_index": plan_without,
        }

    def _report(self, result: dict, path: Path | None) -> None:
        self.stdout.write(
            f"rebuild of one tag's month ({result['tagged_rows']:,} of {result['rows']:,} rows carry it), "
            f"median of {result['repeat']}:\n"
            f"  with {INDEX}:    {result['with_index_ms']:.2f} ms  ({result['plan_with_index']})\n"
            f"  without it:      {result['without_index_ms']:.2f} ms  ({result['plan_without_index']})\n"
            f"  {result['speedup']}x faster with the index (same run, same machine)"
        )
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
            self.stdout.write(f"wrote {path}")


def _vacuum() -> None:
    """VACUUM ANALYZE the ledger table (outside any transaction, as VACUUM must be)."""
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) budgets_tokenlog")


def _index_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_indexes WHERE indexname = %s", [INDEX])
        return cursor.fetchone() is not None


def _insert_rows(rows: int, tagged_every: int) -> None:
    """Settled rows spread over this month so far; every tagged_every-th carries TAG."""
    start, _ = period_bounds(Period.MONTH, timezone.now())
    span = max(1.0, (timezone.now() - start).total_seconds() - 1)
    run = uuid.uuid4().hex[:8]
    for first in range(0, rows, BATCH):
        TokenLog.objects.bulk_create(
            TokenLog(
                request_id=f"bench-tag-{run}-{n}", model="m", status=TokenLog.Status.OK, cost_micro_usd=n % 997,
                prompt_tokens=10, completion_tokens=5, tags=_tags_of(n, tagged_every),
                created_at=start + timedelta(seconds=span * n / rows),
            )
            for n in range(first, min(rows, first + BATCH))
        )


def _tags_of(n: int, tagged_every: int) -> str:
    if n % tagged_every == 0:
        return tags_text([TAG, OTHER_TAGS[n % len(OTHER_TAGS)]])
    if n % LOOK_ALIKE_EVERY == 1:
        return tags_text([LOOK_ALIKES[n % len(LOOK_ALIKES)]])
    if n % 3 == 0:
        return ""
    return tags_text([OTHER_TAGS[n % len(OTHER_TAGS)]])


def _timed(ledger_filter: dict, repeat: int) -> float:
    ledger_snapshot(ledger_filter)  # warm the cache: both sides are measured warm
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        ledger_snapshot(ledger_filter)
        times.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(times), 3)


def _plan(ledger_filter: dict) -> str:
    """The access path of the rebuild's aggregate, in a few words: which scan on which index."""
    plan = TokenLog.objects.filter(SETTLED, **ledger_filter, cache="").explain()  # the settled rows' sum
    lines = [line.strip(" ->") for line in plan.splitlines()]
    scans = [line.split("  (")[0] for line in lines if "Scan" in line]
    return "; ".join(scans)
