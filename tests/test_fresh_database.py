"""A fresh checkout's database: `migrate` and `check` on the default SQLite say nothing to worry
about, `Quota`'s one-row-per-scope holds there too, and a command run before `migrate` says so in
one sentence (exit status 2) instead of a traceback."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import get_commands, load_command_class
from django.db import IntegrityError, transaction

from accounts.management.database import DatabaseCommand
from budgets.models import Period, Quota

BASE_DIR = Path(settings.BASE_DIR)
NOT_MIGRATED = "has no tables: run `make run` once, or `manage.py migrate`."
# The commands that never open the database: runstack starts processes (`make run` migrates
# before it), bench_prefix drives the engine alone.
WITHOUT_DATABASE = {"runstack", "bench_prefix", "bench_positions"}
OUR_APPS = ("accounts", "budgets", "inference", "control")


def manage(database_url: str, *args: str) -> subprocess.CompletedProcess:
    # CEILING_DB_POOL off: a pool would wait its whole timeout for a server that is not there.
    env = {**os.environ, "DATABASE_URL": database_url, "CEILING_DB_POOL": "false"}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=180
    )


@pytest.fixture(scope="module")
def migrated_sqlite(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    path = tmp_path_factory.mktemp("fresh") / "ceiling.sqlite3"
    return path, manage(f"sqlite:///{path}", "migrate", "--noinput")


def test_migrate_on_a_fresh_sqlite_file_prints_no_warning(migrated_sqlite):
    _, result = migrated_sqlite
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Applying budgets.0001_initial... OK" in output
    assert "WARNING" not in output.upper() and "W047" not in output, output


def test_check_on_the_migrated_sqlite_file_finds_no_issue(migrated_sqlite):
    path, _ = migrated_sqlite
    result = manage(f"sqlite:///{path}", "check", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize(
    "user_id, feature_id",
    [(None, None), (None, "feature"), ("user", None), ("user", "feature")],
    ids=["default", "default-per-feature", "user", "user-per-feature"],
)
def test_sqlite_refuses_a_second_quota_row_for_the_same_scope(migrated_sqlite, user_id, feature_id):
    path, _ = migrated_sqlite
    # sqlite3 leaves foreign keys unchecked by default: ids 1 stand for a user and a feature.
    with sqlite3.connect(path) as db:
        scope = (1 if user_id else None, 1 if feature_id else None)
        insert = "INSERT INTO budgets_quota (user_id, feature_id, period, max_requests) VALUES (?, ?, 'day', ?)"
        db.execute(insert, (*scope, 1))
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            db.execute(insert, (*scope, 2))
        # The same scope for the other period is another row, not a duplicate.
        db.execute(insert.replace("'day'", "'month'"), (*scope, 3))


@pytest.mark.django_db
def test_postgresql_refuses_a_second_quota_row_for_the_same_scope(alice, chat_feature):
    for user, feature in [(None, None), (None, chat_feature), (alice, None), (alice, chat_feature)]:
        Quota.objects.create(user=user, feature=feature, period=Period.DAY, max_requests=1)
        with pytest.raises(IntegrityError), transaction.atomic():
            Quota.objects.create(user=user, feature=feature, period=Period.DAY, max_requests=2)
        Quota.objects.create(user=user, feature=feature, period=Period.MONTH, max_requests=3)
    assert Quota.objects.count() == 8


@pytest.mark.parametrize(
    "args",
    [["bench", "--quick"], ["set_quota", "alice", "--period", "day", "--requests", "5"], ["seed_demo"],
     ["create_api_key", "alice"]],
    ids=lambda args: args[0],
)
def test_a_command_on_an_empty_database_says_to_migrate_and_exits_2(tmp_path, args):
    path = tmp_path / "empty.sqlite3"
    result = manage(f"sqlite:///{path}", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"the database at {path} {NOT_MIGRATED}" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_command_on_a_half_migrated_database_names_what_is_missing(migrated_sqlite, tmp_path):
    path, _ = migrated_sqlite
    half = tmp_path / "half.sqlite3"
    half.write_bytes(path.read_bytes())
    # The newest budgets migration: one behind an older one is not in the plan of an applied leaf.
    latest = sorted(p.stem for p in (BASE_DIR / "budgets" / "migrations").glob("0*.py"))[-1]
    with sqlite3.connect(half) as db:  # as if the checkout was pulled after the last `migrate`
        db.execute("DELETE FROM django_migrations WHERE app = 'budgets' AND name = ?", (latest,))
    result = manage(f"sqlite:///{half}", "set_quota", "alice", "--period", "day", "--requests", "5")
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"the database at {half} is not migrated (1 migration to apply: budgets.{latest}): "
            "run `manage.py migrate`.") in result.stderr
    assert "Traceback" not in result.stderr


def test_a_command_says_when_the_database_server_cannot_be_reached():
    # Port 1 on loopback: nothing listens there, the connection is refused at once.
    result = manage("postgres://postgres@127.0.0.1:1/ceiling", "set_quota", "alice", "--period", "day")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("CommandError: cannot reach the database at 127.0.0.1:1/ceiling (")
    assert "Traceback" not in result.stderr


def test_the_benches_need_the_database_only_for_the_runs_that_write_it(tmp_path):
    path = tmp_path / "empty.sqlite3"
    # --requests 0 stops the run in handle(), past the point where the database check would refuse.
    result = manage(f"sqlite:///{path}", "bench", "--modes", "engine", "--requests", "0")
    assert result.returncode == 1 and result.stderr == "CommandError: --requests must be at least 1\n"
    bench = load_command_class("inference", "bench")
    options = lambda *args: vars(bench.create_parser("manage.py", "bench").parse_args(args))  # noqa: E731
    assert not bench.needs_database(options("--modes", "engine,prefix"))
    assert bench.needs_database(options())  # the default modes include the stack
    guard = load_command_class("budgets", "bench_guard")
    guard_options = lambda *args: vars(guard.create_parser("manage.py", "bench_guard").parse_args(args))  # noqa: E731
    assert not guard.needs_database(guard_options("--level", "counters"))  # Redis alone
    assert guard.needs_database(guard_options())  # the guard level writes ledger rows
    assert not guard.needs_database(guard_options("--n", "0"))  # refused by handle() first


def test_every_command_of_ours_that_opens_the_database_checks_it_first():
    ours = {name: app for name, app in get_commands().items() if app in OUR_APPS}
    assert WITHOUT_DATABASE <= set(ours)
    for name, app in ours.items():
        command = load_command_class(app, name)
        assert isinstance(command, DatabaseCommand) == (name not in WITHOUT_DATABASE), name
