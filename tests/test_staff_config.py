"""The staff configuration pages: users and caps, defaults, features, providers and prices, audit trail.

Every change made through them is audited field by field; invalid input says what is wrong and
changes nothing.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from budgets.models import AuditEntry, Feature, ModelPrice, Provider, Quota, TokenLog

pytestmark = pytest.mark.django_db

_request_ids = itertools.count()


@pytest.fixture
def local():
    return Provider.default()


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def page_urls(alice, chat_feature, local) -> list[str]:
    return [
        reverse("staff-users"),
        reverse("staff-user", args=[alice.pk]),
        reverse("staff-defaults"),
        reverse("staff-features"),
        reverse("staff-feature", args=[chat_feature.pk]),
        reverse("staff-providers"),
        reverse("staff-provider", args=[local.pk]),
        reverse("staff-audit"),
    ]


def caps_data(response, **changes) -> dict:
    """The caps form as the page filled it in, with `changes` (prefixed names) applied."""
    data = {}
    for _, forms in response.context["scopes"]:
        for form in forms:
            for field in form:
                value = field.value()
                data[field.html_name] = "" if value is None else str(value)
    if "in_flight_form" in response.context:  # a user's and the defaults page; a team's has none
        for field in response.context["in_flight_form"]:
            data[field.html_name] = "" if field.value() is None else str(field.value())
    unknown = set(changes) - set(data)
    assert not unknown, f"no such fields: {unknown}"
    return {**data, **changes}


def log(user, feature, *, tokens: int, cost: int, status: str = TokenLog.Status.OK, at: datetime | None = None) -> TokenLog:
    return TokenLog.objects.create(
        request_id=f"r{next(_request_ids)}",
        user=user,
        feature=feature,
        model="m",
        status=status,
        prompt_tokens=tokens // 2,
        completion_tokens=tokens - tokens // 2,
        cost_micro_usd=cost,
        created_at=at or timezone.now(),
    )


def audit_rows() -> list[tuple[str, str, str, str, str]]:
    return list(AuditEntry.objects.order_by("field").values_list("action", "target", "field", "before", "after"))


# --- who may see the pages -----------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_log_in(client, alice, chat_feature, local):
    for url in page_urls(alice, chat_feature, local):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"] == f"/accounts/login/?next={url}"


def test_end_users_are_refused(client, alice, chat_feature, local):
    client.force_login(alice)
    for url in page_urls(alice, chat_feature, local):
        assert client.get(url).status_code == 403, url
        assert client.post(url, {"form": "provider", "name": "x"}).status_code == 403, url
    assert not AuditEntry.objects.exists()


def test_staff_see_every_page(staff_client, alice, chat_feature, local):
    for url in page_urls(alice, chat_feature, local):
        assert staff_client.get(url).status_code == 200, url


def test_an_unknown_user_feature_or_provider_is_not_found(staff_client, chat_feature, local):
    for name in ("staff-user", "staff-feature", "staff-provider"):
        assert staff_client.get(reverse(name, args=[999_999])).status_code == 404


# --- users and their caps ------------------------------------------------------------------------


def test_the_users_page_shows_usage_against_the_caps_in_force(staff_client, alice, bob, chat_feature):
    Quota.objects.create(period="day", max_tokens=1000)  # the default
    Quota.objects.create(user=bob, period="day", max_tokens=50)  # bob's own replaces it
    log(alice, chat_feature, tokens=120, cost=2_500)
    log(alice, chat_feature, tokens=30, cost=500, at=timezone.now() - timedelta(days=40))  # another month
    log(alice, chat_feature, tokens=999, cost=9, status=TokenLog.Status.REFUSED)  # not "used"
    log(alice, chat_feature, tokens=999, cost=9, status=TokenLog.Status.RUNNING)  # not yet "used"
    log(bob, chat_feature, tokens=60, cost=0)

    response = staff_client.get(reverse("staff-users"))

    rows = {row.user.username: row for row in response.context["rows"]}
    assert [(g.used, g.cap) for g in rows["alice"].day] == [(1, None), (120, 1000), (2_500, None)]
    assert rows["alice"].own_periods == []
    assert [(g.used, g.cap) for g in rows["bob"].day] == [(1, None), (60, 50), (0, None)]
    assert rows["bob"].day[1].full and rows["bob"].own_periods == ["day"]
    assert "120 <span class=\"muted\">/ 1,000</span>" in response.content.decode()


def test_the_users_page_searches_and_pages(staff_client, alice, bob):
    for n in range(55):
        User.objects.create_user(f"user{n:02d}")
    response = staff_client.get(reverse("staff-users"), {"q": "ali"})
    assert [row.user.username for row in response.context["rows"]] == ["alice"]

    first = staff_client.get(reverse("staff-users"), {"q": "user"})
    assert len(first.context["rows"]) == 50 and "Page 1 of 2" in first.content.decode()
    assert "?q=user&amp;page=2" in first.content.decode()
    second = staff_client.get(reverse("staff-users"), {"q": "user", "page": 2})
    assert [row.user.username for row in second.context["rows"]] == [f"user{n}" for n in range(50, 55)]


def test_the_users_page_makes_the_same_few_queries_for_30_users_as_for_3(staff_client, chat_feature, staff):
    def fill(count: int) -> None:
        for n in range(count):
            person = User.objects.create_user(f"p{count}-{n:02d}")
            log(person, chat_feature, tokens=10 + n, cost=n)
            log(person, chat_feature, tokens=5, cost=1, at=timezone.now() - timedelta(days=1))
            if n % 3 == 0:
                Quota.objects.create(user=person, period="month", max_requests=10)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert staff_client.get(reverse("staff-users")).status_code == 200
        return len(captured)

    fill(3)
    few = queries()
    fill(27)
    assert queries() == few


def test_the_users_page_query_count_is_bounded(staff_client, chat_feature, django_assert_max_num_queries):
    for n in range(30):
        person = User.objects.create_user(f"p{n:02d}")
        log(person, chat_feature, tokens=10, cost=1)
        log(person, chat_feature, tokens=10, cost=1, status=TokenLog.Status.FAILED)
    Quota.objects.create(period="day", max_tokens=100)
    # session, user, count, page of users, usage (one aggregate), quotas
    with django_assert_max_num_queries(8):
        staff_client.get(reverse("staff-users"))


def test_the_user_page_query_count_does_not_grow_with_logs(staff_client, alice, chat_feature, django_assert_max_num_queries):
    for _ in range(40):
        log(alice, chat_feature, tokens=10, cost=1)
    # 8, the user's active API keys with their caps, their teams, and the in-flight caps (own and default)
    with django_assert_max_num_queries(11):
        staff_client.get(reverse("staff-user", args=[alice.pk]))


def test_staff_give_a_user_a_daily_token_cap_and_it_is_audited(staff_client, staff, alice, chat_feature):
    url = reverse("staff-user", args=[alice.pk])
    data = caps_data(staff_client.get(url), **{"all-day-source": "own", "all-day-max_tokens": "5"})

    response = staff_client.post(url, data, follow=True)

    assert "Saved" in response.content.decode()
    quota = Quota.objects.get(user=alice)
    assert (quota.feature, quota.period, quota.max_requests, quota.max_tokens, quota.max_cost_micro_usd) == (None, "day", None, 5, None)
    assert audit_rows() == [
        ("create", "quota alice/all/day", "max_cost", "default", "no cap"),
        ("create", "quota alice/all/day", "max_requests", "default", "no cap"),
        ("create", "quota alice/all/day", "max_tokens", "default", "5"),
    ]
    assert set(AuditEntry.objects.values_list("actor", flat=True)) == {staff.pk}


def test_changing_one_cap_records_only_that_cap_before_and_after(staff_client, alice, chat_feature):
    Quota.objects.create(user=alice, period="month", max_tokens=500, max_cost_micro_usd=2_000_000)
    url = reverse("staff-user", args=[alice.pk])
    data = caps_data(staff_client.get(url), **{"all-month-max_cost_usd": "2.5"})

    staff_client.post(url, data)

    assert Quota.objects.get(user=alice).max_cost_micro_usd == 2_500_000
    assert audit_rows() == [("update", "quota alice/all/month", "max_cost", "$2.00", "$2.50")]


def test_a_per_feature_cap_for_a_user(staff_client, alice, chat_feature):
    url = reverse("staff-user", args=[alice.pk])
    prefix = f"{chat_feature.pk}-month"
    data = caps_data(staff_client.get(url), **{f"{prefix}-source": "own", f"{prefix}-max_requests": "3"})

    staff_client.post(url, data)

    quota = Quota.objects.get(user=alice)
    assert (quota.feature, quota.period, quota.max_requests) == (chat_feature, "month", 3)
    assert ("create", "quota alice/chat/month", "max_requests", "default", "3") in audit_rows()


def test_back_to_the_default_removes_the_users_own_caps(staff_client, alice, chat_feature):
    Quota.objects.create(period="day", max_tokens=100)
    Quota.objects.create(user=alice, period="day", max_tokens=5)
    url = reverse("staff-user", args=[alice.pk])
    data = caps_data(staff_client.get(url), **{"all-day-source": "default"})

    staff_client.post(url, data)

    assert not Quota.objects.filter(user=alice).exists()
    assert audit_rows() == [
        ("delete", "quota alice/all/day", "max_cost", "no cap", "default"),
        ("delete", "quota alice/all/day", "max_requests", "no cap", "default"),
        ("delete", "quota alice/all/day", "max_tokens", "5", "default"),
    ]


def test_numbers_typed_while_following_the_default_are_not_dropped_silently(staff_client, alice, chat_feature):
    url = reverse("staff-user", args=[alice.pk])
    data = caps_data(staff_client.get(url), **{"all-day-max_tokens": "5"})  # "Default" still chosen

    response = staff_client.post(url, data)

    assert "choose “Own” to keep them" in response.content.decode()
    assert not Quota.objects.exists() and not AuditEntry.objects.exists()


def test_saving_unchanged_caps_records_nothing(staff_client, alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_tokens=5)
    url = reverse("staff-user", args=[alice.pk])
    response = staff_client.post(url, caps_data(staff_client.get(url)), follow=True)
    assert "nothing had changed" in response.content.decode()
    assert not AuditEntry.objects.exists()


def test_a_negative_cap_is_refused_and_nothing_is_saved(staff_client, alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_tokens=5)
    url = reverse("staff-user", args=[alice.pk])
    # A good change in one row and a bad one in another: neither is saved.
    data = caps_data(staff_client.get(url), **{"all-day-max_tokens": "7", "all-month-source": "own", "all-month-max_requests": "-1"})

    response = staff_client.post(url, data)

    assert response.status_code == 200
    html = response.content.decode()
    assert "A cap cannot be negative." in html and "Nothing was saved" in html
    assert list(Quota.objects.values_list("period", "max_tokens", "max_requests")) == [("day", 5, None)]
    assert not AuditEntry.objects.exists()


def test_a_negative_cost_cap_is_refused(staff_client, chat_feature):
    url = reverse("staff-defaults")
    response = staff_client.post(url, caps_data(staff_client.get(url), **{"all-day-max_cost_usd": "-0.5"}))
    assert "A cap cannot be negative." in response.content.decode()
    assert not Quota.objects.exists() and not AuditEntry.objects.exists()


# --- defaults ------------------------------------------------------------------------------------


def test_staff_set_the_default_caps_for_everyone(staff_client, chat_feature):
    url = reverse("staff-defaults")
    data = caps_data(
        staff_client.get(url),
        **{"all-month-max_cost_usd": "1.25", f"{chat_feature.pk}-day-max_requests": "20"},
    )

    response = staff_client.post(url, data, follow=True)

    assert "Saved (2 changes)" in response.content.decode()
    assert Quota.objects.get(user=None, feature=None, period="month").max_cost_micro_usd == 1_250_000
    assert Quota.objects.get(user=None, feature=chat_feature, period="day").max_requests == 20
    assert audit_rows() == [
        ("create", "quota default/all/month", "max_cost", "no cap", "$1.25"),
        ("create", "quota default/chat/day", "max_requests", "no cap", "20"),
    ]


def test_clearing_every_default_cap_removes_the_row(staff_client, chat_feature):
    Quota.objects.create(period="day", max_requests=10)
    url = reverse("staff-defaults")
    staff_client.post(url, caps_data(staff_client.get(url), **{"all-day-max_requests": ""}))
    assert not Quota.objects.exists()
    assert audit_rows() == [("delete", "quota default/all/day", "max_requests", "10", "no cap")]


def test_a_users_page_shows_the_default_beside_their_caps(staff_client, alice, chat_feature):
    Quota.objects.create(period="day", max_requests=10, max_cost_micro_usd=1_000_000)
    response = staff_client.get(reverse("staff-user", args=[alice.pk]))
    assert "10 requests · no token cap · $1.00" in response.content.decode()


# --- features ------------------------------------------------------------------------------------


def test_staff_create_a_feature(staff_client, local):
    data = {"name": "summary", "description": "Summaries", "enabled": "on", "max_input_tokens": "4000", "mode": "chat",
            "max_output_tokens": "300", "provider": str(local.pk), "cache_ttl_s": "0"}

    response = staff_client.post(reverse("staff-features"), data, follow=True)

    feature = Feature.objects.get(name="summary")
    assert (feature.enabled, feature.max_input_tokens, feature.max_output_tokens, feature.provider) == (True, 4000, 300, local)
    assert "Saved the new feature summary" in response.content.decode()
    assert ("create", "feature summary", "max_input_tokens", "", "4000") in audit_rows()
    assert ("create", "feature summary", "provider", "", "local") in audit_rows()


def test_an_invalid_feature_name_is_refused(staff_client):
    data = {"name": "Chat Bot!", "max_input_tokens": "10", "max_output_tokens": "10"}
    response = staff_client.post(reverse("staff-features"), data)
    assert "Use lowercase letters, digits, - and _." in response.content.decode()
    assert not Feature.objects.exists() and not AuditEntry.objects.exists()


def test_editing_a_feature_audits_each_changed_field(staff_client, chat_feature):
    url = reverse("staff-feature", args=[chat_feature.pk])
    data = {"name": "chat", "description": chat_feature.description, "max_input_tokens": "1000", "mode": "chat",
            "max_output_tokens": str(chat_feature.max_output_tokens), "provider": "", "cache_ttl_s": "0"}  # enabled unticked

    staff_client.post(url, data)

    chat_feature.refresh_from_db()
    assert (chat_feature.enabled, chat_feature.max_input_tokens) == (False, 1000)
    assert audit_rows() == [
        ("update", "feature chat", "enabled", "yes", "no"),
        ("update", "feature chat", "max_input_tokens", "2048", "1000"),
    ]


def test_editing_a_features_mode_and_caches_saves_and_audits_them(staff_client, chat_feature):
    url = reverse("staff-feature", args=[chat_feature.pk])
    data = {"name": "chat", "description": chat_feature.description, "enabled": "on", "mode": "extract",
            "max_input_tokens": str(chat_feature.max_input_tokens), "max_output_tokens": str(chat_feature.max_output_tokens),
            "provider": "", "cache_ttl_s": "600", "semantic_threshold": "0.95", "cache_shared": "on"}

    staff_client.post(url, data)

    chat_feature.refresh_from_db()
    assert (chat_feature.mode, chat_feature.cache_ttl_s, chat_feature.semantic_threshold, chat_feature.cache_shared) == (
        "extract", 600, 0.95, True)
    assert {row[2] for row in audit_rows()} == {"mode", "cache_ttl_s", "semantic_threshold", "cache_shared"}


def test_an_invalid_feature_edit_changes_nothing(staff_client, chat_feature):
    url = reverse("staff-feature", args=[chat_feature.pk])
    data = {"name": "chat", "description": "new", "enabled": "on", "max_input_tokens": "0", "max_output_tokens": "-4"}
    response = staff_client.post(url, data)
    html = response.content.decode()
    assert "greater than or equal to" in html
    chat_feature.refresh_from_db()
    assert (chat_feature.description, chat_feature.max_input_tokens) == ("Chat with the model", 2048)
    assert not AuditEntry.objects.exists()


# --- providers and prices ------------------------------------------------------------------------


def provider_data(provider: Provider, **changes) -> dict:
    return {"form": "provider", "name": provider.name, "kind": provider.kind, "monthly_limit_usd": "",
            "thresholds": "50, 80, 100", "recipients": "", **changes}


def test_staff_create_a_provider(staff_client):
    data = provider_data(Provider(name="remote", kind="openai-compatible"), monthly_limit_usd="300",
                         thresholds="90, 50", recipients="ops@example.com, cfo@example.com",
                         base_url="http://vllm.internal:8000/v1", remote_model="llama", api_key_env="CEILING_PROVIDER_KEY_VLLM")
    del data["form"]
    staff_client.post(reverse("staff-providers"), data)
    provider = Provider.objects.get(name="remote")
    assert provider.monthly_limit_micro_usd == 300_000_000
    assert provider.alert_thresholds == [50, 90]
    assert provider.recipients() == ["ops@example.com", "cfo@example.com"]
    assert ("create", "provider remote", "monthly_limit", "", "$300.00") in audit_rows()


def test_staff_set_a_providers_limit_and_alerts(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    data = provider_data(local, monthly_limit_usd="5", thresholds="25 , 75%", recipients="ops@example.com")

    response = staff_client.post(url, data, follow=True)

    local.refresh_from_db()
    assert (local.monthly_limit_micro_usd, local.alert_thresholds, local.alert_recipients) == (5_000_000, [25, 75], "ops@example.com")
    assert "Saved (3 changes)" in response.content.decode()
    assert audit_rows() == [
        ("update", "provider local", "alert_recipients", "", "ops@example.com"),
        ("update", "provider local", "alert_thresholds", "50, 80, 100", "25, 75"),
        ("update", "provider local", "monthly_limit", "no cap", "$5.00"),
    ]


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"thresholds": "50, 120"}, "A threshold above 100% is not allowed (120%)"),
        ({"thresholds": "0"}, "Thresholds are percents from 1 to 100."),
        ({"thresholds": "fifty"}, "“fifty” is not a whole percent"),
        ({"recipients": "ops@example.com, not-an-email"}, "“not-an-email” is not an email address."),
        ({"monthly_limit_usd": "-1"}, "cannot be negative"),
        ({"name": "renamed"}, "its name cannot change"),
    ],
)
def test_invalid_provider_settings_change_nothing(staff_client, local, changes, error):
    url = reverse("staff-provider", args=[local.pk])
    data = provider_data(local, **{"monthly_limit_usd": "7", **changes})  # a valid change rides along

    response = staff_client.post(url, data)

    assert error in response.content.decode()
    local.refresh_from_db()
    assert (local.name, local.monthly_limit_micro_usd, local.alert_thresholds, local.alert_recipients) == ("local", None, [50, 80, 100], "")
    assert not AuditEntry.objects.exists()


def price_data(**changes) -> dict:
    return {"form": "price", "model": settings.CEILING_MODEL_NAME, "input_usd": "0.15", "output_usd": "0.6",
            "cached_input_usd": "", "effective_from": "", **changes}


def test_staff_add_a_price_and_the_old_one_is_kept(staff_client, local):
    old = ModelPrice.objects.create(provider=local, model=settings.CEILING_MODEL_NAME, input_per_million_micro_usd=100_000,
                                    output_per_million_micro_usd=200_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")))
    url = reverse("staff-provider", args=[local.pk])

    response = staff_client.post(url, price_data(), follow=True)

    assert "Saved the new price" in response.content.decode()
    new = ModelPrice.objects.exclude(pk=old.pk).get()
    assert (new.input_per_million_micro_usd, new.output_per_million_micro_usd, new.cached_input_per_million_micro_usd) == (150_000, 600_000, 0)
    assert abs((new.effective_from - timezone.now()).total_seconds()) < 60
    old_again = ModelPrice.objects.get(pk=old.pk)
    assert (old_again.input_per_million_micro_usd, old_again.effective_from) == (100_000, old.effective_from)
    rows = response.context["prices"]
    assert [(row.price.pk, row.state) for row in rows] == [(new.pk, "in force"), (old.pk, "")]
    assert ("create", f"price local/{settings.CEILING_MODEL_NAME}", "input_per_million", "", "$0.15") in audit_rows()


def test_a_price_from_a_given_moment(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    staff_client.post(url, price_data(effective_from="2030-02-01T09:30"))
    price = ModelPrice.objects.get()
    assert price.effective_from == datetime(2030, 2, 1, 9, 30, tzinfo=ZoneInfo(settings.TIME_ZONE))
    response = staff_client.get(url)
    assert [row.state for row in response.context["prices"]] == ["scheduled"]


def test_an_unknown_model_is_refused_unless_it_is_marked_new(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])

    response = staff_client.post(url, price_data(model="SmolLM2-135M-Instruckt"))

    assert "Unknown model “SmolLM2-135M-Instruckt” for the provider local" in response.content.decode()
    assert not ModelPrice.objects.exists() and not AuditEntry.objects.exists()

    staff_client.post(url, price_data(model="SmolLM2-360M-Instruct", new_model="on"))
    assert ModelPrice.objects.get().model == "SmolLM2-360M-Instruct"
    staff_client.post(url, price_data(model="SmolLM2-360M-Instruct", input_usd="0.2"))  # known now
    assert ModelPrice.objects.filter(model="SmolLM2-360M-Instruct").count() == 2


def test_a_negative_price_is_refused(staff_client, local):
    response = staff_client.post(reverse("staff-provider", args=[local.pk]), price_data(output_usd="-3"))
    assert "cannot be negative" in response.content.decode()
    assert not ModelPrice.objects.exists() and not AuditEntry.objects.exists()


# --- the audit trail -----------------------------------------------------------------------------


def test_the_audit_trail_is_newest_first_and_filtered_by_target(staff_client, staff, chat_feature, local):
    AuditEntry.objects.create(actor=staff, action="update", target="feature chat", field="enabled", before="yes", after="no")
    AuditEntry.objects.create(actor=staff, action="update", target="provider local", field="monthly_limit", before="no cap", after="$5.00")

    response = staff_client.get(reverse("staff-audit"))
    assert [e.target for e in response.context["page"]] == ["provider local", "feature chat"]
    html = response.content.decode()
    assert "no cap" in html and "$5.00" in html and "staff" in html

    filtered = staff_client.get(reverse("staff-audit"), {"target": "feature"})
    assert [e.target for e in filtered.context["page"]] == ["feature chat"]


def test_the_audit_trail_is_paginated(staff_client, staff):
    AuditEntry.objects.bulk_create(
        AuditEntry(actor=staff, action="update", target=f"feature f{n}", field="enabled", before="yes", after="no") for n in range(60)
    )
    response = staff_client.get(reverse("staff-audit"))
    assert len(response.context["page"]) == 50 and "Older →" in response.content.decode()


# --- markup in names is text ---------------------------------------------------------------------


def test_markup_in_names_and_descriptions_is_escaped(staff_client, local):
    feature = Feature.objects.create(name="bold", description="<b>x</b>")
    person = User.objects.create_user("<script>alert(1)</script>")
    log(person, feature, tokens=5, cost=1)
    AuditEntry.objects.create(action="update", target="quota <script>alert(1)</script>/all/day", field="max_tokens",
                              before="<i>1</i>", after="2")

    pages = [
        reverse("staff-features"),
        reverse("staff-users"),
        reverse("staff-user", args=[person.pk]),
        reverse("staff-feature", args=[feature.pk]),
        reverse("staff-audit"),
    ]
    html = "".join(staff_client.get(url).content.decode() for url in pages)

    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<i>1</i>" not in html


def test_every_page_makes_a_bounded_number_of_queries(staff_client, staff, alice, django_assert_max_num_queries):
    providers = [Provider.objects.create(name=f"prov{n}") for n in range(4)]
    for n in range(12):
        feature = Feature.objects.create(name=f"feat{n}", provider=providers[n % 4])
        Quota.objects.create(feature=feature, period="day", max_requests=n)
        Quota.objects.create(user=alice, feature=feature, period="month", max_tokens=n)
        log(alice, feature, tokens=10, cost=1)
    for n, provider in enumerate(providers):
        for month in (1, 2, 3):
            ModelPrice.objects.create(provider=provider, model=f"m{n}", effective_from=datetime(2026, month, 1, tzinfo=ZoneInfo("UTC")))
    AuditEntry.objects.bulk_create(AuditEntry(actor=staff, action="update", target=f"t{n}", field="f") for n in range(60))

    pages = [
        reverse("staff-users"),
        reverse("staff-user", args=[alice.pk]),
        reverse("staff-defaults"),
        reverse("staff-features"),
        reverse("staff-feature", args=[Feature.objects.first().pk]),
        reverse("staff-providers"),
        reverse("staff-provider", args=[providers[0].pk]),
        reverse("staff-audit"),
    ]
    for url in pages:
        # session, user, then a handful of queries for the page itself, however many rows there are
        # (a feature's page: the feature, its aliases, one evaluation per weight variant, the provider
        # and fallback choices, the teams a document may be restricted to; a user's page: their keys,
        # teams and in-flight caps)
        with django_assert_max_num_queries(11):
            assert staff_client.get(url).status_code == 200


def test_a_long_price_history_is_paged_and_filtered_by_model(staff_client, local):
    start = datetime(2025, 1, 1, tzinfo=ZoneInfo("UTC"))
    ModelPrice.objects.bulk_create(
        ModelPrice(provider=local, model=f"model-{n % 2}", effective_from=start + timedelta(days=n)) for n in range(70)
    )
    url = reverse("staff-provider", args=[local.pk])

    first = staff_client.get(url)
    assert [row.state for row in first.context["prices"]][:3] == ["in force", "in force", ""]
    assert len(first.context["prices"]) == 50 and "Older →" in first.content.decode()
    second = staff_client.get(url, {"page": 2})
    assert {row.state for row in second.context["prices"]} == {""}

    only = staff_client.get(url, {"model": "model-1"})
    assert {row.price.model for row in only.context["prices"]} == {"model-1"}
    assert [row.state for row in only.context["prices"]].count("in force") == 1

    # With many known models the error names a few, not all of them.
    ModelPrice.objects.bulk_create(ModelPrice(provider=local, model=f"x-{n:02d}", effective_from=start) for n in range(20))
    response = staff_client.post(url, price_data(model="nope"))
    assert "and 18 more" in response.content.decode()  # the local model's 3 variant names are known too


def test_an_openai_compatible_provider_needs_its_server_url(staff_client):
    data = provider_data(Provider(name="vllm", kind="openai-compatible"), api_key_env="not a variable name")
    del data["form"]
    response = staff_client.post(reverse("staff-providers"), data)
    html = response.content.decode()
    assert "needs the URL of its server" in html and "capital letters, digits and _" in html
    assert not Provider.objects.filter(name="vllm").exists()
