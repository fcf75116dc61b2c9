"""Cost per user, the token log browser (with CSV export) and "my usage", through Django's test client."""

from __future__ import annotations

import csv
import io
import itertools
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from budgets.models import Feature, Period, Provider, Quota, TokenLog
from budgets.periods import describe_reset, period_bounds
from budgets.usage import cost_per_user, log_histogram, percentile, short_usd

pytestmark = pytest.mark.django_db

STAFF_PAGES = ["staff-costs", "staff-logs"]
_ids = itertools.count(1)


def log(user, feature=None, *, status="ok", cost=0, prompt=10, completion=5, at=None, code="", **fields) -> TokenLog:
    return TokenLog.objects.create(
        request_id=f"t-{next(_ids)}", user=user, feature=feature, model="m", status=status, refusal_code=code,
        prompt_tokens=prompt, completion_tokens=completion, cost_micro_usd=cost,
        created_at=at or timezone.now(), **fields,
    )


def logged_in(client, user):
    client.force_login(user)
    return client


def csv_rows(response) -> list[list[str]]:
    body = b"".join(response.streaming_content).decode()
    return list(csv.reader(io.StringIO(body)))


# --- who may see what ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*STAFF_PAGES, "my-usage"])
def test_anonymous_visitors_are_sent_to_log_in(client, name):
    response = client.get(reverse(name))
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


@pytest.mark.parametrize("name", STAFF_PAGES)
def test_end_users_are_refused_staff_pages(client, alice, name):
    assert logged_in(client, alice).get(reverse(name)).status_code == 403
    assert client.get(reverse(name), {"format": "csv"}).status_code == 403


@pytest.mark.parametrize("name", STAFF_PAGES)
def test_staff_can_open_staff_pages_even_when_the_ledger_is_empty(client, staff, name):
    assert logged_in(client, staff).get(reverse(name)).status_code == 200


def test_any_logged_in_user_can_open_my_usage(client, alice):
    assert logged_in(client, alice).get(reverse("my-usage")).status_code == 200


# --- cost per user -------------------------------------------------------------------------------


@pytest.fixture
def ten_users(chat_feature):
    """Users u01..u10 who spent $1..$10 this month (u10 in two requests), plus noise that must not count."""
    users = [User.objects.create_user(f"u{i:02d}") for i in range(1, 11)]
    for i, user in enumerate(users, start=1):
        log(user, chat_feature, cost=i * 1_000_000, prompt=100, completion=i)
    log(users[-1], chat_feature, cost=0, prompt=0, completion=0, status="refused", code="user_tokens_per_day")
    start, _ = period_bounds(Period.MONTH, timezone.now())
    log(users[0], chat_feature, cost=999_000_000, at=start - timedelta(seconds=1))  # last month
    return users


def test_cost_per_user_percentiles_and_top_share_on_a_known_dataset(ten_users):
    start, end = period_bounds(Period.MONTH, timezone.now())
    tail = cost_per_user(start, end)
    assert (tail.users, tail.requests, tail.total_micro_usd) == (10, 11, 55_000_000)
    # Nearest rank: the 5th of 10 for p50, the 9th for p90, the 10th for p99.
    assert (tail.p50_micro_usd, tail.p90_micro_usd, tail.p99_micro_usd) == (5_000_000, 9_000_000, 10_000_000)
    assert tail.top_percent_users == 1
    assert tail.top_percent_share == pytest.approx(10 / 55)
    top = tail.top_users[0]
    assert (top.username, top.requests, top.tokens, top.cost_micro_usd) == ("u10", 2, 110, 10_000_000)
    assert [u.username for u in tail.top_users] == [f"u{i:02d}" for i in range(10, 0, -1)]
    assert sum(b.users for b in tail.histogram) == 10
    assert tail.concentration[0] == (0.0, 0.0) and tail.concentration[-1] == (1.0, 1.0)


