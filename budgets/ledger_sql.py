"""The ledger's statements on the guard's hot path, with their SQL built once per process.

Every admission inserts a TokenLog row and marks it admitted; every finished request writes its
usage and reads the row back for the dashboard event and the settle. Through the ORM each of those
statements is compiled again on every call, and that compilation, not the database, was most of an
admit+settle cycle's CPU (docs/benchmarks.md). Here the SQL text is made once from the model's
fields; each value still goes through its field's own get_db_prep_save, so a column holds exactly
what Model.save() would have written, on PostgreSQL and on SQLite (≥ 3.35, for RETURNING) alike.

On PostgreSQL they also run as prepared statements (parameters bound by the server, each statement
parsed and planned once per connection), which took ~40% off PostgreSQL's CPU for a cycle; the
rest of Django keeps its client-side binding, which some ORM queries need. They run with Django's
error translation and broken-transaction check but without its cursor wrapper (~20 µs a
statement): in autocommit mode (an admission's INSERT, a finish's UPDATE) straight over libpq
through psycopg's own dumpers and loaders (_LeanCursor), inside a transaction on one prepared
psycopg cursor per connection; installed execute wrappers still see them (then through the
wrapper), and while queries are logged they go through Django's ordinary cursor.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping
from enum import Enum
from functools import lru_cache
from operator import attrgetter

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, CharField, Field, JSONField, TextField
from django.db.models.base import ModelState

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import generators as pg_generators
    from psycopg._encodings import conn_encoding
    from psycopg._queries import PostgresQuery
    from psycopg.adapt import PyFormat, Transformer
    from psycopg.pq import ExecStatus
except ImportError:  # SQLite only
    psycopg = None

from .models import TokenLog


def _db() -> BaseDatabaseWrapper:
    """This thread's connection itself: every attribute read through django.db.connection, a proxy
    to a thread-local, costs a lookup, and preparing one row's values reads ~50."""
    return connections[DEFAULT_DB_ALIAS]


@lru_cache(maxsize=4)
def _insert_sql(vendor: str) -> tuple[str, tuple[tuple[Field, Callable, Callable], ...]]:
    """The INSERT, and per column its field, how to read the value (pre_save) and how to prepare it."""
    meta = TokenLog._meta
    fields = tuple(f for f in meta.concrete_fields if not f.primary_key)
    quote = _db().ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    values = ", ".join(["%s"] * len(fields))
    plan = tuple((f, _reader(f), _preparer(f, vendor)) for f in fields)
    return (f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({values}) RETURNING {quote(meta.pk.column)}",
            plan)


def _reader(field: Field) -> Callable:
    if type(field).pre_save is Field.pre_save:  # no auto_now, no upload: the attribute as it is
        return attrgetter(field.attname)
    return lambda row: field.pre_save(row, True)


def _preparer(field: Field, vendor: str) -> Callable:
    """field.get_db_prep_save, with the answer it would give written out for the values a new row
    holds most (text, integers, None): ~40 columns a row, each through several layers otherwise."""
    prepare = field.get_db_prep_save
    if isinstance(field, JSONField):
        return prepare  # None, a list, a str: each means something else as JSON
    if isinstance(field, (CharField, TextField)):
        return lambda value, db: value if value is None or type(value) is str else prepare(value, db)
    if isinstance(field, BooleanField):
        return lambda value, db: value if value is None or type(value) is bool else prepare(value, db)
    int_type = getattr(_db().ops, "integerfield_type_map", {}).get(field.get_internal_type()) if vendor == "postgresql" else None
    if int_type is not None:  # psycopg's Int4/Int8, as the backend's adapt_integerfield_value wraps them
        return lambda value, db: None if value is None else int_type(value) if type(value) is int else prepare(value, db)
    return lambda value, db: None if value is None else prepare(value, db)


@lru_cache(maxsize=1)
def _new_row_plan() -> tuple[dict[str, object], tuple[tuple[str, Callable], ...], dict[str, tuple[str, str]]]:
    """What TokenLog(**values) starts every row from: (attname → its constant default, (attname,
    default factory) for callable defaults, foreign key name → (its attname, the target's attname))."""
    constants: dict[str, object] = {}
    factories = []
    relations = {}
    for field in TokenLog._meta.concrete_fields:
        if field.is_relation:
            relations[field.name] = (field.attname, field.target_field.attname)
            constants[field.attname] = None
        elif field.has_default() and callable(field.default):
            factories.append((field.attname, field.default))
        else:
            constants[field.attname] = field.get_default()
    return constants, tuple(factories), relations


