"""Team, API key and tag caps: checked with every other cap in the guard's one Lua admission, exact
under concurrency, named in refusals, and rebuilt from the ledger after a Redis flush."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from accounts.actions import do_create_api_key
from budgets.actions import do_create_team, do_set_team
from budgets.guard import admit, applicable_ceilings, counter_store, ledger_sums, request_scopes
from budgets.models import ModelPrice, Provider, Quota, TagQuota, TeamQuota, TokenLog
from tests.test_guard import admit_in_threads, clean_counters, finish, request  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

PRICE_FROM = datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC"))


@pytest.fixture
def priced():
    """1 µ$ per prompt token and 1 µ$ per output token on the local provider."""
    return ModelPrice.objects.create(
        provider=Provider.default(), model="test-model", input_per_million_micro_usd=1_000_000,
        output_per_million_micro_usd=1_000_000, effective_from=PRICE_FROM,
    )


def members(count: int) -> list[User]:
    return [User.objects.create_user(f"member{i}") for i in range(count)]


def counters_match_ledger(user, feature, scope: str, api_key=None, tags=()) -> list[tuple]:
    """For each ceiling of `scope`: (counter used, counter reserved) == (ledger used, ledger reserved)."""
    scopes = request_scopes(user, api_key, tuple(tags))
    pairs = []
    for ceiling in applicable_ceilings(user, feature, Provider.default(), timezone.now(), None, scopes):
        if ceiling.scope == scope:
            state = counter_store().state(ceiling.spec.key)
            pairs.append(((state.used, state.reserved), ledger_sums(ceiling.ledger_filter)))
    assert pairs, f"no {scope} ceiling applies"
    return pairs


# --- teams -----------------------------------------------------------------------------------------


def test_200_concurrent_admissions_from_10_members_admit_exactly_the_teams_50(chat_feature, settings):
    settings.CEILING_GUARD_TIMEOUT_S = 2.0  # 16 threads on 2 cores: every refusal must be the cap's
    counter_store.cache_clear()
    people = members(10)
    team, _ = do_create_team(None, "Support", people)
    TeamQuota.objects.create(team=team, period="day", max_requests=50)

    decisions = admit_in_threads([request(people[i % 10], chat_feature) for i in range(200)])

    assert sum(d.admitted for d in decisions) == 50
    assert {d.code for d in decisions if not d.admitted} == {"team_requests_per_day"}
    assert TokenLog.objects.filter(team=team, admitted=True).count() == 50
    assert TokenLog.objects.filter(team=team, refusal_code="team_requests_per_day").count() == 150
    [(counter, ledger)] = counters_match_ledger(people[0], chat_feature, "team")
    assert counter == ledger and counter[1].requests == 50
    counter_store.cache_clear()


def test_a_team_refusal_names_the_team_with_its_numbers(alice, bob, chat_feature, priced):
    team, _ = do_create_team(None, "Support", [alice, bob])
    TeamQuota.objects.create(team=team, period="month", max_cost_micro_usd=50_000_000)
    first = admit(request(alice, chat_feature, prompt=1_000, max_tokens=48_200_000))
    finish(first, 48_199_000)  # $48.20 spent by alice

    refused = admit(request(bob, chat_feature, prompt=2_000_000, max_tokens=10))

    assert refused.code == "team_cost_per_month"
    assert refused.message.startswith("Your team 'Support' has used $48.20 of its $50.00 for this month.")
    assert "The team's allowance resets on 1 " in refused.message


def test_every_cap_must_pass_the_users_own_cap_still_bites_inside_a_team(alice, bob, chat_feature):
    team, _ = do_create_team(None, "Support", [alice, bob])
    TeamQuota.objects.create(team=team, period="day", max_requests=5)
    Quota.objects.create(user=alice, period="day", max_requests=2)
    alice_results = [admit(request(alice, chat_feature)).code or "ok" for _ in range(3)]
    bob_results = [admit(request(bob, chat_feature)).code or "ok" for _ in range(4)]
    assert alice_results == ["ok", "ok", "user_requests_per_day"]
    assert bob_results == ["ok", "ok", "ok", "team_requests_per_day"]


def test_a_teams_per_feature_cap_counts_only_that_feature(alice, chat_feature):
    team, _ = do_create_team(None, "Support", [alice])
    TeamQuota.objects.create(team=team, feature=chat_feature, period="month", max_requests=1)
    assert admit(request(alice, chat_feature)).admitted
    refused = admit(request(alice, chat_feature))
    assert refused.code == "team_feature_requests_per_month"
    assert refused.message.startswith("Your team 'Support' has made 1 of its 1 requests for this month on 'chat' (counting")


def test_a_member_who_moves_leaves_his_old_requests_with_the_old_team(alice, chat_feature):
    support, _ = do_create_team(None, "Support", [alice])
    sales, _ = do_create_team(None, "Sales")
    TeamQuota.objects.create(team=support, period="day", max_requests=10)
    finish(admit(request(alice, chat_feature)), 3)
    do_set_team(None, alice, sales)
    TeamQuota.objects.create(team=sales, period="day", max_requests=10)
    admit(request(alice, chat_feature))
    assert list(TokenLog.objects.order_by("id").values_list("team__name", flat=True)) == ["Support", "Sales"]
    assert TokenLog.objects.filter(team=support).count() == 1


# --- API keys --------------------------------------------------------------------------------------


def test_a_keys_cap_below_its_users_cap_holds_under_concurrency(alice, chat_feature, settings):
    settings.CEILING_GUARD_TIMEOUT_S = 2.0
    counter_store.cache_clear()
    Quota.objects.create(user=alice, period="day", max_requests=100)
    key, _ = do_create_api_key(alice, "ci")
    key.max_requests_per_day = 7
    key.save()

    decisions = admit_in_threads([request(alice, chat_feature, api_key=key) for _ in range(40)])

    assert sum(d.admitted for d in decisions) == 7
    assert {d.code for d in decisions if not d.admitted} == {"key_requests_per_day"}
    # Without the key (the chat page) alice still has her own cap's room.
    assert admit(request(alice, chat_feature)).admitted
    refused = admit(request(alice, chat_feature, api_key=key))
    assert refused.message.startswith("This API key ('ci') has made 7 of its 7 requests for today (counting")
    counter_store.cache_clear()


def test_a_keys_monthly_spend_cap_holds(alice, chat_feature, priced):
    key, _ = do_create_api_key(alice, "ci")
    key.max_cost_per_month_micro_usd = 100
    key.save()
    assert admit(request(alice, chat_feature, prompt=60, max_tokens=100, api_key=key)).max_tokens == 40
    refused = admit(request(alice, chat_feature, prompt=1, max_tokens=1, api_key=key))
    assert refused.code == "key_cost_per_month"
    assert "This API key ('ci') has used $0.000100 of its $0.000100 for this month" in refused.message


# --- tags ------------------------------------------------------------------------------------------


def test_a_tag_cap_holds_across_users(chat_feature, priced, settings):
    settings.CEILING_GUARD_TIMEOUT_S = 2.0
    counter_store.cache_clear()
    people = members(5)
    TagQuota.objects.create(tag="support", max_cost_micro_usd=1_000)  # 50 requests of 20 µ$ each

    decisions = admit_in_threads([
        request(people[i % 5], chat_feature, prompt=10, max_tokens=10, tags=("beta", "support")) for i in range(120)
    ])

    assert sum(d.admitted for d in decisions) == 50
    assert {d.code for d in decisions if not d.admitted} == {"tag_cost_per_month"}
    # An untagged request, and one with another tag, are not counted against it.
    assert admit(request(people[0], chat_feature, tags=("beta",))).admitted
    refused = admit(request(people[0], chat_feature, tags=("support",)))
    assert refused.message.startswith("The tag 'support' has used $0.001000 of its $0.001000 for this month")
    assert TokenLog.objects.filter(admitted=True, tags=",beta,support,").count() == 50
    counter_store.cache_clear()


# --- the ledger rebuilds them all --------------------------------------------------------------------


def test_a_redis_flush_rebuilds_team_key_and_tag_counters_from_the_ledger_exactly(chat_feature, priced, redis_db):
    people = members(4)
    do_create_team(None, "Support", people)
    team = people[0].team_memberships.get().team
    TeamQuota.objects.create(team=team, period="month", max_requests=30, max_cost_micro_usd=10_000)
    key, _ = do_create_api_key(people[0], "ci")
    key.max_requests_per_day, key.max_cost_per_day_micro_usd = 25, 5_000
    key.save()
    TagQuota.objects.create(tag="support", max_cost_micro_usd=5_000)

    def load(count: int):
        return admit_in_threads([
            request(people[i % 4], chat_feature, prompt=10, max_tokens=20, tags=("support",),
                    api_key=key if i % 2 == 0 else None)
            for i in range(count)
        ])

    first = load(24)
    for decision in [d for d in first if d.admitted][:12]:
        finish(decision, 7)  # settled at less than reserved; the rest stay in flight
    before = {scope: counters_match_ledger(people[0], chat_feature, scope, key, ["support"])
              for scope in ("team", "key", "tag")}
    redis_db.flushdb()

    after = load(40)

    for scope in ("team", "key", "tag"):
        for counter, ledger in counters_match_ledger(people[0], chat_feature, scope, key, ["support"]):
            assert counter == ledger
    assert all(counter == ledger for pairs in before.values() for counter, ledger in pairs)
    admitted = sum(d.admitted for d in first + after)
    assert admitted == 30  # the team's monthly request cap, across the flush
    assert TokenLog.objects.filter(admitted=True, api_key=key).count() <= 25
