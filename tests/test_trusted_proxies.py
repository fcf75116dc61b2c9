"""Behind a reverse proxy the login throttle keys on the real client, not on the proxy every request
comes through; X-Forwarded-For is believed from CEILING_TRUSTED_PROXIES only."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, RequestFactory

from project.proxies import client_address, parse_trusted_proxies

pytestmark = pytest.mark.django_db

PROXY = "10.0.0.2"
MALLORY, ALICE = "203.0.113.7", "198.51.100.9"


@pytest.fixture
def behind_a_proxy(settings):
    settings.CEILING_TRUSTED_PROXIES = ["10.0.0.0/8", "::1"]


def via_proxy(client_ip: str, *, forwarded_by: str = PROXY, claimed: str = "") -> dict:
    chain = ", ".join(part for part in (claimed, client_ip) if part)
    return {"REMOTE_ADDR": forwarded_by, "HTTP_X_FORWARDED_FOR": chain}


def address_of(**meta) -> str:
    return client_address(RequestFactory().get("/", **meta))


def test_the_client_is_the_right_most_untrusted_forwarded_address(behind_a_proxy):
    assert address_of(**via_proxy(ALICE)) == ALICE
    # A client's own forged entries stand to the left of the address the proxy saw: never believed.
    assert address_of(**via_proxy(ALICE, claimed="1.2.3.4")) == ALICE
    # Two proxies of ours in a row: the first untrusted address from the right.
    assert address_of(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR=f"{ALICE}, 10.0.0.9") == ALICE


def test_a_forwarded_header_from_anyone_else_is_ignored(behind_a_proxy):
    assert address_of(REMOTE_ADDR=MALLORY, HTTP_X_FORWARDED_FOR=ALICE) == MALLORY
    assert address_of(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR="not-an-address") == PROXY


def test_without_trusted_proxies_the_header_is_never_read(settings):
    settings.CEILING_TRUSTED_PROXIES = []
    assert address_of(**via_proxy(ALICE)) == PROXY


def log_in(client: Client, password: str, meta: dict):
    return client.post("/accounts/login/", {"username": "alice", "password": password}, **meta)


def test_one_clients_bad_passwords_do_not_lock_everyone_behind_the_proxy_out(alice, behind_a_proxy):
    for _ in range(settings.AXES_FAILURE_LIMIT):
        log_in(Client(), "wrong", via_proxy(MALLORY))
    assert log_in(Client(), "alice-password-1", via_proxy(MALLORY)).status_code == 429  # mallory's address is locked
    assert log_in(Client(), "alice-password-1", via_proxy(ALICE)).status_code == 302  # alice, through the same proxy, is not


def test_without_the_setting_the_proxy_is_one_client_and_is_locked_as_one(alice, settings):
    """What happened before: every client behind the proxy shares its address, and its lockout."""
    settings.CEILING_TRUSTED_PROXIES = []
    for _ in range(settings.AXES_FAILURE_LIMIT):
        log_in(Client(), "wrong", via_proxy(MALLORY))
    assert log_in(Client(), "alice-password-1", via_proxy(ALICE)).status_code == 429


def test_nonsense_in_the_setting_refuses_to_start():
    with pytest.raises(ImproperlyConfigured, match="not an IP address or network"):
        parse_trusted_proxies(["10.0.0.0/8", "proxy.internal"])
