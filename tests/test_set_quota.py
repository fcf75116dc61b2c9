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


# --- teams, API keys, tags -----------------------------------------------------------------------


@pytest.fixture
def support(alice, bob):
    call_command("create_team", "Support", "--member", "alice", "--member", "bob", stdout=io.StringIO())
    from budgets.models import Team

    return Team.objects.get(name="Support")


def test_create_team_puts_its_members_in_it_and_audits_it(support, alice, bob):
    assert {m.user.username for m in support.memberships.all()} == {"alice", "bob"}
    trail = set(AuditEntry.objects.values_list("target", "field", "before", "after"))
    assert ("team Support", "name", "", "Support") in trail
    assert ("user alice", "team", "none", "Support") in trail


def test_create_team_adds_a_member_who_stays_in_his_old_team(support, alice):
    call_command("create_team", "Sales", "--member", "alice", stdout=io.StringIO())
    assert list(alice.team_memberships.order_by("joined_at").values_list("team__name", flat=True)) == ["Support", "Sales"]
    assert sorted(m.user.username for m in support.memberships.all()) == ["alice", "bob"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["Support"], "already a team named 'Support'"), (["Ops", "--member", "nobody"], "no user named 'nobody'"),
     ([" "], "1 to 64 characters")],
)
def test_create_team_refuses_nonsense(support, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("create_team", *args, stdout=io.StringIO())


def test_it_sets_a_teams_caps_per_feature_too_and_clears_them(support, chat_feature):
    from budgets.models import TeamQuota

    run("--team", "Support", "--period", "month", "--cost-usd", "50")
    run("--team", "Support", "--period", "day", "--feature", "chat", "--requests", "20", "--tokens", "9000")
    assert TeamQuota.objects.get(team=support, feature=None, period="month").max_cost_micro_usd == 50_000_000
    quota = TeamQuota.objects.get(team=support, feature=chat_feature, period="day")
    assert (quota.max_requests, quota.max_tokens) == (20, 9000)
    assert ("team quota Support/all/month", "max_cost", "no cap", "$50.00") in set(
        AuditEntry.objects.values_list("target", "field", "before", "after"))
    assert "removed 1" in run("--team", "Support", "--period", "month", "--clear")
    assert TeamQuota.objects.count() == 1


def test_it_sets_an_api_keys_caps(alice):
    from accounts.actions import do_create_api_key

    key, _ = do_create_api_key(alice, "ci")
    run("--api-key", str(key.pk), "--period", "day", "--requests", "100", "--cost-usd", "2")
    run("--api-key", str(key.pk), "--period", "month", "--cost-usd", "20")
    key.refresh_from_db()
    assert (key.max_requests_per_day, key.max_cost_per_day_micro_usd, key.max_cost_per_month_micro_usd) == (
        100, 2_000_000, 20_000_000)
    run("--api-key", str(key.pk), "--period", "day", "--clear")
    key.refresh_from_db()
    assert (key.max_requests_per_day, key.max_cost_per_day_micro_usd, key.max_cost_per_month_micro_usd) == (
        None, None, 20_000_000)
    assert AuditEntry.objects.filter(target=f"api key {key.pk} (alice/ci)").count() == 5


def test_it_sets_a_tags_monthly_spend_cap(db):
    from budgets.models import TagQuota

    run("--tag", "support", "--period", "month", "--cost-usd", "12.5")
    assert TagQuota.objects.get(tag="support").max_cost_micro_usd == 12_500_000
    assert "removed 1" in run("--tag", "support", "--period", "month", "--clear")
    assert not TagQuota.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["alice", "--team", "Support", "--period", "day", "--requests", "1"], "Name exactly one user"),
        (["--team", "Support", "--tag", "x", "--period", "month", "--cost-usd", "1"], "Name exactly one user"),
        (["--team", "Nobody", "--period", "day", "--requests", "1"], "no team named 'Nobody'"),
        (["--team", "Support", "--period", "day"], "at least one of"),
        (["--api-key", "999999", "--period", "day", "--requests", "1"], "no API key with id 999999"),
        (["--tag", "Not A Tag", "--period", "month", "--cost-usd", "1"], "is not a tag name"),
        (["--tag", "support", "--period", "day", "--cost-usd", "1"], "per month"),
        (["--tag", "support", "--period", "month", "--requests", "1"], "--cost-usd only"),
        (["--tag", "support", "--period", "month"], "Give --cost-usd"),
    ],
)
def test_it_refuses_nonsense_for_the_new_scopes(support, args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_an_api_keys_caps_are_requests_per_day_and_cost(alice):
    from accounts.actions import do_create_api_key

    key, _ = do_create_api_key(alice, "ci")
    with pytest.raises(CommandError, match="per day only"):
        run("--api-key", str(key.pk), "--period", "month", "--requests", "1")
    with pytest.raises(CommandError, match="not --tokens"):
        run("--api-key", str(key.pk), "--period", "day", "--tokens", "1")


def test_a_bad_argument_exits_non_zero_from_the_shell(transactional_db, settings):
    import subprocess
    import sys

    from project import stack
    from tests.conftest import _test_database_url

    env = stack.child_env(DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL)
    result = subprocess.run([sys.executable, "manage.py", "set_quota", "--tag", "support", "--period", "day",
                             "--cost-usd", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "per month" in result.stderr