def test_the_cost_page_shows_the_numbers_and_links_each_top_user(client, staff, ten_users):
    response = logged_in(client, staff).get(reverse("staff-costs"))
    page = response.content.decode()
    assert '<div class="kpi" id="kpi-p50">$5.00</div>' in page
    assert '<div class="kpi" id="kpi-p99">$10.00</div>' in page
    assert '<div class="kpi" id="kpi-top-share">18.2%</div>' in page
    assert f'href="{reverse("staff-user", args=[ten_users[-1].pk])}">u10</a>' in page
    assert 'id="cost-chart-data"' in page and "vendor/plotly.min.js" in page


def test_today_counts_only_todays_spend(client, staff, chat_feature, alice):
    log(alice, chat_feature, cost=2_000_000)
    log(alice, chat_feature, cost=7_000_000, at=period_bounds(Period.DAY, timezone.now())[0] - timedelta(minutes=1))
    page = logged_in(client, staff).get(reverse("staff-costs"), {"period": "day"}).content.decode()
    assert '<div class="kpi" id="kpi-total">$2.00</div>' in page


def test_an_unknown_period_is_an_error_and_falls_back_to_the_month(client, staff):
    response = logged_in(client, staff).get(reverse("staff-costs"), {"period": "decade"})
    assert response.status_code == 200
    assert "Select a valid choice" in response.content.decode()


def test_percentiles_and_histogram_of_edge_cases():
    assert percentile([], 50) == 0
    assert percentile([7], 99) == 7
    assert percentile(list(range(1, 101)), 99) == 99
    bins = log_histogram([0, 0, 1, 9, 10, 1_000_000])
    assert bins[0].users == 2 and bins[0].label == "$0"
    assert sum(b.users for b in bins) == 6
    assert all(b.low_micro_usd < b.high_micro_usd for b in bins[1:])
    shown = [short_usd(m) for m in (1, 100, 178, 1_780_000, 18_000_000, 1_800_000_000)]
    assert shown == ["$0.000001", "$0.0001", "$0.00018", "$1.8", "$18", "$1,800"]


def test_usernames_are_shown_as_text_not_markup(client, staff, chat_feature):
    sneaky = User.objects.create_user("<b>mallory</b>")
    log(sneaky, chat_feature, cost=5)
    for name in STAFF_PAGES:
        page = logged_in(client, staff).get(reverse(name)).content.decode()
        assert "&lt;b&gt;mallory&lt;/b&gt;" in page
        assert "<b>mallory</b>" not in page


# --- the token log -------------------------------------------------------------------------------


@pytest.fixture
def mixed_logs(alice, bob, chat_feature):
    summary = Feature.objects.create(name="summary")
    now = timezone.now()
    return {
        "alice_ok": log(alice, chat_feature, cost=1_234, at=now - timedelta(minutes=3)),
        "alice_refused": log(
            alice, chat_feature, status="refused", code="user_tokens_per_day", at=now - timedelta(minutes=2)
        ),
        "alice_summary": log(alice, summary, cost=50, at=now - timedelta(minutes=1)),
        "bob_ok": log(bob, chat_feature, cost=99, at=now),
        "alice_old": log(alice, chat_feature, cost=7, at=now - timedelta(days=40)),
    }


def shown_ids(response) -> list[str]:
    return [row.request_id for row in response.context["rows"]]


def test_the_log_lists_newest_first_and_filters(client, staff, mixed_logs):
    client = logged_in(client, staff)
    everything = client.get(reverse("staff-logs"))
    ids = {key: row.request_id for key, row in mixed_logs.items()}
    newest_first = ("bob_ok", "alice_summary", "alice_refused", "alice_ok", "alice_old")
    assert shown_ids(everything) == [ids[k] for k in newest_first]
    assert shown_ids(client.get(reverse("staff-logs"), {"user": "bob"})) == [ids["bob_ok"]]
    assert shown_ids(client.get(reverse("staff-logs"), {"user": "alice", "feature": "chat", "status": "ok"})) == [
        ids["alice_ok"], ids["alice_old"]
    ]
    refused = client.get(reverse("staff-logs"), {"refusal_code": "user_tokens_per_day"})
    assert shown_ids(refused) == [ids["alice_refused"]]
    today = timezone.localdate()
    two_days = {"user": "alice", "date_from": str(today - timedelta(days=1)), "date_to": str(today)}
    recent = client.get(reverse("staff-logs"), two_days)
    assert ids["alice_old"] not in shown_ids(recent) and len(shown_ids(recent)) == 3


