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
