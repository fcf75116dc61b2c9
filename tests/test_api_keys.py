"""API keys: stored only as a hash, shown once, revocable by their owner and no one else."""

from __future__ import annotations

import hashlib
import io

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client

from accounts.actions import do_create_api_key, do_revoke_api_key
from accounts.models import ApiKey

pytestmark = pytest.mark.django_db


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def create_api_key(*args) -> list[str]:
    out = io.StringIO()
    call_command("create_api_key", *args, stdout=out)
    return out.getvalue().strip().splitlines()


def test_a_key_is_stored_only_as_its_hash(alice):
    key, plaintext = do_create_api_key(alice, "notebook")

    assert plaintext.startswith("ck_") and len(plaintext) > 40
    assert key.hashed_key == hashlib.sha256(plaintext.encode()).hexdigest()
    assert key.prefix == plaintext[:8]
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM accounts_apikey")
        stored = repr(cursor.fetchall())
    assert plaintext not in stored and plaintext[8:] not in stored


def test_only_an_active_key_is_found_by_its_text(alice, bob):
    key, plaintext = do_create_api_key(alice, "notebook")
    _, bobs = do_create_api_key(bob, "script")

    assert ApiKey.objects.for_plaintext(plaintext) == key
    assert ApiKey.objects.for_plaintext(plaintext + "x") is None
    assert ApiKey.objects.for_plaintext("sk-" + plaintext[3:]) is None
    assert do_revoke_api_key(key) and not do_revoke_api_key(key)
    assert ApiKey.objects.for_plaintext(plaintext) is None

    bob.is_active = False
    bob.save(update_fields=["is_active"])
    assert ApiKey.objects.for_plaintext(bobs) is None


def test_the_page_shows_a_new_key_once(alice):
    client = logged_in(alice)

    created = client.post("/accounts/keys/", {"name": "notebook"})
    key = ApiKey.objects.get(user=alice)
    plaintext = created.context["created"]["plaintext"]
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    assert plaintext in created.content.decode()
    assert ApiKey.objects.for_plaintext(plaintext) == key

    again = client.get("/accounts/keys/").content.decode()
    assert plaintext not in again
    assert "notebook" in again and f"{key.prefix}…" in again


def test_a_key_needs_a_name(alice):
    response = logged_in(alice).post("/accounts/keys/", {"name": "  "})
    assert response.status_code == 200 and "This field is required" in response.content.decode()
    assert not ApiKey.objects.exists()


def test_the_owner_revokes_a_key_on_the_page(alice):
    key, plaintext = do_create_api_key(alice, "notebook")
    client = logged_in(alice)

    response = client.post(f"/accounts/keys/{key.pk}/revoke/", follow=True)

    assert response.redirect_chain == [("/accounts/keys/", 302)]
    assert "Revoked the key &#x27;notebook&#x27;" in response.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert ApiKey.objects.for_plaintext(plaintext) is None
    assert client.get(f"/accounts/keys/{key.pk}/revoke/").status_code == 405


def test_another_users_key_is_not_found(alice, bob):
    bobs_key, bobs_plaintext = do_create_api_key(bob, "bobs-secret-script")
    client = logged_in(alice)

    assert client.post(f"/accounts/keys/{bobs_key.pk}/revoke/").status_code == 404
    assert ApiKey.objects.for_plaintext(bobs_plaintext) == bobs_key
    page = client.get("/accounts/keys/").content.decode()
    assert "bobs-secret-script" not in page and bobs_key.prefix not in page


def test_anonymous_users_are_sent_to_log_in(alice):
    key, _ = do_create_api_key(alice, "notebook")
    client = Client()

    for response in (client.get("/accounts/keys/"), client.post(f"/accounts/keys/{key.pk}/revoke/")):
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/?next=")
    assert ApiKey.objects.get().revoked_at is None


def test_the_nav_links_to_the_keys_page(alice):
    assert 'href="/accounts/keys/">API keys</a>' in logged_in(alice).get("/accounts/keys/").content.decode()


def test_create_api_key_prints_the_key_as_its_last_line(alice):
    lines = create_api_key("alice", "--name", "nightly job")

    key = ApiKey.objects.for_plaintext(lines[-1])
    assert key is not None and key.user == alice and key.name == "nightly job"
    assert len(lines) > 1 and lines[-1] not in "\n".join(lines[:-1])
    assert ApiKey.objects.for_plaintext(create_api_key("alice")[-1]).name == "default"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nobody"], "no user named 'nobody'"),
        (["alice", "--name", ""], "1 to 100 characters"),
        ([], "the following arguments are required: username"),
    ],
)
def test_create_api_key_refuses_nonsense(alice, args, message):
    with pytest.raises(CommandError, match=message):
        create_api_key(*args)
    assert not ApiKey.objects.exists()


def test_a_key_used_again_within_the_minute_costs_no_write(alice):
    from datetime import timedelta

    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from accounts.actions import do_touch_api_key

    key, plaintext = do_create_api_key(alice, "notebook")
    do_touch_api_key(ApiKey.objects.for_plaintext(plaintext))
    first_use = ApiKey.objects.get(pk=key.pk).last_used_at
    assert first_use is not None

    # Each request authenticates afresh; the row it read says the use is recorded already.
    with CaptureQueriesContext(connection) as queries:
        do_touch_api_key(ApiKey.objects.for_plaintext(plaintext))
    assert len(queries) == 1 and queries[0]["sql"].startswith("SELECT")
    assert ApiKey.objects.get(pk=key.pk).last_used_at == first_use

    ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now() - timedelta(minutes=2))
    do_touch_api_key(ApiKey.objects.for_plaintext(plaintext))
    assert ApiKey.objects.get(pk=key.pk).last_used_at > first_use
