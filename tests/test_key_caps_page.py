"""An API key's own caps in the browser: its owner may set or lower them, only staff may raise or
remove one, nobody else sees them; every change is audited."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from accounts.actions import do_create_api_key
from budgets.models import AuditEntry

pytestmark = pytest.mark.django_db


@pytest.fixture
def key(alice):
    return do_create_api_key(alice, "ci")[0]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(client: Client, key, **boxes):
    data = {"max_requests_per_day": "", "max_cost_per_day_usd": "", "max_cost_per_month_usd": "", **boxes}
    return client.post(reverse("api-key-caps", args=[key.pk]), data)


def test_the_owner_sets_caps_and_lowers_them_and_sees_them_on_the_keys_page(alice, key):
    client = logged_in(alice)
    assert post(client, key, max_requests_per_day="100", max_cost_per_month_usd="20").url == reverse("api-keys")
    assert post(client, key, max_requests_per_day="50", max_cost_per_month_usd="20").status_code == 302
    key.refresh_from_db()
    assert (key.max_requests_per_day, key.max_cost_per_month_micro_usd) == (50, 20_000_000)
    page = client.get(reverse("api-keys")).content.decode()
    assert "50 req/day" in page and "$20.00/month" in page
    trail = list(AuditEntry.objects.order_by("id").values_list("actor", "field", "before", "after"))
    assert trail == [
        (alice.pk, "max_requests_per_day", "no cap", "100"),
        (alice.pk, "max_cost_per_month", "no cap", "$20.00"),
        (alice.pk, "max_requests_per_day", "100", "50"),
    ]


def test_the_owner_cannot_raise_or_remove_a_cap(alice, key):
    key.max_requests_per_day = 10
    key.save()
    client = logged_in(alice)
    for raised in ("11", ""):
        response = post(client, key, max_requests_per_day=raised)
        assert response.status_code == 200
        assert "You can only lower this cap" in response.content.decode()
    key.refresh_from_db()
    assert key.max_requests_per_day == 10


def test_staff_may_raise_and_remove_a_keys_cap(staff, alice, key):
    key.max_requests_per_day = 10
    key.save()
    assert post(logged_in(staff), key, max_requests_per_day="", max_cost_per_day_usd="5").status_code == 302
    key.refresh_from_db()
    assert (key.max_requests_per_day, key.max_cost_per_day_micro_usd) == (None, 5_000_000)
    assert reverse("api-key-caps", args=[key.pk]) in logged_in(staff).get(reverse("staff-user", args=[alice.pk])).content.decode()


def test_someone_elses_key_is_a_404(bob, key):
    assert logged_in(bob).get(reverse("api-key-caps", args=[key.pk])).status_code == 404
    assert post(logged_in(bob), key, max_requests_per_day="1").status_code == 404
