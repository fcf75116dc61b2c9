"""PostgreSQL: TokenLog's trigram index on tags holds only the rows that carry tags.

Every row had an entry (an "empty item" for the untagged), so every admission's INSERT and every
finish's UPDATE (not a HOT update: it changes `status`) appended one to the index's pending list
and rewrote its metapage: ~170 bytes of WAL each, ~13% of a request's WAL after 0019
(docs/benchmarks.md, "Fifth pass"). Most requests carry no tags. The queries for a tag's rows say
`tags > ''` beside their LIKE (budgets.tags.tag_filter), which lets the planner use this partial
index. Built CONCURRENTLY under a new name, then the old one dropped and the new one renamed, so
the index keeps its name (bench_tag_index reads it) and a large ledger keeps taking writes.
"""

from django.db import migrations

INDEX = "tokenlog_tags_trgm_idx"
NEW = f"{INDEX}_new"


def _swap(schema_editor, where: str) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'")
        if cursor.fetchone() is None:  # 0018 could not create it: no index to narrow
            return
        cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {NEW}")
        cursor.execute(f"CREATE INDEX CONCURRENTLY {NEW} ON budgets_tokenlog USING gin (tags gin_trgm_ops){where}")
        cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
        cursor.execute(f"ALTER INDEX {NEW} RENAME TO {INDEX}")


def only_tagged_rows(apps, schema_editor) -> None:
    _swap(schema_editor, " WHERE tags > ''")


def every_row(apps, schema_editor) -> None:
    _swap(schema_editor, "")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("budgets", "0019_tokenlog_lean_indexes"),
    ]

    operations = [migrations.RunPython(only_tagged_rows, every_row)]
