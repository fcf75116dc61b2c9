"""The base of every management command that needs the database.

A checkout that ran `make install` but not `make run` has an empty database; a command run there
would die deep inside with "no such table: auth_user". `DatabaseCommand` looks first and says what
to do in one sentence, exit status 2 (bad usage), no traceback.

Here in accounts, the bottom app, so that budgets' and inference's commands can all use it.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor

NOT_READY_EXIT_STATUS = 2


def not_ready(message: str) -> CommandError:
    # A plain CommandError: Django prints its class name in front, and "CommandError:" reads right.
    return CommandError(message, returncode=NOT_READY_EXIT_STATUS)


def database_location(alias: str = DEFAULT_DB_ALIAS) -> str:
    """Where the database is, as a person would look for it: the SQLite file, or host/name."""
    config = connections[alias].settings_dict
    if config["ENGINE"].endswith("sqlite3"):
        return str(config["NAME"])
    host = config.get("HOST") or "localhost"
    port = f":{config['PORT']}" if config.get("PORT") else ""
    return f"{host}{port}/{config['NAME']}"


def unapplied_migrations(alias: str = DEFAULT_DB_ALIAS) -> list[str] | None:
    """The migrations not applied yet ("app.name"), or None when the database has no tables at all."""
    connection = connections[alias]
    if "django_migrations" not in connection.introspection.table_names():
        return None
    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _ in plan]


def require_migrated_database(alias: str = DEFAULT_DB_ALIAS) -> None:
    where = database_location(alias)
    try:
        missing = unapplied_migrations(alias)
    except DatabaseError as exc:
        # A server that is down or refuses us: the driver's first line says why.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise not_ready(f"cannot reach the database at {where} ({reason}).") from None
    if missing is None:
        raise not_ready(f"the database at {where} has no tables: run `make run` once, or `manage.py migrate`.")
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise not_ready(
            f"the database at {where} is not migrated ({len(missing)} migration{'s' if len(missing) != 1 else ''} "
            f"to apply: {shown}): run `manage.py migrate`."
        )


class DatabaseCommand(BaseCommand):
    """A command that reads or writes the database: refuses in one sentence when it is not migrated."""

    def needs_database(self, options: dict) -> bool:
        """Whether this run opens the database; a command with runs that do not says so here."""
        return True

    def execute(self, *args, **options):
        if self.needs_database(options):
            require_migrated_database()
        return super().execute(*args, **options)
