"""Settings helpers fail loudly on nonsense instead of starting with a surprising value."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from project.settings import (
    celery_url_from_redis_url,
    check_redis_url,
    database_from_url,
    envbool,
    envfloat,
    envint,
    envlist,
)


def test_booleans_accept_the_usual_spellings(monkeypatch):
    for raw, expected in [("1", True), ("true", True), ("Yes", True), ("off", False), ("0", False), ("", True)]:
        monkeypatch.setenv("CEILING_FLAG", raw)
        assert envbool("CEILING_FLAG", True) is expected


def test_a_nonsense_boolean_is_refused(monkeypatch):
    monkeypatch.setenv("CEILING_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="CEILING_FLAG='maybe' is not a boolean"):
        envbool("CEILING_FLAG", False)


def test_integers_are_parsed_and_bounded(monkeypatch):
    monkeypatch.setenv("CEILING_N", "12")
    assert envint("CEILING_N", 1, minimum=1) == 12
    monkeypatch.setenv("CEILING_N", "twelve")
    with pytest.raises(ImproperlyConfigured, match="not an integer"):
        envint("CEILING_N", 1)
    monkeypatch.setenv("CEILING_N", "0")
    with pytest.raises(ImproperlyConfigured, match="below the minimum of 1"):
        envint("CEILING_N", 1, minimum=1)


def test_floats_and_lists(monkeypatch):
    monkeypatch.setenv("CEILING_X", "2.5")
    assert envfloat("CEILING_X", 1.0) == 2.5
    monkeypatch.setenv("CEILING_X", "fast")
    with pytest.raises(ImproperlyConfigured, match="not a number"):
        envfloat("CEILING_X", 1.0)
    monkeypatch.setenv("CEILING_HOSTS", " a.example, b.example ,,")
    assert envlist("CEILING_HOSTS", []) == ["a.example", "b.example"]


def test_database_urls():
    pg = database_from_url("postgres://ceiling:s%40cret@db.internal:6543/ceiling")
    assert pg["ENGINE"] == "django.db.backends.postgresql"
    assert (pg["NAME"], pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"]) == ("ceiling", "ceiling", "s@cret", "db.internal", "6543")
    sqlite = database_from_url("sqlite:////tmp/ceiling.sqlite3")
    assert sqlite["NAME"] == "/tmp/ceiling.sqlite3"
    with pytest.raises(ImproperlyConfigured, match="unsupported scheme 'mysql'"):
        database_from_url("mysql://root@localhost/ceiling")
    with pytest.raises(ImproperlyConfigured, match="names no database"):
        database_from_url("postgres://localhost")


def test_redis_urls():
    assert check_redis_url("redis://127.0.0.1:6379/0")
    assert celery_url_from_redis_url("unix:///srv/var/redis.sock") == "redis+socket:///srv/var/redis.sock"
    assert celery_url_from_redis_url("redis://h:6379/1") == "redis://h:6379/1"
    with pytest.raises(ImproperlyConfigured, match="must start with redis://"):
        check_redis_url("http://127.0.0.1:6379")


def test_timeouts_must_nest():
    """engine deadline < Celery soft limit < hard limit < what the consumer waits: else start-up fails."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", "import project.settings"],
        env={"CEILING_ENGINE_DEADLINE_S": "400", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode != 0 and "Timeouts must nest" in result.stderr


def _import_settings(**env: str):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run(
        [sys.executable, "-c", "import project.settings"],
        env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_it_refuses_to_start_with_a_reservation_ttl_shorter_than_a_request_may_run():
    """Reconciliation fails requests running past the TTL: shorter than the total timeout, it failed
    (and released the reservation of) requests that were still generating."""
    result = _import_settings(CEILING_RESERVATION_TTL_S="200")  # the total timeout is 300 s
    assert result.returncode != 0
    assert "CEILING_RESERVATION_TTL_S=200 must be above CEILING_TOTAL_TIMEOUT_S (300 s)" in result.stderr
    assert _import_settings(CEILING_RESERVATION_TTL_S="301").returncode == 0


def test_sqlite_gets_wal_a_busy_timeout_and_immediate_transactions(tmp_path, django_db_blocker):
    """`make run`'s SQLite is shared by daphne and a 32-thread worker: WAL, a busy timeout, BEGIN IMMEDIATE."""
    from django.db.utils import ConnectionHandler

    config = database_from_url(f"sqlite:///{tmp_path / 'ceiling.sqlite3'}")
    assert config["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    connection = ConnectionHandler({"default": config})["default"]
    impatient = {**config["OPTIONS"], "timeout": 0.1, "init_command": "PRAGMA busy_timeout=100;"}
    other = ConnectionHandler({"default": {**config, "OPTIONS": impatient}})["default"]
    with django_db_blocker.unblock():  # a file of its own, not the test database
        _check_sqlite(connection, other)


def _check_sqlite(connection, other) -> None:
    from django.db import OperationalError

    try:
        with connection.cursor() as cursor:
            assert cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert cursor.execute("PRAGMA busy_timeout").fetchone()[0] == 20_000
            assert cursor.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        # What transaction.atomic() runs first: BEGIN IMMEDIATE takes the write lock at once, so a
        # second writer waits (here 0.1 s, then fails) at its BEGIN, never halfway through its work.
        connection._start_transaction_under_autocommit()
        other.ensure_connection()
        with pytest.raises(OperationalError, match="database is locked"):
            other._start_transaction_under_autocommit()
        connection.rollback()
    finally:
        connection.close()
        other.close()
