"""`manage.py bench_guard`: it reports sane numbers and cleans up after itself (no timing thresholds)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from accounts.models import ApiKey
from budgets import guard
from budgets.models import Feature, ModelPrice, Provider, Quota, TagQuota, Team, TeamQuota, TokenLog

LEVEL_FIELDS = {
    "level", "n", "warmup", "p50_ms", "p99_ms", "mean_ms", "max_ms", "admissions_per_s",
    "p99_target_met", "throughput_target_met", "database",
}
# Only keys the bench can write: real counters, engine stats and channel layers are someone else's.
BENCH_KEY_PATTERNS = ("ceiling:bench:*", "ceiling:c:*", "ceiling:admitted:bench-*", "ceiling:settled:bench-*")


def bench_keys(client) -> set[bytes]:
    return {key for pattern in BENCH_KEY_PATTERNS for key in client.scan_iter(match=pattern)}


def ledger_counts() -> dict[str, int]:
    models = (User, Feature, Provider, ModelPrice, Quota, TokenLog, Team, TeamQuota, ApiKey, TagQuota)
    return {model.__name__: model.objects.count() for model in models}


def test_it_writes_both_levels_as_json_with_positive_ordered_numbers(db, redis_db, tmp_path):
    target = tmp_path / "bench.json"
    out = StringIO()
    call_command("bench_guard", "--n", "200", "--warmup", "20", "--json", str(target), stdout=out)

    report = json.loads(target.read_text())
    assert report["n"] == 200 and report["warmup"] == 20
    assert report["targets"] == {
        "counters": {"p99_ms": 2.0, "admissions_per_s": 3000}, "guard": {"p99_ms": 10.0, "admissions_per_s": 1000},
    }
    assert set(report["levels"]) == {"counters", "guard"}
    for name, numbers in report["levels"].items():
        assert set(numbers) == LEVEL_FIELDS
        assert numbers["level"] == name and numbers["n"] == 200
        assert 0 < numbers["p50_ms"] <= numbers["p99_ms"] <= numbers["max_ms"]
        assert numbers["mean_ms"] > 0 and numbers["admissions_per_s"] > 0
        assert isinstance(numbers["p99_target_met"], bool) and isinstance(numbers["throughput_target_met"], bool)
    assert report["levels"]["counters"]["database"] is None
    assert report["levels"]["guard"]["database"] == connection.vendor

    printed = out.getvalue()
    assert "p99 ≤ 2 ms" in printed and "3,000 admissions/s" in printed
    assert "p99 ≤ 10 ms" in printed and "1,000 admissions/s" in printed
    assert "Redis Lua only" in printed and "writes" in printed


def test_it_leaves_no_rows_users_or_keys_behind(db, redis_db):
    keys, counts = bench_keys(redis_db), ledger_counts()
    call_command("bench_guard", "--n", "30", "--warmup", "5", stdout=StringIO())
    assert bench_keys(redis_db) == keys
    assert ledger_counts() == counts


def test_all_five_scopes_are_admitted_counted_and_cleaned_up(db, redis_db, tmp_path, monkeypatch):
    """--scopes all: a team member's requests with a capped API key and a capped tag, every one
    admitted through the team's, the key's and the tag's counters too, and nothing left behind."""
    keys, counts = bench_keys(redis_db), ledger_counts()
    seen_scopes = []
    original = guard.settle

    def spy(row):  # the settle path is handed each row as recorded: look at what it recorded
        seen_scopes.append((row.team_id is not None, row.api_key_id is not None, row.tags))
        return original(row)

    target = tmp_path / "scopes.json"
    monkeypatch.setattr(guard, "settle", spy)
    call_command("bench_guard", "--level", "guard", "--scopes", "all", "--n", "20", "--warmup", "2",
                 "--json", str(target), stdout=StringIO())
    report = json.loads(target.read_text())
    assert report["scopes"] == "all" and report["levels"]["guard"]["n"] == 20
    assert len(seen_scopes) == 22
    assert all(team and key and tags.startswith(",bench-") for team, key, tags in seen_scopes)
    assert bench_keys(redis_db) == keys
    assert ledger_counts() == counts


def test_one_level_alone_is_reported_alone(db, redis_db, tmp_path):
    target = tmp_path / "counters.json"
    call_command("bench_guard", "--level", "counters", "--n", "10", "--warmup", "0", "--json", str(target), stdout=StringIO())
    assert set(json.loads(target.read_text())["levels"]) == {"counters"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "--n must be at least 1, got 0"),
        (["--n", "-5"], "--n must be at least 1, got -5"),
        (["--n", "many"], "invalid int value"),
        (["--warmup", "-1"], "--warmup cannot be negative"),
        (["--level", "engine"], "invalid choice: 'engine'"),
        (["--json", "/no/such/folder/bench.json"], "does not exist"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("bench_guard", *args, stdout=StringIO())


def test_cycles_can_run_on_several_threads(tmp_path):
    out = tmp_path / "bench.json"
    call_command("bench_guard", "--level", "counters", "--n", "200", "--warmup", "10", "--threads", "4",
                 "--json", str(out), stdout=StringIO())
    report = json.loads(out.read_text())
    assert report["threads"] == 4 and report["levels"]["counters"]["n"] == 200
