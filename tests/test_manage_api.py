"""The management API (/manage/v1/) over real HTTP (httpx against the live stack's daphne): staff tokens,
API keys for any user, quotas and windows at every scope, features' routing, usage with the staff
pages' numbers, every change audited as the pages audit it, and every refusal a JSON sentence."""

from __future__ import annotations

import io
import time

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from accounts.models import ApiKey
from budgets.models import AuditEntry, Feature, Period, Provider, Quota, TagQuota, Team, TeamMembership, TeamQuota
from control.actions import do_create_staff_token
from control.models import StaffToken

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "SmolLM2-135M-Instruct"
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def token(staff) -> str:
    return do_create_staff_token(staff, staff, "tests")[1]


@pytest.fixture
def manage(live_stack, token) -> httpx.Client:
    with httpx.Client(base_url=f"{live_stack.http_url}/manage/v1", headers={"Authorization": f"Bearer {token}"},
                      timeout=60) as client:
        yield client


@pytest.fixture
def v1(live_stack):
    def call(key: str, method: str = "GET", path: str = "/models", **kwargs) -> httpx.Response:
        return httpx.request(method, f"{live_stack.http_url}/v1{path}", headers={"Authorization": f"Bearer {key}"},
                             timeout=120, **kwargs)

    return call


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return response.json()["error"]


# --- API keys --------------------------------------------------------------------------------------


