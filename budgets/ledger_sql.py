"""The ledger's statements on the guard's hot path, with their SQL built once per process.

Every admission inserts a TokenLog row and marks it admitted; every finished request writes its
usage and reads the row back for the dashboard event and the settle. Through the ORM each of those
statements is compiled again on every call, and that compilation, not the database, was most of an
admit+settle cycle's CPU (docs/benchmarks.md). Here the SQL text is made once from the model's
fields; each value still goes through its field's own get_db_prep_save, so a column holds exactly
what Model.save() would have written, on PostgreSQL and on SQLite (≥ 3.35, for RETURNING) alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from django.db import connection
from django.db.models import Field

from .models import TokenLog


@lru_cache(maxsize=4)
def _insert_sql(vendor: str) -> tuple[str, tuple[Field, ...]]:
    meta = TokenLog._meta
    fields = tuple(f for f in meta.concrete_fields if not f.primary_key)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    values = ", ".join(["%s"] * len(fields))
    return (f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({values}) RETURNING {quote(meta.pk.column)}",
            fields)


def insert(row: TokenLog) -> None:
    """INSERT the new row and set its primary key, as row.save(force_insert=True) does (no signals:
    nothing listens to TokenLog's)."""
    sql, fields = _insert_sql(connection.vendor)
    params = [f.get_db_prep_save(f.pre_save(row, True), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row.pk = cursor.fetchone()[0]
    row._state.adding = False
    row._state.db = connection.alias


@lru_cache(maxsize=32)
def _update_sql(vendor: str, names: tuple[str, ...], where: tuple[str, ...], returning: bool) -> str:
    meta = TokenLog._meta
    quote = connection.ops.quote_name
    sets = ", ".join(f"{quote(meta.get_field(name).column)} = %s" for name in names)
    conditions = " AND ".join(f"{quote(meta.get_field(name).column)} = %s" for name in where)
    sql = f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {conditions}"
    if returning:
        sql += " RETURNING " + ", ".join(quote(f.column) for f in meta.concrete_fields)
    return sql


def _params(values: Mapping[str, object]) -> list:
    meta = TokenLog._meta
    return [meta.get_field(name).get_db_prep_save(value, connection) for name, value in values.items()]


def update(values: Mapping[str, object], where: Mapping[str, object]) -> int:
    """UPDATE … SET values WHERE every `where` field equals its value; the rows it changed."""
    sql = _update_sql(connection.vendor, tuple(values), tuple(where), False)
    with connection.cursor() as cursor:
        cursor.execute(sql, _params(values) + _params(where))
        return cursor.rowcount


def update_returning(values: Mapping[str, object], where: Mapping[str, object]) -> TokenLog | None:
    """update() of one row by a unique key, and that row as it now is (None when nothing matched):
    one statement where filter().update() and a get() are two, each compiled by the ORM."""
    sql = _update_sql(connection.vendor, tuple(values), tuple(where), True)
    rows = list(TokenLog.objects.raw(sql, _params(values) + _params(where)))
    return rows[0] if rows else None
