"""`manage.py set_quota` sets caps from the command line and refuses nonsense clearly."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from budgets.models import AuditEntry, Quota

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command("set_quota", *args, stdout=out)
    return out.getvalue()


def test_it_sets_and_updates_a_users_daily_caps(alice):
    run("alice", "--period", "day", "--requests", "50", "--tokens", "10000")
    run("alice", "--period", "day", "--cost-usd", "1.25")
    quota = Quota.objects.get(user=alice, feature=None, period="day")
    assert (quota.max_requests, quota.max_tokens, quota.max_cost_micro_usd) == (50, 10_000, 1_250_000)


def test_it_sets_a_default_per_feature_cap_and_clears_it(chat_feature):
    run("--default", "--period", "month", "--feature", "chat", "--requests", "3")
    assert Quota.objects.get(user=None, feature=chat_feature, period="month").max_requests == 3
    assert "removed 1" in run("--default", "--period", "month", "--feature", "chat", "--clear")
    assert not Quota.objects.exists()


def test_it_leaves_an_audit_entry_per_changed_cap_like_the_dashboard(alice):
    run("alice", "--period", "day", "--requests", "50")
    run("alice", "--period", "day", "--cost-usd", "1.25")  # --requests is kept, not re-recorded
    run("alice", "--period", "day", "--clear")

    trail = [(e.actor, e.action, e.target, e.field, e.before, e.after) for e in AuditEntry.objects.order_by("id")]
    assert trail == [
        (None, "create", "quota alice/all/day", "max_requests", "default", "50"),
        (None, "create", "quota alice/all/day", "max_tokens", "default", "no cap"),
        (None, "create", "quota alice/all/day", "max_cost", "default", "no cap"),
        (None, "update", "quota alice/all/day", "max_cost", "no cap", "$1.25"),
        (None, "delete", "quota alice/all/day", "max_requests", "50", "default"),
        (None, "delete", "quota alice/all/day", "max_tokens", "no cap", "default"),
        (None, "delete", "quota alice/all/day", "max_cost", "$1.25", "default"),
    ]


def test_setting_a_cap_again_changes_nothing_and_records_nothing(alice):
    run("alice", "--period", "day", "--tokens", "100")
    entries = AuditEntry.objects.count()
    assert "tokens=100" in run("alice", "--period", "day", "--tokens", "100")
    assert AuditEntry.objects.count() == entries


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--period", "day", "--requests", "1"], "Name exactly one user"),
        (["alice", "--default", "--period", "day", "--requests", "1"], "Name exactly one user"),
        (["nobody", "--period", "day", "--requests", "1"], "no user named 'nobody'"),
        (["alice", "--period", "day", "--requests", "-1"], "zero or more"),
        (["alice", "--period", "day", "--cost-usd", "lots"], "not an amount"),
        (["alice", "--period", "day", "--cost-usd", "-1"], "--cost-usd must be zero or more, not -1"),
        (["alice", "--period", "day", "--cost-usd", "0.0000001"], "more than 6 decimals"),
        (["alice", "--period", "day", "--feature", "nope", "--requests", "1"], "no feature named 'nope'"),
        (["alice", "--period", "day"], "at least one of"),
    ],
)
def test_it_refuses_nonsense_with_a_clear_message(alice, args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_an_unknown_period_is_refused(alice):
    with pytest.raises(CommandError, match="invalid choice"):
        run("alice", "--period", "week", "--requests", "1")
