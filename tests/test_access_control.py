"""Who may open what: every URL the resolver knows, for an anonymous visitor, an end user and staff.

The URLs are read from the resolver, not listed by hand: a new page under staff/ is checked as a
staff page the moment it exists, and any other new URL fails `test_every_url_has_an_access_rule`
until someone decides who may see it. Per-user data (keys, usage, batch jobs) is looked up by an id
in the URL only on staff pages or through the owner (`_get_key_for_user`), so changing an id never
shows another user's rows.
"""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from accounts.actions import do_create_api_key
from accounts.models import ApiKey
from budgets.models import AlertWebhook, Provider, Team, TokenLog
from inference.models import BatchJob

pytestmark = pytest.mark.django_db

# Who may open a URL, by its route (a regular expression over the joined route text).
PUBLIC = {
    r"^$", r"^accounts/login/$", r"^accounts/logout/$", r"^v1/openapi\.json$",
    r"^healthz$", r"^readyz$",  # probes of load balancers: states only, no names (tests/test_health.py)
    r"^\^v1\(",  # any other /v1 path: a JSON 404 for anyone, it shows nothing
    r"^manage/v1/openapi\.json$", r"^manage/v1/<path:rest>$",  # the management API's document, and its JSON 404
}
LOGGED_IN = {
    r"^chat/$",
    r"^chat/requests/<str:request_id>/$",
    r"^accounts/keys/$",
    r"^accounts/keys/<int:key_id>/revoke/$",
    r"^usage/$",
    r"^usage/keys/<int:key_id>/caps/$",  # the key's owner (or staff); anyone else gets a 404
    r"^usage/keys/<int:key_id>/rotate/$",  # the key's owner only (staff too get a 404: the new secret is theirs)
}
API_KEY = {r"^v1/chat/completions$", r"^v1/completions$", r"^v1/embeddings$", r"^v1/models$", r"^v1/models/<path:model>$"}
METRICS_TOKEN = {r"^metrics$"}
STAFF_TOKEN = {r"^manage/v1/"}  # the management API: a staff token (cst_…), never a session
STAFF = {r"^staff/"}
ADMIN = {r"^admin/"}  # Django's admin: its own login, staff (and permissions) only


def routes(patterns=None, prefix: str = "") -> list[str]:
    """Every route the resolver serves, as text ('staff/users/<int:user_id>/'); admin/ as one entry."""
    found = []
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver) and route != "admin/":
            found += routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern | URLResolver):
            found.append(route)
    return found


def rule_of(route: str) -> str | None:
    for name, rules in [("public", PUBLIC), ("logged_in", LOGGED_IN), ("api_key", API_KEY), ("metrics", METRICS_TOKEN), ("staff_token", STAFF_TOKEN), ("staff", STAFF), ("admin", ADMIN)]:
        if any(re.search(rule, route) for rule in rules):
            return name
    return None


@pytest.fixture
def objects(alice, staff, chat_feature):
    """One real object for each id a URL takes, so staff get the page itself rather than a 404."""
    provider = Provider.objects.create(name="local")
    job = BatchJob.objects.create(feature=chat_feature, user=alice, total=0)
    key, _ = do_create_api_key(alice, "notebook")
    row = alices_request(alice, chat_feature)
    hook = AlertWebhook.objects.create(provider=provider, url="http://127.0.0.1:9/hook", secret="s")
    team = Team.objects.create(name="Support")
    return {
        "user_id": alice.pk, "feature_id": chat_feature.pk, "provider_id": provider.pk, "job_id": job.pk,
        "key_id": key.pk, "request_id": row.request_id, "webhook_id": hook.pk, "team_id": team.pk,
    }


def alices_request(alice, feature) -> TokenLog:
    from django.utils import timezone

    return TokenLog.objects.create(
        request_id="alice-secret-request", user=alice, feature=feature, model="m", status=TokenLog.Status.OK,
        prompt_tokens=777_001, completion_tokens=1, created_at=timezone.now(),
    )


def concrete(route: str, objects: dict) -> str:
    return "/" + re.sub(r"<(?:int|str):(\w+)>", lambda match: str(objects[match.group(1)]), route)