def new_row(values: Mapping[str, object]) -> TokenLog:
    """TokenLog(**values), without Model.__init__: a new row's ~40 fields each went through their
    descriptor and default there, ~8% of an admission's CPU. `values` name fields (foreign keys by
    name, with an instance or None); the rest take their defaults, and each related instance is
    cached on the row as the ORM caches it (row.feature reads no row). TokenLog has no init signals."""
    constants, factories, relations = _new_row_plan()
    row = TokenLog.__new__(TokenLog)
    state = row._state = ModelState()
    attributes = row.__dict__
    attributes.update(constants)
    for attname, factory in factories:
        attributes[attname] = factory()
    cached = state.fields_cache
    for name, value in values.items():
        relation = relations.get(name)
        if relation is None:
            attributes[name] = value
        else:
            attributes[relation[0]] = None if value is None else getattr(value, relation[1])
            cached[name] = value
    return row


def insert(row: TokenLog) -> None:
    """INSERT the new row and set its primary key, as row.save(force_insert=True) does (no signals:
    nothing listens to TokenLog's)."""
    db = _db()
    sql, plan = _insert_sql(db.vendor)
    params = [prepare(read(row), db) for _, read, prepare in plan]
    with _cursor(db) as cursor:
        cursor.execute(sql, params)
        row.pk = cursor.fetchone()[0]
    row._state.adding = False
    row._state.db = db.alias


@lru_cache(maxsize=4)
def _insert_many_sql(vendor: str) -> str:
    """One INSERT of any number of rows, whose shape never changes (so it is prepared once): every
    column one array parameter, unnested. The request ids come back with the ids, so each row finds
    its own id whatever order PostgreSQL returns them in."""
    meta = TokenLog._meta
    db = _db()
    quote = db.ops.quote_name
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    columns = ", ".join(quote(f.column) for f in fields)
    arrays = ", ".join(f"%s::{f.db_type(db)}[]" for f in fields)
    request_id = quote(meta.get_field("request_id").column)
    return (f"INSERT INTO {quote(meta.db_table)} ({columns}) SELECT * FROM unnest({arrays}) "
            f"RETURNING {request_id}, {quote(meta.pk.column)}")


def insert_many(rows: list[TokenLog]) -> None:
    """insert() for many new rows in one statement (PostgreSQL): the ledger writer's batches."""
    db = _db()
    _, plan = _insert_sql(db.vendor)
    columns = [[prepare(read(row), db) for row in rows] for _, read, prepare in plan]
    with _cursor(db) as cursor:
        cursor.execute(_insert_many_sql(db.vendor), columns)
        ids = dict(cursor.fetchall())
    for row in rows:
        row.pk = ids[row.request_id]
        row._state.adding = False
        row._state.db = db.alias


@lru_cache(maxsize=32)
def _update_sql(vendor: str, names: tuple[str, ...], where: tuple[str, ...], returning: bool) -> str:
    meta = TokenLog._meta
    quote = _db().ops.quote_name
    sets = ", ".join(f"{quote(meta.get_field(name).column)} = %s" for name in names)
    conditions = " AND ".join(f"{quote(meta.get_field(name).column)} = %s" for name in where)
    sql = f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {conditions}"
    if returning:
        sql += " RETURNING " + ", ".join(quote(f.column) for f in meta.concrete_fields)
    return sql


def _params(values: Mapping[str, object], db: BaseDatabaseWrapper) -> list:
    prepares = _preparers(db.vendor, tuple(values))
    return [prepare(value, db) for prepare, value in zip(prepares, values.values(), strict=True)]


@lru_cache(maxsize=64)
def _preparers(vendor: str, names: tuple[str, ...]) -> tuple[Callable, ...]:
    """Each named field's _preparer, found once per statement shape rather than per value."""
    field = TokenLog._meta.get_field
    return tuple(_preparer(field(name), vendor) for name in names)


def update(values: Mapping[str, object], where: Mapping[str, object]) -> int:
    """UPDATE … SET values WHERE every `where` field equals its value; the rows it changed."""
    db = _db()
    sql = _update_sql(db.vendor, tuple(values), tuple(where), False)
    with _cursor(db) as cursor:
        cursor.execute(sql, _params(values, db) + _params(where, db))
        return cursor.rowcount


def update_returning(values: Mapping[str, object], where: Mapping[str, object]) -> TokenLog | None:
    """update() of one row by a unique key, and that row as it now is (None when nothing matched):
    one statement where filter().update() and a get() are two, each compiled by the ORM."""
    db = _db()
    sql = _update_sql(db.vendor, tuple(values), tuple(where), True)
    with _cursor(db) as cursor:
        cursor.execute(sql, _params(values, db) + _params(where, db))
        found = cursor.fetchone()
    return _from_db(found, db) if found is not None else None