def test_csv_export_has_the_header_and_only_the_filtered_rows(client, staff, mixed_logs):
    response = logged_in(client, staff).get(reverse("staff-logs"), {"format": "csv", "user": "alice", "status": "ok"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    header, *rows = csv_rows(response)
    assert header == [
        "created_at", "request_id", "user", "feature", "model", "status", "refusal_code",
        "prompt_tokens", "completion_tokens", "cost_usd", "ttft_ms", "total_ms", "team", "tags",
    ]
    assert [row[1] for row in rows] == [mixed_logs["alice_summary"].request_id, mixed_logs["alice_ok"].request_id,
                                        mixed_logs["alice_old"].request_id]
    first_chat = rows[1]
    assert first_chat[2:10] == ["alice", "chat", "m", "ok", "", "10", "5", "0.001234"]
    assert first_chat[12:] == ["", ""]  # no team, no tags


def test_csv_export_has_each_rows_team_and_tags(client, staff, alice, bob, chat_feature):
    from budgets.models import Team

    team = Team.objects.create(name="=Support")  # a name a spreadsheet would run as a formula
    tagged = log(alice, chat_feature, team=team, tags=",support,beta,")
    plain = log(bob, chat_feature)

    header, *rows = csv_rows(logged_in(client, staff).get(reverse("staff-logs"), {"format": "csv"}))

    by_id = {row[1]: dict(zip(header, row, strict=True)) for row in rows}
    assert (by_id[tagged.request_id]["team"], by_id[tagged.request_id]["tags"]) == ("'=Support", "support beta")
    assert (by_id[plain.request_id]["team"], by_id[plain.request_id]["tags"]) == ("", "")
    only_support = csv_rows(client.get(reverse("staff-logs"), {"format": "csv", "tag": "support"}))[1:]
    assert [row[1] for row in only_support] == [tagged.request_id]


def test_bad_filters_show_an_error_instead_of_rows(client, staff, mixed_logs):
    client = logged_in(client, staff)
    cases = [
        ({"date_from": "2024-13-45"}, "Enter a valid date."),
        ({"user": "nobody"}, "There is no user named &#x27;nobody&#x27;."),
        ({"date_from": "2024-05-02", "date_to": "2024-05-01"}, "The end date is before the start date."),
        ({"status": "exploded"}, "Select a valid choice."),
        ({"feature": "nope"}, "Select a valid choice."),
        ({"refusal_code": "DROP TABLE"}, "Refusal codes are lowercase"),
        ({"before": "yesterday"}, "This page link is damaged"),
    ]
    for params, message in cases:
        response = client.get(reverse("staff-logs"), params)
        assert response.status_code == 400, params
        assert message in response.content.decode(), params
        assert response.context["rows"] == []
    assert client.get(reverse("staff-logs"), {"format": "csv", "date_to": "soon"}).status_code == 400


def test_pages_walk_back_and_forth_by_keyset_even_when_times_tie(client, staff, alice, chat_feature):
    now = timezone.now()
    # 250 rows, in pairs with the same created_at, so the id has to break ties.
    TokenLog.objects.bulk_create(
        TokenLog(request_id=f"k-{n:03d}", user=alice, feature=chat_feature, model="m", status="ok",
                 created_at=now - timedelta(seconds=n // 2))
        for n in range(250)
    )
    client = logged_in(client, staff)
    expected = list(TokenLog.objects.order_by("-created_at", "-id").values_list("request_id", flat=True))
    first = client.get(reverse("staff-logs"))
    assert shown_ids(first) == expected[:100] and first.context["newer"] is None
    second = client.get(reverse("staff-logs"), {"before": first.context["older"]})
    assert shown_ids(second) == expected[100:200]
    third = client.get(reverse("staff-logs"), {"before": second.context["older"]})
    assert shown_ids(third) == expected[200:] and third.context["older"] is None
    back = client.get(reverse("staff-logs"), {"after": third.context["newer"]})
    assert shown_ids(back) == expected[100:200]
    assert shown_ids(client.get(reverse("staff-logs"), {"after": back.context["newer"]})) == expected[:100]
    assert first.context["matching"] == 250


# --- my usage ------------------------------------------------------------------------------------


def test_my_usage_shows_my_own_caps_whats_left_and_when_they_reset(client, alice, bob, chat_feature):
    Quota.objects.create(user=None, feature=None, period=Period.DAY, max_requests=10, max_tokens=1_000)
    Quota.objects.create(user=alice, feature=None, period=Period.MONTH, max_cost_micro_usd=5_000_000)
    Quota.objects.create(user=None, feature=chat_feature, period=Period.DAY, max_requests=4)
    log(alice, chat_feature, prompt=100, completion=23, cost=1_500_000)
    log(alice, chat_feature, prompt=200, completion=0, status="refused", code="user_tokens_per_day")  # not counted
    log(alice, chat_feature, status="running", admitted=True, reserved_tokens=300, reserved_cost_micro_usd=250_000)
    log(bob, chat_feature, prompt=700, completion=77, cost=4_440_000)
    log(bob, chat_feature)
    log(bob, chat_feature)

    response = logged_in(client, alice).get(reverse("my-usage"))
    page = response.content.decode()
    caps = {cap.title: {a.metric: a for a in cap.allowances} for cap in response.context["usage"].caps}
    assert set(caps) == {"Today · all features", "Today · feature 'chat'", "This month · all features"}
    today = caps["Today · all features"]
    # One settled request (123 tokens) plus one still running (300 tokens held).
    assert (today["requests"].used, today["requests"].in_progress, today["requests"].left) == (1, 1, 8)
    assert (today["tokens"].used, today["tokens"].in_progress, today["tokens"].left) == (123, 300, 577)
    assert caps["Today · feature 'chat'"]["requests"].left == 2
    month = caps["This month · all features"]["cost"]
    assert (month.shown_used, month.shown_left, month.shown_limit) == ("$1.75", "$3.25", "$5.00")
    assert "$3.25" in page and "577" in page
    now = timezone.now()
    assert f"Resets {describe_reset(Period.DAY, now).split(', in')[0]}" in page
    assert f"Resets {describe_reset(Period.MONTH, now).split(', in')[0]}" in page
    # Bob's numbers are nowhere on Alice's page, and nothing in the URL could ask for them.
    assert "777" not in page and "$4.44" not in page and "bob" not in page
    totals = response.context["usage"].today
    assert (totals.requests, totals.tokens, totals.refused) == (1, 123, 1)  # the running one is not done yet


def test_my_usage_with_no_caps_says_so(client, alice, chat_feature):
    page = logged_in(client, alice).get(reverse("my-usage")).content.decode()
    assert "No caps apply to you right now." in page
    assert 'id="team-caps"' not in page and 'id="key-caps"' not in page  # no team, no key


def test_my_usage_shows_my_teams_caps_and_my_api_keys_caps(client, alice, bob, chat_feature):
    from accounts.actions import do_create_api_key
    from budgets.actions import do_create_team
    from budgets.models import TeamQuota

    team, _ = do_create_team(None, "Support", [alice, bob])
    TeamQuota.objects.create(team=team, period=Period.MONTH, max_cost_micro_usd=10_000_000)
    TeamQuota.objects.create(team=team, feature=chat_feature, period=Period.DAY, max_requests=50)
    laptop, _ = do_create_api_key(alice, "laptop")
    laptop.max_requests_per_day, laptop.max_cost_per_month_micro_usd = 5, 2_000_000
    laptop.save()
    do_create_api_key(alice, "uncapped")
    revoked, _ = do_create_api_key(alice, "old")
    revoked.max_requests_per_day, revoked.revoked_at = 1, timezone.now()
    revoked.save()
    log(alice, chat_feature, cost=1_000_000, team=team, api_key=laptop)
    log(bob, chat_feature, cost=3_000_000, team=team)  # a teammate's spend counts against the team's cap
    log(bob, chat_feature, cost=9_000_000)  # bob before he joined: not the team's
    log(alice, chat_feature, status="running", admitted=True, team=team, api_key=laptop,
        reserved_cost_micro_usd=500_000)

    response = logged_in(client, alice).get(reverse("my-usage"))

    usage = response.context["usage"]
    team_caps = {cap.title: {a.metric: a for a in cap.allowances} for cap in usage.team_caps}
    assert set(team_caps) == {"Today · team 'Support', feature 'chat'", "This month · team 'Support', all features"}
    month = team_caps["This month · team 'Support', all features"]["cost"]
    assert (month.used, month.in_progress, month.shown_left) == (4_000_000, 500_000, "$5.50")
    assert (team_caps["Today · team 'Support', feature 'chat'"]["requests"].used,
            team_caps["Today · team 'Support', feature 'chat'"]["requests"].left) == (2, 47)
    key_caps = {cap.title: {a.metric: a for a in cap.allowances} for cap in usage.key_caps}
    # Only the active key with caps: "uncapped" has none, "old" is revoked.
    assert set(key_caps) == {"Today · API key 'laptop'", "This month · API key 'laptop'"}
    assert (key_caps["Today · API key 'laptop'"]["requests"].used, key_caps["Today · API key 'laptop'"]["requests"].left) == (1, 3)
    assert key_caps["This month · API key 'laptop'"]["cost"].shown_left == "$0.50"
    page = response.content.decode()
    assert 'id="team-caps"' in page and "You are in the team Support" in page and "$5.50" in page
    assert 'id="key-caps"' in page and "API key &#x27;laptop&#x27;" in page
    # The user's own totals stay the user's: bob's requests are not in them.
    assert usage.month.cost_micro_usd == 1_000_000


# --- bounded queries -----------------------------------------------------------------------------


def many_logs(users: int, rows_each: int, feature) -> None:
    people = User.objects.bulk_create(User(username=f"q-{i}") for i in range(users))
    TokenLog.objects.bulk_create(
        TokenLog(request_id=f"q-{u.pk}-{n}", user=u, feature=feature, model="m", status="ok", cost_micro_usd=n,
                 created_at=timezone.now() - timedelta(minutes=n))
        for u in people for n in range(rows_each)
    )


@pytest.mark.parametrize(("users", "rows_each"), [(1, 1), (60, 20)])
def test_query_counts_do_not_grow_with_rows_or_users(client, staff, alice, chat_feature, users, rows_each,
                                                     django_assert_max_num_queries):
    Feature.objects.create(name="summary")
    Provider.default()  # created once, on the first request ever; not what this test measures
    Quota.objects.create(user=None, feature=None, period=Period.DAY, max_requests=10)
    many_logs(users, rows_each, chat_feature)
    client = logged_in(client, staff)
    with django_assert_max_num_queries(4):
        client.get(reverse("staff-costs"))
    with django_assert_max_num_queries(8):
        client.get(reverse("staff-logs"), {"user": "q-0", "feature": "chat", "status": "ok"})
    with django_assert_max_num_queries(3):
        assert len(b"".join(client.get(reverse("staff-logs"), {"format": "csv"}).streaming_content)) > 0
    client.force_login(alice)
    # session, user, team membership, features, default provider, the quotas of each of the 2 features,
    # the API keys, one aggregate, the in-flight caps (own and default, read once through the cache).
    with django_assert_max_num_queries(10):
        client.get(reverse("my-usage"))
