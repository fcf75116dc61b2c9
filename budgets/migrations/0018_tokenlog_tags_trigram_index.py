"""PostgreSQL: a trigram (GIN) index on TokenLog.tags.

A tag's rows this month (`tags LIKE '%,support,%'`: rebuilding a tag's counter after a Redis flush,
the tags page, the tag forecast) were found by reading every row of the month; with this index they
are found through it. The queries do not change: pg_trgm's index answers LIKE with a leading %.

Built CONCURRENTLY (this migration is not atomic), so a large ledger keeps taking writes meanwhile.
pg_trgm ships with PostgreSQL and is a trusted extension (PG 13+): a database owner may create it.
Where it cannot be created, the migration says so and goes on without the index (the queries are
correct either way, only slower). SQLite, the embedded default, keeps the scan.
"""

import logging

from django.db import migrations

log = logging.getLogger(__name__)

INDEX = "tokenlog_tags_trgm_idx"


def create_index(apps, schema_editor) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        try:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        except Exception as exc:  # noqa: BLE001 - no privilege: the index is an optimisation, not a must
            log.warning("pg_trgm could not be created (%s); TokenLog.tags stays unindexed", exc)
            return
        cursor.execute(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} ON budgets_tokenlog USING gin (tags gin_trgm_ops)"
        )


def drop_index(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("budgets", "0017_team_alert_channels"),
    ]

    operations = [migrations.RunPython(create_index, drop_index)]
