"""TokenLog's indexes trimmed for gateway rates (issue #23), and room left on its pages for HOT updates.

Every admission inserts a ledger row and every index of TokenLog gets an entry for it; a finish's
UPDATE, which changes `status` (indexed), writes a new entry in every index again. Measured on the
ledger's own statements (docs/benchmarks.md, "Fifth pass"): 20 indexes, ~37 index entries and
~4.4 kB of WAL a request. This migration removes what no query needs:

* the single-column indexes Django made for the foreign keys user, feature, provider, team and
  api_key: each is the first column of a (column, created_at) index, which serves the same
  lookups (a user's rows, SET_NULL and PROTECT on delete);
* the `request_id` `varchar_pattern_ops` index (`…_like`) Django adds beside a unique varchar on
  PostgreSQL: only LIKE / startswith uses it, and only the dev tools (synth_logs, seed_demo) filter
  request ids that way; every request id lookup is an equality, served by the unique index;

and indexes team, api_key and requested_feature only where set (most rows leave them empty, and a
query for a team's, key's or fallback's rows implies the column is not null). The new partial
indexes are built CONCURRENTLY on PostgreSQL before the old ones are dropped, so a large ledger
keeps taking writes meanwhile (this migration is therefore not atomic).

Finally TokenLog's pages are filled to 80% on PostgreSQL (fillfactor; new pages only): the
`counters_settled` mark, which changes no indexed column, then finds room on the row's page and
is a HOT update (no index entry at all) instead of a new entry in every index.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

TABLE = "budgets_tokenlog"
FILLFACTOR = 80

NEW_INDEXES = [
    models.Index(fields=["team", "created_at"], condition=models.Q(team__isnull=False), name="tokenlog_team_set_idx"),
    models.Index(
        fields=["api_key", "created_at"], condition=models.Q(api_key__isnull=False), name="tokenlog_api_key_set_idx"
    ),
    models.Index(
        fields=["requested_feature"], condition=models.Q(requested_feature__isnull=False),
        name="tokenlog_requested_feature_idx",
    ),
]


def create_partial_indexes(apps, schema_editor) -> None:
    model = apps.get_model("budgets", "TokenLog")
    for index in NEW_INDEXES:
        if schema_editor.connection.vendor == "postgresql":
            sql = str(index.create_sql(model, schema_editor, concurrently=True))
            schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
        else:
            schema_editor.add_index(model, index)


def drop_partial_indexes(apps, schema_editor) -> None:
    model = apps.get_model("budgets", "TokenLog")
    for index in NEW_INDEXES:
        schema_editor.remove_index(model, index)


def _like_index(schema_editor) -> str:
    # The name Django gave it (schema_editor._create_like_index_sql), the same in every database.
    return schema_editor._create_index_name(TABLE, ["request_id"], suffix="_like")


def drop_like_index(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(_like_index(schema_editor))}")


def create_like_index(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        name = schema_editor.quote_name(_like_index(schema_editor))
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} (request_id varchar_pattern_ops)")


def set_fillfactor(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {TABLE} SET (fillfactor = {FILLFACTOR})")


def reset_fillfactor(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {TABLE} RESET (fillfactor)")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("accounts", "0002_api_key_caps"),
        ("budgets", "0018_tokenlog_tags_trigram_index"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="tokenlog", index=index) for index in NEW_INDEXES],
            database_operations=[migrations.RunPython(create_partial_indexes, drop_partial_indexes)],
        ),
        migrations.RemoveIndex(model_name="tokenlog", name="tokenlog_team_idx"),
        migrations.RemoveIndex(model_name="tokenlog", name="tokenlog_api_key_idx"),
        migrations.AlterField(
            model_name="tokenlog",
            name="api_key",
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="token_logs", to="accounts.apikey"),
        ),
        migrations.AlterField(
            model_name="tokenlog",
            name="feature",
            field=models.ForeignKey(db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="token_logs", to="budgets.feature"),
        ),
        migrations.AlterField(
            model_name="tokenlog",
            name="provider",
            field=models.ForeignKey(db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="token_logs", to="budgets.provider"),
        ),
        migrations.AlterField(
            model_name="tokenlog",
            name="requested_feature",
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="fallback_token_logs", to="budgets.feature"),
        ),
        migrations.AlterField(
            model_name="tokenlog",
            name="team",
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="token_logs", to="budgets.team"),
        ),
        migrations.AlterField(
            model_name="tokenlog",
            name="user",
            field=models.ForeignKey(db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="token_logs", to=settings.AUTH_USER_MODEL),
        ),
        migrations.RunPython(drop_like_index, create_like_index),
        migrations.RunPython(set_fillfactor, reset_fillfactor),
    ]
