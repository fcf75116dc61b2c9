"""API keys with a scope and a life, in the browser and on the command line: the features a key may
use (its owner narrows them, staff set them), an expiry set at creation, rotation with a grace period,
and when and from where a key was last used. Every change of scope and every rotation is audited.
(What /v1 answers such a key: tests/test_key_scope_api.py.)"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from accounts.actions import do_create_api_key, do_revoke_api_key, do_touch_api_key
from accounts.models import ApiKey
from budgets.actions import KeyNotRotatable, do_rotate_api_key
from budgets.models import AuditEntry, Feature

pytestmark = pytest.mark.django_db


@pytest.fixture
def features(chat_feature):
    return [chat_feature, Feature.objects.create(name="summary"), Feature.objects.create(name="search")]


@pytest.fixture
def key(alice):
    return do_create_api_key(alice, "ci")[0]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post_scope(client: Client, key, features: list[str], **boxes):
    data = {"max_requests_per_day": "", "max_cost_per_day_usd": "", "max_cost_per_month_usd": "",
            "allowed_features": features, **boxes}
    return client.post(reverse("api-key-caps", args=[key.pk]), data)


def command(name: str, *args) -> list[str]:
    out = io.StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue().strip().splitlines()


# --- scope --------------------------------------------------------------------------------------


def test_a_new_key_may_use_every_feature(key, features):
    assert key.allowed_features == [] and key.scope_text == "all features"
    assert all(key.allows(feature.name) for feature in features)


def test_the_owner_narrows_a_keys_features_and_each_change_is_audited(alice, key, features):
    client = logged_in(alice)
    assert post_scope(client, key, ["chat", "summary"]).url == reverse("api-keys")
    assert post_scope(client, key, ["summary"]).status_code == 302

    key.refresh_from_db()
    assert key.allowed_features == ["summary"] and key.allows("summary") and not key.allows("chat")
    assert "summary" in client.get(reverse("api-keys")).content.decode()
    trail = list(AuditEntry.objects.order_by("id").values_list("actor", "target", "field", "before", "after"))
    assert trail == [
        (alice.pk, f"api key {key.pk} (alice/ci)", "allowed_features", "all features", "chat, summary"),
        (alice.pk, f"api key {key.pk} (alice/ci)", "allowed_features", "chat, summary", "summary"),
    ]


@pytest.mark.parametrize("widened", [["summary", "search"], ["search"], []])
def test_the_owner_cannot_widen_a_keys_features(alice, key, features, widened):
    key.allowed_features = ["summary"]
    key.save()

    response = post_scope(logged_in(alice), key, widened)

    assert response.status_code == 200
    assert "You can only narrow the key&#x27;s features" in response.content.decode()
    key.refresh_from_db()
    assert key.allowed_features == ["summary"] and not AuditEntry.objects.exists()


def test_staff_may_widen_a_keys_features_back_to_all(staff, alice, key, features):
    key.allowed_features = ["summary"]
    key.save()

    assert post_scope(logged_in(staff), key, []).url == reverse("staff-user", args=[alice.pk])

    key.refresh_from_db()
    assert key.allowed_features == [] and AuditEntry.objects.get().after == "all features"
    page = logged_in(staff).get(reverse("staff-user", args=[alice.pk])).content.decode()
    assert "may use all features" in page


def test_a_feature_that_does_not_exist_cannot_be_allowed(alice, key, features):
    response = post_scope(logged_in(alice), key, ["no-such-feature"])
    assert response.status_code == 200 and "Select a valid choice" in response.content.decode()
    key.refresh_from_db()
    assert key.allowed_features == []


# --- expiry -------------------------------------------------------------------------------------


def test_a_key_created_on_the_page_may_be_given_a_life(alice):
    before = timezone.now()
    response = logged_in(alice).post(reverse("api-keys"), {"name": "trial", "expires_in_days": "30"})

    key = ApiKey.objects.get(user=alice)
    assert response.status_code == 200 and response.context["created"]["key"] == key
    assert before + timedelta(days=30) <= key.expires_at <= timezone.now() + timedelta(days=30)
    assert "expires " + timezone.localtime(key.expires_at).strftime("%Y-%m-%d") in logged_in(alice).get(reverse("api-keys")).content.decode()


@pytest.mark.parametrize("days", ["0", "-1", "3651", "soon"])
def test_the_page_refuses_a_nonsense_life(alice, days):
    response = logged_in(alice).post(reverse("api-keys"), {"name": "trial", "expires_in_days": days})
    assert response.status_code == 200 and response.context["created"] is None
    assert not ApiKey.objects.exists()


def test_create_api_key_takes_a_life_in_days(alice):
    lines = command("create_api_key", "alice", "--expires-in-days", "7")

    key = ApiKey.objects.for_plaintext(lines[-1])
    assert key is not None and "valid until" in lines[0]
    assert timedelta(days=7) - timedelta(minutes=1) < key.expires_at - timezone.now() <= timedelta(days=7)


@pytest.mark.parametrize("days", ["0", "4000", "x"])
def test_create_api_key_refuses_a_nonsense_life(alice, days):
    with pytest.raises(CommandError, match="expires-in-days"):
        command("create_api_key", "alice", "--expires-in-days", days)
    assert not ApiKey.objects.exists()


def test_an_expired_key_is_no_longer_active_but_is_still_found_to_say_so(alice):
    key, plaintext = do_create_api_key(alice, "old", expires_at=timezone.now() - timedelta(seconds=1))

    assert ApiKey.objects.for_plaintext(plaintext) == key and key.is_expired()
    assert not key.is_active and not ApiKey.objects.active().exists()
    page = logged_in(alice).get(reverse("api-keys")).content.decode()
    assert "expired " in page and reverse("api-key-rotate", args=[key.pk]) not in page


# --- rotation -----------------------------------------------------------------------------------


def test_the_owner_rotates_a_key_the_new_one_is_shown_once_and_both_are_audited(alice, key, features):
    key.max_requests_per_day, key.allowed_features = 50, ["summary"]
    key.save()
    client = logged_in(alice)

    response = client.post(reverse("api-key-rotate", args=[key.pk]), {"grace_hours": "2"})

    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    plaintext = response.context["plaintext"]
    new = ApiKey.objects.for_plaintext(plaintext)
    assert plaintext in response.content.decode()
    assert (new.name, new.max_requests_per_day, new.allowed_features, new.rotated_from) == ("ci", 50, ["summary"], key)
    assert new.expires_at is None
    key.refresh_from_db()
    assert timedelta(hours=2) - timedelta(minutes=1) < key.expires_at - timezone.now() <= timedelta(hours=2)
    assert key.is_active  # still working, for the grace period
    trail = list(AuditEntry.objects.order_by("id").values_list("actor", "action", "target", "field", "before"))
    assert trail == [
        (alice.pk, "create", f"api key {new.pk} (alice/ci)", "rotated_from", ""),
        (alice.pk, "update", f"api key {key.pk} (alice/ci)", "expires_at", "never"),
    ]
    again = client.get(reverse("api-keys")).content.decode()
    assert plaintext not in again and "rotated" in again


def test_rotation_never_lengthens_the_old_keys_life_and_the_new_key_keeps_the_policy(alice):
    created = timezone.now() - timedelta(days=89)
    key, _ = do_create_api_key(alice, "policy", expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=key.pk).update(created_at=created)

    new, _ = do_rotate_api_key(alice, key.pk, timedelta(hours=24))

    key.refresh_from_db()
    assert key.expires_at - timezone.now() <= timedelta(hours=1)  # not the 24 h asked for
    lifetime = timedelta(days=89, hours=1)
    assert abs(new.expires_at - (timezone.now() + lifetime)) < timedelta(minutes=1)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda key: do_revoke_api_key(key), "is revoked"),
        (lambda key: ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now()), "has expired"),
        (lambda key: do_rotate_api_key(None, key.pk, timedelta(hours=1)), "was rotated already"),
    ],
)
def test_it_refuses_to_rotate_a_key_that_no_longer_works_or_was_rotated(alice, key, spoil, message):
    spoil(key)
    before = ApiKey.objects.count()

    with pytest.raises(KeyNotRotatable, match=message):
        do_rotate_api_key(alice, key.pk, timedelta(hours=1))
    response = logged_in(alice).post(reverse("api-key-rotate", args=[key.pk]), {"grace_hours": "1"}, follow=True)
    assert message in response.content.decode()
    assert ApiKey.objects.count() == before


def test_nobody_else_rotates_a_key_on_the_page(bob, staff, key):
    for someone in (bob, staff):
        assert logged_in(someone).post(reverse("api-key-rotate", args=[key.pk]), {"grace_hours": "1"}).status_code == 404
    assert logged_in(bob).get(reverse("api-key-rotate", args=[key.pk])).status_code in (404, 405)
    assert ApiKey.objects.count() == 1 and not AuditEntry.objects.exists()


def test_the_page_refuses_a_nonsense_grace(alice, key):
    response = logged_in(alice).post(reverse("api-key-rotate", args=[key.pk]), {"grace_hours": "721"}, follow=True)
    assert "0 to 720 hours" in response.content.decode() and ApiKey.objects.count() == 1


def test_rotate_api_key_prints_the_new_key_last_and_gives_the_old_one_a_day(alice, key):
    lines = command("rotate_api_key", str(key.pk))

    new = ApiKey.objects.for_plaintext(lines[-1])
    assert new is not None and new.rotated_from == key and lines[-1] not in "\n".join(lines[:-1])
    key.refresh_from_db()
    assert timedelta(hours=23, minutes=59) < key.expires_at - timezone.now() <= timedelta(hours=24)
    assert AuditEntry.objects.filter(actor=None).count() == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [(["999999"], "no API key with id 999999"), (["KEY", "--grace-hours", "-1"], "0 to 720"),
     (["KEY", "--grace-hours", "721"], "0 to 720"), (["abc"], "invalid int value")],
)
def test_rotate_api_key_refuses_nonsense(key, args, message):
    with pytest.raises(CommandError, match=message):
        command("rotate_api_key", *[str(key.pk) if arg == "KEY" else arg for arg in args])
    assert ApiKey.objects.count() == 1


# --- last used ----------------------------------------------------------------------------------


def test_the_touch_records_the_address_with_the_time_at_most_once_a_minute(alice, key):
    plaintext_key = ApiKey.objects.get(pk=key.pk)
    do_touch_api_key(plaintext_key, "203.0.113.7")
    key.refresh_from_db()
    assert key.last_used_ip == "203.0.113.7" and key.last_used_at is not None

    with CaptureQueriesContext(connection) as queries:
        do_touch_api_key(key, "198.51.100.1")  # within the minute: no write, the first address stays
    assert len(queries) == 0
    key.refresh_from_db()
    assert key.last_used_ip == "203.0.113.7"


@pytest.mark.parametrize("address", ["", "unix:/run/daphne.sock", "999.1.1.1"])
def test_an_address_that_is_not_an_ip_is_not_stored(alice, key, address):
    do_touch_api_key(key, address)
    key.refresh_from_db()
    assert key.last_used_at is not None and key.last_used_ip is None


def test_the_owner_and_staff_see_when_and_where_a_key_was_last_used(alice, staff, key):
    do_touch_api_key(key, "2001:db8::5")
    for page in (logged_in(alice).get(reverse("api-keys")), logged_in(staff).get(reverse("staff-user", args=[alice.pk]))):
        assert "2001:db8::5" in page.content.decode()
