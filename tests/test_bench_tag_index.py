"""`manage.py bench_tag_index` and the trigram index it measures (migration 0018), on PostgreSQL.

The run inserts its rows inside a transaction it rolls back: the ledger is left exactly as it was.
"""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from budgets.management.commands.bench_tag_index import INDEX
from budgets.models import TokenLog

pytestmark = pytest.mark.django_db(transaction=True)


def index_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [INDEX])
        row = cursor.fetchone()
    return row is not None and "gin_trgm_ops" in row[0]


def test_the_migration_indexes_the_tags_with_trigrams():
    assert connection.vendor == "postgresql"
    assert index_exists()


def test_the_bench_times_a_tag_rebuild_with_and_without_the_index_and_leaves_the_ledger_alone(tmp_path, capsys):
    out = tmp_path / "tag_index.json"

    call_command("bench_tag_index", rows=20_000, tagged_every=200, repeat=2, json=out)

    result = json.loads(out.read_text())
    assert (result["rows"], result["tagged_rows"], result["repeat"]) == (20_000, 100, 2)
    assert result["with_index_ms"] > 0 and result["without_index_ms"] > 0
    assert INDEX in result["plan_with_index"] and INDEX not in result["plan_without_index"]
    printed = capsys.readouterr().out
    assert "faster with the index" in printed and f"wrote {out}" in printed
    assert not TokenLog.objects.exists() and index_exists()  # rolled back; the index came back


def test_the_bench_refuses_bad_numbers_and_a_missing_index():
    with pytest.raises(CommandError, match="at least 1"):
        call_command("bench_tag_index", rows=0)
    with connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX {INDEX}")
    try:
        with pytest.raises(CommandError, match="missing: run `manage.py migrate`"):
            call_command("bench_tag_index", rows=10)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE INDEX {INDEX} ON budgets_tokenlog USING gin (tags gin_trgm_ops)")
    assert index_exists()