def test_staff_create_list_rotate_and_revoke_a_users_key_and_v1_follows(manage, v1, staff, alice, chat_feature):
    created = manage.post("/keys", json={"user": "alice", "name": "ci", "expires_in_days": 30})
    assert created.status_code == 201, created.text
    assert created.headers["cache-control"] == "no-store"
    new = created.json()
    assert new["user"] == "alice" and new["key"].startswith("ck_") and new["active"] and new["expires_at"]
    assert v1(new["key"]).status_code == 200

    listed = manage.get("/keys", params={"user": "alice"}).json()["keys"]
    assert [k["id"] for k in listed] == [new["id"]] and "key" not in listed[0] and "hashed_key" not in listed[0]
    assert listed[0]["last_used_at"] is not None  # the /v1 call above

    rotated = manage.post(f"/keys/{new['id']}/rotate", json={"grace_hours": 0})
    assert rotated.status_code == 201, rotated.text
    successor = rotated.json()["new"]
    assert successor["rotated_from"] == new["id"] and rotated.json()["old"]["active"] is False
    assert v1(successor["key"]).status_code == 200
    assert v1(new["key"]).status_code == 401  # no grace: the old text stopped at once
    again = manage.post(f"/keys/{new['id']}/rotate", json={})
    assert again.status_code == 409 and "expired" in error_of(again)["message"]

    revoked = manage.post(f"/keys/{successor['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert v1(successor["key"]).status_code == 401
    twice = manage.post(f"/keys/{successor['id']}/revoke")
    assert twice.status_code == 409 and error_of(twice)["code"] == "already_revoked"

    old, rotated_to = f"api key {new['id']} (alice/ci)", f"api key {successor['id']} (alice/ci)"
    trail = AuditEntry.objects.filter(actor=staff, target__startswith="api key")
    assert sorted(trail.values_list("target", "action", "field")) == sorted([
        (old, "create", "prefix"), (old, "create", "expires_at"),
        # the rotation's two rows, written by do_rotate_api_key as when the owner rotates on the keys page
        (rotated_to, "create", "rotated_from"), (old, "update", "expires_at"),
        (rotated_to, "update", "revoked_at"),
    ])


def test_a_keys_caps_and_features_are_set_as_on_its_caps_page(manage, v1, staff, alice, chat_feature):
    Feature.objects.create(name="summary")
    key = manage.post("/keys", json={"user": "alice", "name": "narrow"}).json()
    changed = manage.patch(f"/keys/{key['id']}/caps", json={"allowed_features": ["summary"], "max_cost_per_day_usd": "0.5"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["changes"] == 2
    assert changed.json()["key"]["caps"]["max_cost_per_day_micro_usd"] == 500_000
    refused = v1(key["key"], "POST", "/chat/completions", json=HELLO)  # routed to chat, outside the key's scope
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "feature_not_allowed"
    assert set(AuditEntry.objects.filter(actor=staff, target=f"api key {key['id']} (alice/narrow)", action="update")
               .values_list("field", flat=True)) == {"allowed_features", "max_cost_per_day"}

    bad = manage.patch(f"/keys/{key['id']}/caps", json={"allowed_features": ["nope"]})
    assert bad.status_code == 400 and error_of(bad)["field"] == "allowed_features"
    unknown = manage.patch(f"/keys/{key['id']}/caps", json={"max_tokens_per_year": 5})
    assert unknown.status_code == 400 and error_of(unknown)["field"] == "max_tokens_per_year"


# --- quotas and windows -------------------------------------------------------------------------


def wait_for_an_early_second() -> None:
    """Start a minute-window test in the first half of a minute, so the window cannot roll over mid-test."""
    second = time.time() % 60
    if second > 30:
        time.sleep(61 - second)


def test_a_minute_window_and_an_hour_quota_set_here_refuse_v1(manage, v1, staff, alice, chat_feature):
    plaintext = manage.post("/keys", json={"user": "alice", "name": "burst"}).json()["key"]

    wait_for_an_early_second()
    window = manage.put("/quotas", json={"scope": "user", "user": "alice", "period": "minute", "max_requests": 1})
    assert window.status_code == 200 and window.json()["changes"] >= 1
    assert v1(plaintext, "POST", "/chat/completions", json=HELLO).status_code == 200
    refused = v1(plaintext, "POST", "/chat/completions", json=HELLO)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "user_requests_per_minute"
    assert 0 < int(refused.headers["retry-after"]) <= 60

    assert manage.request("DELETE", "/quotas", json={"scope": "user", "user": "alice", "period": "minute"}).status_code == 200
    assert not Quota.objects.filter(user=alice, period=Period.MINUTE).exists()
    hour = manage.put("/quotas", json={"scope": "user", "user": "alice", "period": "hour", "max_tokens": 3})
    assert hour.status_code == 200
    refused = v1(plaintext, "POST", "/chat/completions", json=HELLO)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "user_tokens_per_hour", refused.text

    # As the user's page writes them (do_set_quota): a row of her own replaces the default, field by field.
    trail = AuditEntry.objects.filter(actor=staff, target__startswith="quota alice/all/")
    assert set(trail.values_list("target", "action")) == {
        ("quota alice/all/minute", "create"), ("quota alice/all/minute", "delete"), ("quota alice/all/hour", "create")}
    assert trail.get(target="quota alice/all/minute", action="create", field="max_requests").after == "1"
    assert trail.get(target="quota alice/all/hour", action="create", field="max_tokens").after == "3"
    listed = manage.get("/quotas").json()["quotas"]
    assert {"scope": "user", "user": "alice", "feature": None, "period": "hour", "max_requests": None, "max_tokens": 3,
            "max_cost_micro_usd": None, "max_cost_usd": None} in listed


def test_quotas_at_every_scope(manage, staff, alice, chat_feature):
    team = Team.objects.create(name="research")
    key = ApiKey.objects.get(pk=manage.post("/keys", json={"user": "alice", "name": "k"}).json()["id"])
    puts = [
        {"scope": "default", "period": "day", "max_requests": 100},
        {"scope": "default", "feature": "chat", "period": "hour", "max_tokens": 5000},
        {"scope": "user", "user": "alice", "feature": "chat", "period": "month", "max_cost_usd": "2.50"},
        {"scope": "team", "team": "research", "period": "minute", "max_requests": 30},
        {"scope": "team", "team": "research", "feature": "chat", "period": "day", "max_tokens": 10_000},
        {"scope": "api_key", "key": key.pk, "period": "day", "max_requests": 7, "max_cost_usd": 1},
        {"scope": "tag", "tag": "Support", "period": "month", "max_cost_usd": "3"},
    ]
    for body in puts:
        answer = manage.put("/quotas", json=body)
        assert answer.status_code == 200 and answer.json()["changes"] >= 1, (body, answer.text)
    assert Quota.objects.get(user=None, feature=None, period="day").max_requests == 100
    assert Quota.objects.get(user=None, feature=chat_feature, period="hour").max_tokens == 5000
    assert Quota.objects.get(user=alice, feature=chat_feature, period="month").max_cost_micro_usd == 2_500_000
    assert TeamQuota.objects.get(team=team, feature=None, period="minute").max_requests == 30
    assert TeamQuota.objects.get(team=team, feature=chat_feature, period="day").max_tokens == 10_000
    key.refresh_from_db()
    assert (key.max_requests_per_day, key.max_cost_per_day_micro_usd) == (7, 1_000_000)
    assert TagQuota.objects.get(tag="support").max_cost_micro_usd == 3_000_000
    assert AuditEntry.objects.filter(actor=staff, target="team quota research/all/minute", field="max_requests").exists()
    assert AuditEntry.objects.filter(actor=staff, target="tag quota support/month").exists()
    assert manage.put("/quotas", json=puts[0]).json() == {"changes": 0}  # the same again changes nothing

    # Requests in flight at once: a user's, everyone's default, a key's (on its caps)
    assert manage.put("/in-flight", json={"user": "alice", "max_in_flight": 2}).json() == {"changes": 1}
    assert manage.put("/in-flight", json={"max_in_flight": 8}).json() == {"changes": 1}
    assert {(row["scope"], row["max_in_flight"]) for row in manage.get("/in-flight").json()["in_flight"]} == {
        ("user", 2), ("default", 8)}
    assert manage.patch(f"/keys/{key.pk}/caps", json={"max_in_flight": 1}).json()["key"]["caps"]["max_in_flight"] == 1
    assert AuditEntry.objects.filter(actor=staff, target="in-flight cap alice", field="max_in_flight", after="2").exists()
    zero = manage.put("/in-flight", json={"user": "alice", "max_in_flight": 0})
    assert zero.status_code == 400 and error_of(zero)["field"] == "max_in_flight"
    assert manage.put("/in-flight", json={"user": "alice", "max_in_flight": None}).json() == {"changes": 1}

    refusals = [
        ({"scope": "planet", "period": "day"}, "scope"),
        ({"scope": "user", "user": "alice", "period": "week"}, "period"),
        ({"scope": "user", "user": "alice", "period": "day", "max_requests": -1}, "max_requests"),
        ({"scope": "user", "user": "alice", "period": "day", "max_cost_usd": "0.0000001"}, "max_cost_usd"),
        ({"scope": "user", "user": "alice", "period": "day", "max_request": 5}, "max_request"),
        ({"scope": "tag", "tag": "support", "period": "day", "max_cost_usd": 1}, "period"),
        ({"scope": "tag", "tag": "support", "period": "month", "max_requests": 1}, "max_requests"),
        ({"scope": "api_key", "key": key.pk, "period": "day", "max_tokens": 5}, "max_tokens"),
    ]
    for body, field in refusals:
        answer = manage.put("/quotas", json=body)
        assert answer.status_code == 400 and error_of(answer)["field"] == field, (body, answer.text)
        assert error_of(answer)["message"].endswith("."), answer.text
    for body, field in [({"scope": "user", "user": "nobody", "period": "day"}, "user"),
                        ({"scope": "team", "team": "nobody", "period": "day"}, "team"),
                        ({"scope": "default", "feature": "nope", "period": "day"}, "feature"),
                        ({"scope": "api_key", "key": 99999, "period": "day"}, "key")]:
        answer = manage.put("/quotas", json=body)
        assert answer.status_code == 404 and error_of(answer)["field"] == field, (body, answer.text)


# --- features' routing ----------------------------------------------------------------------------


def test_a_features_routing_changes_as_on_its_page(manage, v1, staff, alice, chat_feature):
    cheap = Provider.objects.create(name="cheap", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1",
                                    remote_model="tiny")
    plaintext = manage.post("/keys", json={"user": "alice", "name": "route"}).json()["key"]

    changed = manage.patch("/features/chat", json={"enabled": False, "backup_providers": ["cheap"],
                                                   "model_aliases": ["support-bot"]})
    assert changed.status_code == 200, changed.text
    feature = changed.json()["feature"]
    assert feature["enabled"] is False and feature["backup_providers"] == ["cheap"] and feature["model_aliases"] == ["support-bot"]
    refused = v1(plaintext, "POST", "/chat/completions", json=HELLO | {"model": "support-bot"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "feature_disabled", refused.text
    assert Feature.objects.get(pk=chat_feature.pk).backup_providers == [cheap.pk]
    assert set(AuditEntry.objects.filter(actor=staff, target="feature chat").values_list("field", "after")) == {
        ("enabled", "no"), ("backup_providers", "cheap"), ("model_aliases", "support-bot")}

    assert manage.patch("/features/chat", json={"enabled": True}).json()["feature"]["enabled"] is True
    assert v1(plaintext, "POST", "/chat/completions", json=HELLO | {"model": "support-bot"}).status_code == 200

    variant = manage.patch("/features/chat", json={"variant": "int8", "enabled": False})
    assert variant.status_code == 409 and error_of(variant)["field"] == "variant"
    assert "evaluation" in error_of(variant)["message"]
    assert Feature.objects.get(pk=chat_feature.pk).enabled is True  # all or nothing
    local = manage.patch("/features/chat", json={"backup_providers": ["nope"]})
    assert local.status_code == 400 and error_of(local)["field"] == "backup_providers"
    assert "no provider named 'nope'" in error_of(local)["message"]
    assert manage.patch("/features/chat", json={"provider": "ghost"}).status_code == 404
    assert manage.patch("/features/nope", json={"enabled": True}).status_code == 404
    assert manage.patch("/features/chat", json={"enabled": "yes"}).json()["error"]["field"] == "enabled"
    listed = manage.get("/features").json()["features"]
    assert [f["name"] for f in listed] == ["chat"] and listed[0]["model"] == MODEL
    assert "cheap" in [p["name"] for p in manage.get("/providers").json()["providers"]]


# --- usage: the staff pages' numbers --------------------------------------------------------------


def test_usage_is_what_the_staff_pages_show(manage, v1, staff, alice, chat_feature):
    team = Team.objects.create(name="ops")
    TeamMembership.objects.create(user=alice, team=team)
    plaintext = manage.post("/keys", json={"user": "alice", "name": "usage"}).json()["key"]
    manage.put("/quotas", json={"scope": "user", "user": "alice", "period": "day", "max_requests": 50})
    for _ in range(2):
        assert v1(plaintext, "POST", "/chat/completions", json=HELLO).status_code == 200

    page = Client()
    page.force_login(staff)
    summary = page.get(reverse("staff-user", args=[alice.pk])).context["summary"]
    usage = manage.get("/usage", params={"scope": "user", "user": "alice"}).json()
    for row, period in zip(summary, (Period.DAY, Period.MONTH), strict=True):
        shown = usage["periods"][period]
        assert [g.used for g in row["gauges"]] == [shown["requests"], shown["tokens"], shown["cost_micro_usd"]]
        assert [g.cap for g in row["gauges"]] == [shown["caps"]["max_requests"], shown["caps"]["max_tokens"],
                                                  shown["caps"]["max_cost_micro_usd"]]
    assert usage["periods"]["day"]["requests"] == 2 and usage["periods"]["day"]["caps"]["own"] is True

    team_rows = page.get(reverse("staff-teams")).context["rows"]
    team_usage = manage.get("/usage", params={"scope": "team", "team": "ops"}).json()["periods"]
    assert [g.used for g in team_rows[0].month] == [team_usage["month"][k] for k in ("requests", "tokens", "cost_micro_usd")]
    features = {f.name: f for f in page.get(reverse("staff-features")).context["features"]}
    feature_usage = manage.get("/usage", params={"scope": "feature", "feature": "chat"}).json()["periods"]["month"]
    assert features["chat"].month.requests == feature_usage["requests"] == 2
    assert features["chat"].month.tokens == feature_usage["tokens"]
    key_usage = manage.get("/usage", params={"scope": "api_key", "api_key": ApiKey.objects.get(name="usage").pk}).json()
    assert key_usage["periods"]["day"]["requests"] == 2
    for params, status in [({"scope": "galaxy"}, 400), ({"scope": "user"}, 400), ({"scope": "user", "user": "x"}, 404)]:
        assert manage.get("/usage", params=params).status_code == status


# --- who may call it --------------------------------------------------------------------------------


def test_only_an_active_staff_users_token_works(live_stack, manage, token, staff, alice):
    url = f"{live_stack.http_url}/manage/v1/keys"
    assert manage.get("/keys").status_code == 200
    assert StaffToken.objects.get(user=staff).last_used_at is not None

    for headers, code in [({}, "missing_token"), ({"Authorization": "Bearer cst_nope"}, "invalid_token"),
                          ({"Authorization": "Basic abc"}, "missing_token"),
                          ({"Authorization": "Bearer ck_an-api-key"}, "invalid_token")]:
        answer = httpx.get(url, headers=headers)
        assert answer.status_code == 401 and error_of(answer)["code"] == code
        assert answer.headers["www-authenticate"] == "Bearer"
    page = Client()
    page.force_login(staff)  # a staff session is not a token: the API never reads cookies
    cookie = settings.SESSION_COOKIE_NAME
    assert httpx.get(url, cookies={cookie: page.cookies[cookie].value}).status_code == 401

    User.objects.filter(pk=staff.pk).update(is_staff=False)
    destaffed = manage.get("/keys")
    assert destaffed.status_code == 403 and error_of(destaffed)["code"] == "not_staff"
    assert "'staff' is not staff" in error_of(destaffed)["message"]
    User.objects.filter(pk=staff.pk).update(is_staff=True, is_active=False)
    assert manage.get("/keys").status_code == 401
    User.objects.filter(pk=staff.pk).update(is_active=True)
    assert manage.get("/keys").status_code == 200


def test_a_revoked_token_stops_at_once_and_the_staff_page_manages_tokens(live_stack, manage, staff):
    page = Client()
    page.force_login(staff)
    created = page.post(reverse("staff-tokens"), {"name": "terraform"})
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    plaintext = created.context["created"]["plaintext"]
    assert plaintext.startswith("cst_") and plaintext in created.content.decode()
    assert plaintext not in page.get(reverse("staff-tokens")).content.decode()  # shown once
    headers = {"Authorization": f"Bearer {plaintext}"}
    assert httpx.get(f"{live_stack.http_url}/manage/v1/features", headers=headers).status_code == 200

    token = StaffToken.objects.get(name="terraform")
    assert page.post(reverse("staff-tokens"), {"revoke": token.pk}).status_code == 302
    assert httpx.get(f"{live_stack.http_url}/manage/v1/features", headers=headers).status_code == 401
    assert set(AuditEntry.objects.filter(target=token.audit_target).values_list("action", "field")) == {
        ("create", "name"), ("create", "prefix"), ("update", "revoked_at")}
    alice = User.objects.create_user("alice-page", password="alice-password-1")
    page.force_login(alice)
    assert page.get(reverse("staff-tokens")).status_code == 403


def test_create_staff_token_prints_the_token_last_and_refuses_non_staff(staff, alice):
    out = io.StringIO()
    call_command("create_staff_token", "staff", "--name", "cron", stdout=out)
    plaintext = out.getvalue().strip().splitlines()[-1]
    assert StaffToken.objects.for_plaintext(plaintext).user == staff
    with pytest.raises(CommandError, match="not an active staff user"):
        call_command("create_staff_token", "alice", "--name", "cron", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no user named"):
        call_command("create_staff_token", "nobody", "--name", "cron", stdout=io.StringIO())
    with pytest.raises(CommandError, match="1 to 100"):
        call_command("create_staff_token", "staff", "--name", " ", stdout=io.StringIO())


# --- bad requests ---------------------------------------------------------------------------------


def test_bad_bodies_methods_and_paths_are_json_sentences(live_stack, manage, token, alice):
    cases = [
        (manage.post("/keys", content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_json", None),
        (manage.post("/keys", content=b"[" * 150 + b"]" * 150), 400, "invalid_json", None),
        (manage.post("/keys", json=[1, 2]), 400, "invalid_json", None),
        (manage.post("/keys", json={"user": "alice"}), 400, "invalid_field", "name"),
        (manage.post("/keys", json={"user": "alice", "name": "x", "expires_in_days": 0}), 400, "invalid_field", "expires_in_days"),
        (manage.post("/keys", json={"user": "alice", "name": "x", "colour": "red"}), 400, "invalid_field", "colour"),
        (manage.post("/keys", json={"user": "ghost", "name": "x"}), 404, "not_found", "user"),
        (manage.post("/keys/424242/revoke"), 404, "not_found", "key"),
        (manage.post("/keys/1/rotate", json={"grace_hours": -1}), 404, "not_found", "key"),
        (manage.delete("/keys"), 405, "method_not_allowed", None),
        (manage.get("/nothing/here"), 404, "not_found", None),
    ]
    for answer, status, code, field in cases:
        error = error_of(answer)
        assert (answer.status_code, error["code"], error["field"]) == (status, code, field), answer.text
        assert error["message"].endswith("."), answer.text
    assert manage.delete("/keys").headers["allow"] == "GET, POST"
    too_large = manage.post("/keys", content=b'{"name": "' + b"x" * 70_000 + b'"}')
    assert too_large.status_code == 413 and error_of(too_large)["code"] == "request_too_large"
    User.objects.filter(pk=alice.pk).update(is_active=False)
    inactive = manage.post("/keys", json={"user": "alice", "name": "x"})
    assert inactive.status_code == 409 and "deactivated" in error_of(inactive)["message"]


# --- the OpenAPI document -------------------------------------------------------------------------


def _manage_routes() -> list[str]:
    """Every path the URLconf serves under /manage/v1/ (the catch-all for unknown paths left out)."""
    routes = []
    for entry in get_resolver().url_patterns:
        if isinstance(entry, URLResolver) and str(entry.pattern) == "manage/v1/":
            for pattern in entry.url_patterns:
                assert isinstance(pattern, URLPattern)
                route = str(pattern.pattern)
                if not route.startswith("<path:"):
                    routes.append("/manage/v1/" + route.replace("<int:", "{").replace("<str:", "{").replace(">", "}"))
    return routes


def test_the_openapi_document_lists_every_path_with_its_refusals(live_stack):
    answer = httpx.get(f"{live_stack.http_url}/manage/v1/openapi.json")  # no token: it holds no secrets
    assert answer.status_code == 200
    document = answer.json()
    assert document["openapi"] == "3.1.0"
    served = set(_manage_routes()) - {"/manage/v1/openapi.json"}
    assert served == set(document["paths"])
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert {"401", "403", "405"} <= set(operation["responses"]), (path, method)
            if "requestBody" in operation:
                assert {"400", "413"} <= set(operation["responses"]), (path, method)


# --- generated requests: never a 500, every answer documented ------------------------------------


def test_generated_requests_get_documented_answers_and_never_a_500(live_stack, token, alice, chat_feature):
    """Schemathesis draws well-formed and malformed requests for every operation of the document (as
    tests/test_api_fuzz.py does for /v1); each answer's status and content type must be documented."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

    from control.openapi import openapi_document

    schema = schemathesis.openapi.from_dict(openapi_document())
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    seen: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(GenerationMode.NEGATIVE))
    def fuzz(case):
        response = case.call(base_url=live_stack.http_url, session=session, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code != 500, f"{case.method} {case.formatted_path}: {response.text[:300]}"
        case.validate_response(response, checks=[status_code_conformance, content_type_conformance])

    fuzz()
    print("statuses:", dict(sorted(seen.items())))
    assert set(seen) & {200, 201} and set(seen) & {400, 404}
