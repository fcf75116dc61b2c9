"""Where Ceiling's own HTTP calls may go (budgets/outbound.py): provider servers and alert webhooks.

Metadata and link-local addresses never; loopback and private ones for providers, and for webhooks
only with CEILING_WEBHOOK_ALLOW_PRIVATE. Checked when staff save a URL and again when a connection
opens (a row written around the form, or DNS that changed); redirects are not followed; an error
body reaches the page short, on one line, escaped. The servers are real ones on loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client
from django.urls import reverse

from budgets.models import Alert, AlertWebhook, Provider, WebhookDelivery
from budgets.outbound import PROVIDER, WEBHOOK, OutboundRefused, check_address, check_url, error_excerpt
from budgets.webhooks import deliver_webhook, new_secret
from inference.worker.remote import open_stream

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


class Server:
    """A loopback HTTP server answering every POST with `status`, `body` and `headers`; counts the hits."""

    def __init__(self, status: int = 200, body: bytes = b"ok", headers: dict | None = None) -> None:
        self.status, self.body, self.headers, self.hits = status, body, headers or {}, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.hits += 1
                self.send_response(owner.status)
                for name, value in owner.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                self.wfile.write(owner.body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_port}/hook"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers() -> Iterator:
    started: list[Server] = []

    def make(**kwargs) -> Server:
        started.append(Server(**kwargs))
        return started[-1]

    yield make
    for server in started:
        server.stop()


def delivery_to(url: str) -> WebhookDelivery:
    """An alert and its delivery to a webhook at `url`, written past the form (as an old row would be)."""
    hook = AlertWebhook.objects.create(url=url, secret=new_secret())
    alert = Alert.objects.create(scope="provider:local", threshold=80, period_key="2026-12",
                                 spent_micro_usd=80, limit_micro_usd=100)
    return WebhookDelivery.objects.create(alert=alert, webhook=hook)


def attempt(delivery: WebhookDelivery) -> WebhookDelivery:
    try:
        deliver_webhook(delivery.id)
    except Exception:  # noqa: BLE001 - WebhookNotSent: the attempt is recorded on the row
        pass
    delivery.refresh_from_db()
    return delivery


# --- the rule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["169.254.169.254", "169.254.0.1", "fe80::1", "fe80::1%eth0",
                                     "100.100.100.200", "fd00:ec2::254", "::ffff:169.254.169.254"])
@pytest.mark.parametrize("purpose", [PROVIDER, WEBHOOK])
def test_it_refuses_link_local_and_metadata_addresses_for_everyone(address, purpose, settings):
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True  # not even then
    with pytest.raises(OutboundRefused, match="link-local or cloud metadata"):
        check_address(address, purpose)


@pytest.mark.parametrize("url", ["http://metadata.google.internal/computeMetadata/v1", "http://METADATA/x",
                                 "http://169.254.169.254/latest/meta-data", "http://[fe80::1]/"])
def test_it_refuses_metadata_urls_on_save(url):
    with pytest.raises(OutboundRefused):
        check_url(url, PROVIDER)


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.5", "192.168.1.1", "172.16.0.1", "100.64.0.1", "::1", "fd12::1", "0.0.0.0"])
def test_loopback_and_private_addresses_are_for_providers_and_for_webhooks_only_when_allowed(address, settings):
    check_address(address, PROVIDER)
    with pytest.raises(OutboundRefused, match="CEILING_WEBHOOK_ALLOW_PRIVATE"):
        check_address(address, WEBHOOK)
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    check_address(address, WEBHOOK)


def test_public_addresses_are_allowed():
    for address in ("8.8.8.8", "2606:4700:4700::1111"):
        check_address(address, PROVIDER)
        check_address(address, WEBHOOK)


def test_localhost_by_name_is_loopback():
    with pytest.raises(OutboundRefused):
        check_url("http://localhost:6379/", WEBHOOK)
    check_url("http://localhost:8000/v1", PROVIDER)


# --- on save ------------------------------------------------------------------------------------------


def test_the_provider_form_refuses_a_metadata_url(staff_client):
    data = {"name": "meta", "kind": "openai-compatible", "base_url": "http://169.254.169.254/latest/v1",
            "monthly_limit_usd": "", "thresholds": "50", "recipients": ""}
    html = staff_client.post(reverse("staff-providers"), data).content.decode()
    assert "This URL is not allowed: 169.254.169.254 is a link-local or cloud metadata address" in html
    assert not Provider.objects.filter(name="meta").exists()
    data.update(name="beside", base_url="http://127.0.0.1:8001/v1")  # a vLLM on this host: fine
    staff_client.post(reverse("staff-providers"), data)
    assert Provider.objects.filter(name="beside").exists()


def test_the_webhook_form_refuses_redis_on_loopback_unless_private_is_allowed(staff_client, settings):
    data = {"url": "http://127.0.0.1:6379/", "body_format": "json"}
    html = staff_client.post(reverse("staff-alerts"), data).content.decode()
    assert "This URL is not allowed: 127.0.0.1 is a loopback or private address" in html
    assert not AlertWebhook.objects.exists()
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    staff_client.post(reverse("staff-alerts"), data)
    assert AlertWebhook.objects.filter(url="http://127.0.0.1:6379/").exists()


# --- at connect time ------------------------------------------------------------------------------------


def test_a_webhook_saved_around_the_form_is_refused_when_it_connects(servers, settings):
    receiver = servers()
    delivery = attempt(delivery_to(receiver.url))
    assert receiver.hits == 0  # never reached
    assert delivery.sent_at is None and "refused by the outbound policy: 127.0.0.1 is a loopback" in delivery.last_error
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    for hook in AlertWebhook.objects.all():  # the same host by name resolves at connect time, and is allowed now
        hook.url = receiver.url.replace("127.0.0.1", "localhost")
        hook.save()
    WebhookDelivery.objects.filter(pk=delivery.pk).update(last_attempt_at=None, attempts=0)
    assert attempt(delivery).sent_at is not None and receiver.hits == 1


def test_a_provider_saved_around_the_form_is_refused_when_it_connects(redis_db):
    provider = Provider.objects.create(name="meta", kind=Provider.Kind.OPENAI_COMPATIBLE,
                                       base_url="http://169.254.169.254/v1")
    stream = open_stream("req-outbound-1", provider, "m", [{"role": "user", "content": "hi"}], 4)
    stream.start(read_timeout_s=5)
    end = list(stream.events(first_token_s=10, deadline_s=10))[-1]
    assert end.finish_reason == "error"
    assert "the remote provider 'meta' is refused by the outbound policy: 169.254.169.254 is a link-local" in end.error


# --- redirects and error bodies ----------------------------------------------------------------------------


def test_redirects_are_not_followed(servers, settings, redis_db):
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    target = servers()
    redirecting = servers(status=302, body=b"", headers={"Location": target.url})
    delivery = attempt(delivery_to(redirecting.url))
    assert (redirecting.hits, target.hits) == (1, 0)
    assert delivery.last_status_code == 302 and "redirects are not followed" in delivery.last_error

    provider = Provider.objects.create(name="moved", kind=Provider.Kind.OPENAI_COMPATIBLE,
                                       base_url=redirecting.url.removesuffix("/hook"))
    stream = open_stream("req-outbound-2", provider, "m", [{"role": "user", "content": "hi"}], 4)
    stream.start(read_timeout_s=5)
    end = list(stream.events(first_token_s=10, deadline_s=10))[-1]
    assert "answered with a redirect (HTTP 302), which is not followed" in end.error
    assert target.hits == 0


def test_an_error_body_reaches_staff_short_on_one_line_and_escaped(servers, settings, staff_client):
    settings.CEILING_WEBHOOK_ALLOW_PRIVATE = True
    hostile = b"<script>window.__xss=1</script>\x1b[31m" + b"x" * 100_000
    failing = servers(status=500, body=hostile)
    delivery = attempt(delivery_to(failing.url))
    assert delivery.last_error.startswith("HTTP 500: <script>window.__xss=1</script> [31mxxx")
    assert len(delivery.last_error) <= 220 and "\x1b" not in delivery.last_error
    page = staff_client.get(reverse("staff-webhook", args=[delivery.webhook_id])).content.decode()
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in page and "<script>window.__xss" not in page


def test_error_excerpt_keeps_short_text_whole():
    assert error_excerpt("  model\nnot   found ") == "model not found"
    assert len(error_excerpt("y" * 1000)) == 200
