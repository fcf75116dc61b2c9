"""`manage.py set_quota` sets caps from the command line and refuses nonsense clearly."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from budgets.models import Quota

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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--period", "day", "--requests", "1"], "Name exactly one user"),
        (["alice", "--default", "--period", "day", "--requests", "1"], "Name exactly one user"),
        (["nobody", "--period", "day", "--requests", "1"], "no user named 'nobody'"),
        (["alice", "--period", "day", "--requests", "-1"], "zero or more"),
        (["alice", "--period", "day", "--cost-usd", "lots"], "not an amount"),
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
