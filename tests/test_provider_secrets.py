"""A provider's API key: typed once by staff, kept encrypted, sent only as the Bearer header to the provider.

The env-variable route is limited to CEILING_PROVIDER_KEY_*, by the form and again by the worker,
so no staff form can make a worker send the server's own secrets (SECRET_KEY, DATABASE_URL) out.
The HTTP server is a real one on loopback; the worker's code path is remote.open_stream, as a task runs it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography.fernet import Fernet
from django.apps import apps as django_apps
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from budgets import vault
from budgets.models import AuditEntry, Provider
from inference.worker.remote import RemoteConfigError, open_stream

pytestmark = pytest.mark.django_db(transaction=True)

THE_KEY = "sk-provider-secret-4711-do-not-show"


@pytest.fixture
def secrets_key(settings) -> str:
    settings.CEILING_SECRETS_KEY = Fernet.generate_key().decode()
    return settings.CEILING_SECRETS_KEY


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


@pytest.fixture
def remote(transactional_db) -> Provider:
    return Provider.objects.create(name="gpu-farm", kind=Provider.Kind.OPENAI_COMPATIBLE,
                                   base_url="http://127.0.0.1:9/v1", remote_model="llama")


def provider_data(provider: Provider, **changes) -> dict:
    return {"form": "provider", "name": provider.name, "kind": provider.kind, "base_url": provider.base_url,
            "remote_model": provider.remote_model, "monthly_limit_usd": "", "thresholds": "50, 80, 100",
            "recipients": "", **changes}


class Recorder(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers one streamed chunk and remembers the headers it got."""

    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Recorder.seen.append(dict(self.headers))
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def loopback_server() -> Iterator[str]:
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


def stream_once(provider: Provider) -> list:
    stream = open_stream("req-secrets-1", provider, "llama", [{"role": "user", "content": "hi"}], 4)
    stream.start(read_timeout_s=10)
    return list(stream.events(first_token_s=10, deadline_s=20))


@pytest.mark.parametrize("name", ["SECRET_KEY", "DATABASE_URL", "CEILING_SECRETS_KEY", "VLLM_KEY"])
def test_the_form_refuses_a_key_variable_outside_the_prefix(staff_client, remote, name):
    response = staff_client.post(reverse("staff-provider", args=[remote.pk]), provider_data(remote, api_key_env=name))
    html = response.content.decode()
    assert "Only variables whose names start with CEILING_PROVIDER_KEY_ can hold a provider" in html
    remote.refresh_from_db()
    assert remote.api_key_env == ""


def test_the_form_takes_a_variable_under_the_prefix(staff_client, remote):
    staff_client.post(reverse("staff-provider", args=[remote.pk]), provider_data(remote, api_key_env="CEILING_PROVIDER_KEY_FARM"))
    remote.refresh_from_db()
    assert remote.api_key_env == "CEILING_PROVIDER_KEY_FARM"


def test_the_worker_refuses_a_variable_outside_the_prefix_at_use(remote, monkeypatch):
    # A row written around the form (an old row, the admin, a script) is refused by the worker too.
    Provider.objects.filter(pk=remote.pk).update(api_key_env="SECRET_KEY")
    remote.refresh_from_db()
    with pytest.raises(RemoteConfigError, match="only variables starting CEILING_PROVIDER_KEY_ are read"):
        open_stream("req-secrets-0", remote, "llama", [{"role": "user", "content": "hi"}], 4)


def test_a_stored_key_reaches_the_server_as_the_bearer_header_and_is_never_rendered(
    staff_client, remote, secrets_key, loopback_server, redis_db
):
    url = reverse("staff-provider", args=[remote.pk])
    response = staff_client.post(url, provider_data(remote, base_url=loopback_server, api_key=THE_KEY), follow=True)
    assert response.status_code == 200
    remote.refresh_from_db()
    assert remote.has_api_key and THE_KEY not in remote.api_key_encrypted  # encrypted at rest
    assert vault.unseal(remote.api_key_encrypted) == THE_KEY

    page = staff_client.get(url).content.decode()
    assert THE_KEY not in page and remote.api_key_encrypted not in page
    assert "Currently set" in page
    # The audit trail says a key was set, never what it is.
    trail = list(AuditEntry.objects.filter(field="api_key_encrypted").values_list("before", "after"))
    assert trail == [("not set", "set")]

    events = stream_once(remote)
    assert events[-1].finish_reason == "stop" and events[-1].error is None
    assert Recorder.seen[0]["Authorization"] == f"Bearer {THE_KEY}"

    # Saving the page again without typing a key keeps it; the box asks for it to go.
    staff_client.post(url, provider_data(remote, base_url=loopback_server))
    remote.refresh_from_db()
    assert vault.unseal(remote.api_key_encrypted) == THE_KEY
    staff_client.post(url, provider_data(remote, base_url=loopback_server, clear_api_key="on"))
    remote.refresh_from_db()
    assert not remote.has_api_key