def client_for(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def test_every_url_has_an_access_rule():
    unclassified = [route for route in routes() if rule_of(route) is None]
    assert not unclassified, f"decide who may open these and add them to a rule above: {unclassified}"
    assert len(routes()) >= 20


def test_every_staff_page_sends_anonymous_visitors_to_log_in_and_refuses_end_users(objects, alice, staff):
    staff_routes = [route for route in routes() if rule_of(route) == "staff"]
    assert len(staff_routes) >= 15
    for route in staff_routes:
        url = concrete(route, objects)
        anonymous = client_for(None).get(url)
        assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/?next="), url
        assert client_for(alice).get(url).status_code == 403, url
        assert client_for(alice).post(url, {}).status_code == 403, url  # no write slips past on POST either
        assert client_for(staff).get(url).status_code == 200, url


def test_every_logged_in_page_sends_anonymous_visitors_to_log_in(objects, alice):
    for route in [route for route in routes() if rule_of(route) == "logged_in"]:
        url = concrete(route, objects)
        post_only = url.endswith(("/revoke/", "/rotate/"))
        response = client_for(None).post(url) if post_only else client_for(None).get(url)
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/?next="), url
        if not post_only:
            assert client_for(alice).get(url).status_code == 200, url


def test_the_admin_lets_in_only_staff(alice, staff):
    assert client_for(None).get("/admin/")["Location"].startswith("/admin/login/")
    assert client_for(alice).get("/admin/")["Location"].startswith("/admin/login/")
    assert client_for(staff).get("/admin/").status_code == 200


def test_the_management_api_takes_only_staff_tokens_never_a_session(objects, alice, staff):
    # Staff's own browser session opens nothing here either: it is CSRF-exempt, so only the Bearer token counts.
    for route in [route for route in routes() if rule_of(route) == "staff_token"]:
        url = concrete(route.replace("<str:name>", "chat"), objects)
        for user in (None, alice, staff):
            response = client_for(user).get(url)
            assert response.status_code in (401, 405) and response["Content-Type"] == "application/json", (url, user)
            if response.status_code == 401:
                assert response.json()["error"]["code"] == "missing_token", (url, user)


def test_the_api_takes_only_api_keys_never_a_session(alice, staff):
    # A logged-in browser must not be able to call /v1 (it is CSRF-exempt): only the Bearer key counts.
    for route in [route for route in routes() if rule_of(route) == "api_key"]:
        for user in (None, alice, staff):
            client = client_for(user)
            response = client.post("/" + route, "{}", content_type="application/json") if "completions" in route else client.get("/" + route)
            assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key", (route, user)


def test_metrics_need_their_token(settings):
    settings.CEILING_METRICS_TOKEN = "scrape-token"
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "Bearer scrape-token"}).status_code == 200


def test_changing_the_key_id_never_revokes_another_users_key(alice, bob):
    key, _ = do_create_api_key(alice, "alices-private-key")
    for method in ("get", "post"):
        response = getattr(client_for(bob), method)(f"/accounts/keys/{key.pk}/revoke/")
        assert response.status_code in (404, 405)
    assert ApiKey.objects.get(pk=key.pk).is_active
    for method in ("get", "post"):
        assert getattr(client_for(bob), method)(f"/usage/keys/{key.pk}/rotate/").status_code in (404, 405)
    assert ApiKey.objects.count() == 1
    page = client_for(bob).get("/accounts/keys/").content.decode()
    assert "alices-private-key" not in page and key.prefix not in page


def test_changing_the_request_id_never_shows_another_users_transcript(alice, bob, chat_feature):
    row = alices_request(alice, chat_feature)
    assert client_for(alice).get(f"/chat/requests/{row.request_id}/").json()["request_id"] == row.request_id
    assert client_for(bob).get(f"/chat/requests/{row.request_id}/").status_code == 404
    assert client_for(bob).get("/chat/requests/no-such-request/").status_code == 404  # the same answer


def test_the_usage_page_shows_only_ones_own_requests_whatever_the_query(alice, bob, chat_feature):
    alices_request(alice, chat_feature)
    for query in ("", f"?user={alice.pk}", f"?user_id={alice.pk}", "?user=alice"):
        page = client_for(bob).get(f"/usage/{query}").content.decode()
        assert "777,00" not in page and "777002" not in page and "alice" not in page, query


def test_an_end_user_cannot_open_their_own_batch_job_by_id_on_staff_pages(objects, alice):
    job_id = objects["job_id"]
    for url in (f"/staff/batches/{job_id}/", f"/staff/batches/{job_id}/progress"):
        assert client_for(alice).get(url).status_code == 403
