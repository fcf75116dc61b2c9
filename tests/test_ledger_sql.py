"""budgets/ledger_sql.py prepares each value as the field's own get_db_prep_save would (the column
then holds what Model.save() writes), with the common cases written out for speed."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import connection

from budgets import ledger_sql
from budgets.models import TokenLog

VALUES = [
    {"status": "ok", "prompt_tokens": 5, "completion_tokens": 0, "cached_tokens": 0, "cost_micro_usd": 10**12,
     "finish_reason": "", "error": "x" * 500, "ttft_ms": None, "total_ms": 12,
     "finished_at": datetime(2026, 12, 6, 9, 0, tzinfo=UTC)},
    {"counters_settled": True, "admitted": False, "reserved_tokens": 20, "reserved_cost_micro_usd": 0},
    {"id": 7, "request_id": "a-request", "counter_keys": ["ceiling:c:user:1:all:day:20261206"], "tags": ""},
    {"counter_keys": [], "tags": None, "finish_reason": None, "ttft_ms": Decimal("3")},
]


@pytest.mark.django_db
@pytest.mark.parametrize("values", VALUES)
def test_update_values_are_prepared_as_the_fields_prepare_them(values):
    connection.ensure_connection()
    field = TokenLog._meta.get_field
    expected = [field(name).get_db_prep_save(value, connection) for name, value in values.items()]

    prepared = ledger_sql._params(values, connection)

    assert [(type(v), repr(v)) for v in prepared] == [(type(v), repr(v)) for v in expected]


@pytest.mark.django_db(transaction=True)
def test_statements_reach_execute_wrappers_and_raise_djangos_errors(alice, chat_feature):
    from django.db import IntegrityError
    from django.utils import timezone

    row = TokenLog(request_id="ledger-sql-once", user=alice, feature=chat_feature, model="m", prompt_tokens=1,
                   max_tokens=1, counter_keys=[], created_at=timezone.now())
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql.split()[0])
        return execute(sql, params, many, context)

    ledger_sql.insert(row)  # the connection's prepared cursor, no wrapper installed
    with connection.execute_wrapper(wrapper):
        assert ledger_sql.update({"status": "ok"}, {"id": row.pk}) == 1
    assert seen == ["UPDATE"]

    again = TokenLog(request_id="ledger-sql-once", user=alice, feature=chat_feature, model="m", prompt_tokens=1,
                     max_tokens=1, counter_keys=[], created_at=timezone.now())
    with pytest.raises(IntegrityError):  # Django's, which the guard reads as a duplicate request id
        ledger_sql.insert(again)
    assert ledger_sql.update({"status": "failed"}, {"id": row.pk}) == 1  # the cursor still serves


@pytest.mark.django_db(transaction=True)
def test_new_row_is_the_row_the_model_builds(alice, chat_feature):
    from django.db.models.signals import post_init, pre_init
    from django.utils import timezone

    values = {"request_id": "new-row", "user": alice, "feature": chat_feature, "provider": chat_feature.provider,
              "price": None, "team": None, "model": "m", "status": TokenLog.Status.RUNNING, "prompt_tokens": 3,
              "admitted": True, "counter_keys": ["k"], "created_at": timezone.now()}
    # new_row skips Model.__init__, so nothing may listen to it
    assert not pre_init.has_listeners(TokenLog) and not post_init.has_listeners(TokenLog)

    fast, built = ledger_sql.new_row(values), TokenLog(**values)

    assert {k: v for k, v in vars(fast).items() if k != "_state"} == {k: v for k, v in vars(built).items() if k != "_state"}
    assert fast._state.fields_cache == built._state.fields_cache
    assert (fast._state.adding, fast._state.db) == (True, None)
    assert ledger_sql.new_row({})
    assert ledger_sql.new_row({}).counter_keys is not ledger_sql.new_row({}).counter_keys  # a fresh default list
    ledger_sql.insert(fast)
    assert TokenLog.objects.get(pk=fast.pk).feature == chat_feature


@pytest.mark.django_db(transaction=True)
def test_insert_many_writes_each_row_as_insert_does_and_gives_each_its_own_id(alice, chat_feature):
    from django.utils import timezone

    def row(request_id, **values):
        return ledger_sql.new_row({"request_id": request_id, "user": alice, "feature": chat_feature, "model": "m",
                                   "status": TokenLog.Status.RUNNING, "counter_keys": ["k", request_id],
                                   "created_at": timezone.now(), **values})

    alone = row("alone", tags=",a,", prompt_tokens=7, ttft_ms=None)
    ledger_sql.insert(alone)
    together = [row(f"together-{i}", tags=",a,", prompt_tokens=7 + i, ttft_ms=i or None) for i in range(3)]

    ledger_sql.insert_many(together)

    stored = {r.request_id: r for r in TokenLog.objects.filter(request_id__startswith="together-")}
    assert {r.request_id: r.pk for r in together} == {rid: r.pk for rid, r in stored.items()}
    columns = [f.attname for f in TokenLog._meta.concrete_fields if f.attname not in ("id", "request_id")]
    first = stored["together-0"]
    assert {c: getattr(first, c) for c in columns if c not in ("created_at", "counter_keys")} == {
        c: getattr(TokenLog.objects.get(pk=alone.pk), c) for c in columns if c not in ("created_at", "counter_keys")}
    assert [stored[f"together-{i}"].counter_keys for i in range(3)] == [["k", f"together-{i}"] for i in range(3)]
    assert [stored[f"together-{i}"].ttft_ms for i in range(3)] == [None, 1, 2]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("worker_has_the_row", [True, False])
def test_the_finished_row_returned_is_the_row_in_the_database(alice, chat_feature, worker_has_the_row):
    """With the row the worker holds, do_record_usage writes the usage over its copy instead of
    reading the row back: every column must be what a read returns, types included."""
    from django.utils import timezone

    from budgets.actions import Usage, do_record_usage

    admitted = ledger_sql.new_row({"request_id": "finished", "user": alice, "feature": chat_feature, "model": "m",
                                   "status": TokenLog.Status.RUNNING, "counter_keys": ["k"], "admitted": True,
                                   "prompt_tokens": 5, "created_at": timezone.now()})
    ledger_sql.insert(admitted)

    row = do_record_usage("finished", status=TokenLog.Status.OK, usage=Usage(5, 7), finish_reason="stop", ttft_ms=12,
                          admitted=admitted if worker_has_the_row else None)

    stored = TokenLog.objects.get(pk=admitted.pk)
    columns = [f.attname for f in TokenLog._meta.concrete_fields]
    assert [(c, getattr(row, c), type(getattr(row, c))) for c in columns] == [
        (c, getattr(stored, c), type(getattr(stored, c))) for c in columns]
    assert (row._state.adding, row._state.db) == (False, "default")
    assert admitted.status == TokenLog.Status.RUNNING  # the caller's copy is left as it was
    assert do_record_usage("finished", status=TokenLog.Status.OK, usage=Usage(5, 7), admitted=admitted) is None


@pytest.mark.django_db(transaction=True)
def test_statements_survive_the_session_losing_its_prepared_statements(alice, chat_feature):
    """psycopg sends DEALLOCATE ALL after a rollback, which takes the ledger's statements too: the
    next one is prepared again, and runs once."""
    from django.db import transaction
    from django.utils import timezone

    row = ledger_sql.new_row({"request_id": "deallocated", "user": alice, "feature": chat_feature, "model": "m",
                              "status": TokenLog.Status.RUNNING, "counter_keys": [], "created_at": timezone.now()})
    ledger_sql.insert(row)
    assert ledger_sql.update({"prompt_tokens": 1}, {"id": row.pk}) == 1
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")

    assert ledger_sql.update({"prompt_tokens": 2}, {"id": row.pk}) == 1

    with pytest.raises(RuntimeError), transaction.atomic():  # a rollback: psycopg deallocates everything
        ledger_sql.update({"prompt_tokens": 99}, {"id": row.pk})
        raise RuntimeError
    assert ledger_sql.update_returning({"prompt_tokens": 3}, {"id": row.pk}).prompt_tokens == 3
    assert TokenLog.objects.get(pk=row.pk).prompt_tokens == 3