def updated_copy(row: TokenLog, values: Mapping[str, object]) -> TokenLog:
    """A copy of `row` with `values` (attribute names: no related instances) as an UPDATE of them
    leaves it in the database, without reading it back: for a caller that holds the row as it
    was just before. Choices are stored as their plain values, as a read would return them."""
    copy = TokenLog.__new__(TokenLog)
    copy.__dict__.update(row.__dict__)
    copy._state = ModelState()
    copy._state.adding, copy._state.db = False, row._state.db
    for name, value in values.items():
        copy.__dict__[name] = value.value if isinstance(value, Enum) else value
    return copy


@lru_cache(maxsize=4)
def _mark_settled_sql(vendor: str) -> str:
    meta = TokenLog._meta
    quote = _db().ops.quote_name
    column = quote(meta.get_field("counters_settled").column)
    return (f"UPDATE {quote(meta.db_table)} SET {column} = true "
            f"WHERE {quote(meta.pk.column)} = ANY(%s) AND NOT {column}")


def mark_settled(row_ids: list[int]) -> int:
    """counters_settled on every row of row_ids, in one statement (PostgreSQL: an array parameter)."""
    db = _db()
    with _cursor(db) as cursor:
        cursor.execute(_mark_settled_sql(db.vendor), [list(row_ids)])
        return cursor.rowcount


@lru_cache(maxsize=4)
def _select_sql(vendor: str, names: tuple[str, ...], key: str) -> str:
    meta = TokenLog._meta
    quote = _db().ops.quote_name
    columns = ", ".join(quote(meta.get_field(name).column) for name in names)
    return f"SELECT {columns} FROM {quote(meta.db_table)} WHERE {quote(meta.get_field(key).column)} = %s"


def select(names: tuple[str, ...], key: str, value: object) -> tuple | None:
    """Some fields of the row whose unique `key` is `value`, converted as the ORM would."""
    db = _db()
    with _cursor(db) as cursor:
        cursor.execute(_select_sql(db.vendor, names, key), [value])
        found = cursor.fetchone()
    if found is None:
        return None
    plan = _converters(db.vendor)[2]
    return tuple(_convert(v, *plan[name], db) if name in plan else v for name, v in zip(names, found, strict=True))


@lru_cache(maxsize=4)
def _converters(vendor: str) -> tuple[tuple[str, ...], tuple, dict[str, tuple]]:
    """The attribute names of a full row, and for the columns that need them their conversions
    from the database, as the ORM's compiler applies them: the backend's first (SQLite's dates and
    booleans), then the field's own (the JSON column). (names, [(index, column, converters)], by name)"""
    fields = TokenLog._meta.concrete_fields
    plan = []
    for i, field in enumerate(fields):
        column = field.get_col(TokenLog._meta.db_table)
        db = _db()
        found = tuple(db.ops.get_db_converters(column)) + tuple(field.get_db_converters(db))
        if found:
            plan.append((i, column, found))
    by_name = {fields[i].name: (column, found) for i, column, found in plan}
    by_name |= {fields[i].attname: (column, found) for i, column, found in plan}
    return tuple(f.attname for f in fields), tuple(plan), by_name


def _convert(value: object, column, converters: tuple, db: BaseDatabaseWrapper) -> object:
    for convert in converters:
        value = convert(value, column, db)
    return value


def _from_db(values: tuple, db: BaseDatabaseWrapper) -> TokenLog:
    """A model instance from a full row, as the ORM would build it."""
    names, plan, _ = _converters(db.vendor)
    values = list(values)
    for i, column, converters in plan:
        values[i] = _convert(values[i], column, converters, db)
    return TokenLog.from_db(db.alias, names, values)


# A threshold no statement reaches: the ORM's own statements stay unprepared (its client-side
# cursor never prepares anyway), only those executed with prepare=True are.
ONLY_WHEN_ASKED = 2**31 - 1

if psycopg is not None:
    class _PreparedCursor(psycopg.Cursor):
        """Server-side binding, prepared on first use (psycopg keeps them per connection)."""

        def execute(self, query, params=None, *, prepare=None, binary=None):
            return super().execute(query, params, prepare=True if prepare is None else prepare, binary=binary)


def _cursor(db: BaseDatabaseWrapper):
    # While queries are logged (DEBUG, a test counting them) the ordinary cursor: its log shows each
    # statement with its values, which a prepared one's does not. With execute wrappers installed,
    # Django's cursor wrapper, which calls them.
    if db.vendor != "postgresql" or psycopg is None or db.queries_logged:
        return db.cursor()
    if db.execute_wrappers:
        return db.make_cursor(_prepared_cursor(db))
    return _LedgerCursor(db)