def test_it_refuses_to_store_a_key_without_a_secrets_key(staff_client, remote, settings):
    settings.CEILING_SECRETS_KEY = ""
    response = staff_client.post(reverse("staff-provider", args=[remote.pk]), provider_data(remote, api_key=THE_KEY))
    html = response.content.decode()
    assert "The key was not stored: CEILING_SECRETS_KEY is not set on this server" in html
    assert THE_KEY not in html  # not even echoed back into the password box
    remote.refresh_from_db()
    assert not remote.has_api_key


def test_a_key_stays_readable_across_a_rotation(remote, settings, loopback_server, redis_db):
    old = Fernet.generate_key().decode()
    settings.CEILING_SECRETS_KEY = old
    Provider.objects.filter(pk=remote.pk).update(api_key_encrypted=vault.seal(THE_KEY), base_url=loopback_server)
    new = Fernet.generate_key().decode()
    settings.CEILING_SECRETS_KEY = f"{new},{old}"  # the new key first: it encrypts, both decrypt
    call_command("rotate_secrets")
    remote.refresh_from_db()
    settings.CEILING_SECRETS_KEY = new  # the old key dropped after the rotation
    assert stream_once(remote)[-1].error is None
    assert Recorder.seen[0]["Authorization"] == f"Bearer {THE_KEY}"


def test_a_key_whose_secrets_key_was_dropped_is_refused_with_a_sentence(remote, settings):
    settings.CEILING_SECRETS_KEY = Fernet.generate_key().decode()
    Provider.objects.filter(pk=remote.pk).update(api_key_encrypted=vault.seal(THE_KEY))
    remote.refresh_from_db()
    settings.CEILING_SECRETS_KEY = Fernet.generate_key().decode()
    with pytest.raises(RemoteConfigError, match="stored API key cannot be read on this worker"):
        open_stream("req-secrets-2", remote, "llama", [{"role": "user", "content": "hi"}], 4)


def test_the_migration_moves_what_it_can_and_never_a_server_secret(remote, secrets_key, monkeypatch, capsys):
    migration = __import__("budgets.migrations.0021_provider_api_key_encrypted", fromlist=["move_keys"])
    monkeypatch.setenv("FARM_KEY", THE_KEY)
    Provider.objects.filter(pk=remote.pk).update(api_key_env="FARM_KEY")
    leaky = Provider.objects.create(name="leaky", kind=Provider.Kind.OPENAI_COMPATIBLE,
                                    base_url="http://127.0.0.1:9/v1", api_key_env="SECRET_KEY")
    kept = Provider.objects.create(name="kept", kind=Provider.Kind.OPENAI_COMPATIBLE,
                                   base_url="http://127.0.0.1:9/v1", api_key_env="CEILING_PROVIDER_KEY_KEPT")
    migration.move_keys(django_apps, None)
    remote.refresh_from_db(), leaky.refresh_from_db(), kept.refresh_from_db()
    assert (remote.api_key_env, vault.unseal(remote.api_key_encrypted)) == ("", THE_KEY)
    assert (leaky.api_key_env, leaky.api_key_encrypted) == ("SECRET_KEY", "")  # never copied; the worker refuses it
    assert (kept.api_key_env, kept.api_key_encrypted) == ("CEILING_PROVIDER_KEY_KEPT", "")
    said = capsys.readouterr().out
    assert "'gpu-farm': the value of FARM_KEY is now stored encrypted" in said
    assert "'leaky': names the server setting SECRET_KEY: not copied" in said and "'kept'" not in said