# The prepared cursor of each open psycopg connection, reused statement after statement (one
# connection serves one thread at a time): a new cursor and Django's wrapper around it cost
# ~30 µs a statement, a third of the client's CPU for one.
_cursors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepared_cursor(db: BaseDatabaseWrapper):
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    cursor = _cursors.get(raw)
    if cursor is None or cursor.closed:
        with db.wrap_database_errors:
            if raw.prepare_threshold is None:  # Django's default: psycopg prepares nothing
                raw.prepare_threshold = ONLY_WHEN_ASKED
            cursor = _cursors[raw] = _PreparedCursor(raw)
    return cursor


class _LedgerCursor:
    """`with _LedgerCursor(db) as cursor`: the connection's prepared cursor, with what Django's
    cursor wrapper would check first (a broken transaction) and its errors as Django's."""

    __slots__ = ("db",)

    def __init__(self, db: BaseDatabaseWrapper) -> None:
        self.db = db

    def __enter__(self):
        cursor = _prepared_cursor(self.db)
        if cursor.connection.autocommit:  # no transaction to open first: the lean path can send it
            cursor = _lean_cursor(cursor.connection)
        self.db.validate_no_broken_transaction()
        self.db.wrap_database_errors.__enter__()
        return cursor

    def __exit__(self, kind, error, trace) -> None:
        # DatabaseErrorWrapper raises psycopg's error as the matching django.db one (IntegrityError…).
        self.db.wrap_database_errors.__exit__(kind, error, trace)


# --- straight over libpq, in autocommit mode ------------------------------------------------------

class _LeanCursor:
    """What the ledger's statements use of a cursor (execute, fetchone, fetchall, rowcount), sent
    straight to libpq as psycopg's cursor would send them: the values through psycopg's own
    dumpers and the results through its loaders, each statement prepared once per connection and
    parameter types, but without the cursor's per-statement machinery (its prepared-statement
    bookkeeping, query conversion, result sets): 78 → 32 µs of client CPU a statement.

    Only in autocommit mode (what an admission and a finish outside a transaction run in): inside
    a transaction psycopg's cursor also sends the BEGIN, so the prepared cursor serves there.
    """

    def __init__(self, raw) -> None:
        self.raw = raw
        self.transformer = Transformer(raw)
        self.names: dict[tuple[str, tuple], bytes] = {}  # (sql, parameter types) → prepared statement
        self.numbers = itertools.count()  # a name is never used twice on a connection
        self.queries: dict[str, bytes] = {}  # sql with %s → with $1…
        self.rows: list[tuple] = []
        self.rowcount = -1

    def execute(self, sql: str, params: list) -> None:
        transformer = self.transformer
        query = self.queries.get(sql)
        if query is None:
            converted = PostgresQuery(transformer)
            converted.convert(sql, params)
            query = self.queries[sql] = converted.query
        values = transformer.dump_sequence(params, [PyFormat.AUTO] * len(params))
        key = (sql, transformer.types)
        with self.raw.lock:
            try:
                result = self._run_prepared(key, query, values)
            except pg_errors.InvalidSqlStatementName:
                # psycopg deallocates every statement of the session after a rollback (DEALLOCATE
                # ALL), ours included; nothing ran: prepare it again and send it again, once.
                self.names.clear()
                result = self._run_prepared(key, query, values)
        transformer.set_pgresult(result)
        self.rows = [transformer.load_row(i, tuple) for i in range(result.ntuples)]
        self.rowcount = result.command_tuples if result.command_tuples is not None else -1

    def _run_prepared(self, key: tuple[str, tuple], query: bytes, values):
        name = self.names.get(key)
        if name is None:
            name = f"ceiling_ledger_{next(self.numbers)}".encode()
            self.raw.pgconn.send_prepare(name, query, param_types=key[1])
            self._result()
            self.names[key] = name
        self.raw.pgconn.send_query_prepared(name, values, param_formats=self.transformer.formats)
        return self._result()

    def _result(self):
        """The statement's result; its error raised as psycopg's cursor raises it."""
        result = self.raw.wait(pg_generators.execute(self.raw.pgconn))[-1]
        if result.status == ExecStatus.FATAL_ERROR:
            raise pg_errors.error_from_result(result, encoding=conn_encoding(self.raw))
        return result

    def fetchone(self) -> tuple | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[tuple]:
        return self.rows


_lean_cursors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lean_cursor(raw) -> _LeanCursor:
    cursor = _lean_cursors.get(raw)
    if cursor is None:
        cursor = _lean_cursors[raw] = _LeanCursor(raw)
    return cursor
