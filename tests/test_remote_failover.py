"""Failover across remote providers: a feature's backups take a request its own provider could not
start (429, 5xx, no connection), under the reservation made at admission (budgets/failover.py).

The providers are real OpenAI-compatible HTTP servers on loopback, one per provider, each told how
to behave: answer, fail with a status, or fail after streaming some text.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client
from django.utils import timezone

from budgets.guard import counter_store, provider_month_key
from budgets.models import AuditEntry, Feature, ModelPrice, Provider, Quota, TokenLog
from inference.metrics import clear_metrics
from project import stack as processes
from project.stack import free_port
from tests.conftest import session_cookie, start_stack, wait_for
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "remote-model"
ANSWER = ["Backups", " keep", " answering", "."]
METRICS_TOKEN = "a-long-random-scrape-token-for-failover"


class Remote:
    """One loopback server; `behaviour` is "answer", an HTTP status such as 503, "midway" (fails after
    two pieces of text) or "silent" (accepts, then sends nothing for 10 s, or until it is closed)."""

    def __init__(self, behaviour: str | int = "answer") -> None:
        self.behaviour = behaviour
        self.received: list[dict] = []
        self.closing = threading.Event()
        remote = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                remote.received.append(body)
                if isinstance(remote.behaviour, int):
                    error = json.dumps({"error": {"message": f"busy ({remote.behaviour})"}}).encode()
                    self.send_response(remote.behaviour)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if remote.behaviour == "silent":
                    self.wfile.flush()
                    # Closing joins the handlers' threads: a silent one ends then, not 10 s on.
                    remote.closing.wait(10)
                    return
                pieces = ANSWER[:2] if remote.behaviour == "midway" else ANSWER
                for piece in pieces:
                    self._send({"choices": [{"index": 0, "delta": {"content": piece}}]})
                if remote.behaviour == "midway":
                    self._send({"error": {"message": "the GPU fell over"}})
                    return
                self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                self._send({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": len(ANSWER)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _send(self, chunk: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def remotes() -> Iterator[list[Remote]]:
    started: list[Remote] = []
    yield started
    for remote in started:
        remote.close()


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)
    clear_metrics()


def provider(name: str, url: str, price_in: int, price_out: int, **fields) -> Provider:
    made = Provider.objects.create(name=name, kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=url, remote_model=MODEL, **fields)
    ModelPrice.objects.create(provider=made, model=MODEL, input_per_million_micro_usd=price_in,
                              output_per_million_micro_usd=price_out, effective_from=timezone.now() - timedelta(days=1))
    return made


def serve(remotes: list[Remote], *behaviours: str | int) -> list[Remote]:
    made = [Remote(behaviour) for behaviour in behaviours]
    remotes.extend(made)
    return made


def failover_feature(primary_url: str, *backups: Provider) -> tuple[Feature, Provider]:
    """A feature on `primary` ($10 per million in and out, a monthly limit so it has a counter)."""
    primary = provider("primary", primary_url, 10_000_000, 10_000_000, monthly_limit_micro_usd=50_000_000)
    feature = Feature.objects.create(name="resilient", provider=primary, backup_providers=[p.pk for p in backups])
    return feature, primary


def ask(live_stack, user) -> list[dict]:
    return asyncio.run(chat(live_stack, session_cookie(user), chat_frame("Still there?", 16, feature="resilient")))


def settled_row(request_id: str) -> TokenLog:
    wait_for(lambda: TokenLog.objects.get(request_id=request_id).counters_settled, timeout=5)
    return TokenLog.objects.select_related("provider", "price").get(request_id=request_id)


def assert_nothing_held(row: TokenLog, primary: Provider) -> None:
    """Every counter let go of the reservation; the primary's spend counter counts nothing of it."""
    store = counter_store()
    for key in row.counter_keys:
        assert store.state(key).reserved.tokens == 0
        assert row.request_id not in store.held(key)
    primary_key = provider_month_key(primary.pk, row.created_at)
    state = store.state(primary_key)
    assert state is not None and state.reserved.cost_micro_usd == 0 and state.used.cost_micro_usd == 0
    assert row.request_id not in store.held(primary_key)


def scrape_failovers(settings) -> float | None:
    """/metrics' failover count of the feature, once the settled row's metrics are recorded."""
    settings.CEILING_METRICS_TOKEN = METRICS_TOKEN

    def count() -> float | None:
        text = Client().get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).content.decode()
        lines = [line for line in text.splitlines() if line.startswith('ceiling:failover_requests_total{feature="resilient"}')]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else None

    wait_for(lambda: count() is not None, timeout=5)
    return count()


@pytest.fixture
def alice_capped(alice) -> Quota:
    return Quota.objects.create(user=alice, period="day", max_tokens=1_000_000)


# --- a failure before the first token moves the request ---------------------------------------------


def test_a_503_before_the_first_token_is_served_by_the_backup(live_stack, alice, alice_capped, remotes, settings):
    failing, answering = serve(remotes, 503, "answer")
    backup = provider("backup", answering.url, 1_000_000, 2_000_000)
    feature, primary = failover_feature(failing.url, backup)

    accepted, *tokens, done = ask(live_stack, alice)

    assert done["type"] == "done" and done["finish_reason"] == "stop"
    assert "".join(frame["text"] for frame in tokens) == "".join(ANSWER)  # one clean answer
    assert len(failing.received) == 1 and len(answering.received) == 1
    assert answering.received[0]["messages"] == failing.received[0]["messages"]
    row = settled_row(accepted["request_id"])
    assert row.status == TokenLog.Status.OK
    assert row.provider == backup and row.price.provider == backup  # who served, at its price
    assert row.failed_over == ["primary: the remote provider 'primary' failed (HTTP 503: busy (503))"]
    assert row.cost_micro_usd == backup.prices.get().cost_micro_usd(20, len(ANSWER))
    assert row.cost_micro_usd <= row.reserved_cost_micro_usd
    assert_nothing_held(row, primary)
    assert scrape_failovers(settings) == 1


@pytest.mark.parametrize("failure", ["refused", 429])
def test_a_refused_connection_or_a_429_fails_over_too(live_stack, alice, alice_capped, remotes, failure):
    (answering,) = serve(remotes, "answer")
    if failure == "refused":
        primary_url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    else:
        primary_url = serve(remotes, failure)[0].url
    backup = provider("backup", answering.url, 1_000_000, 2_000_000)
    feature, primary = failover_feature(primary_url, backup)

    accepted, *tokens, done = ask(live_stack, alice)

    assert done["type"] == "done"
    assert "".join(frame["text"] for frame in tokens) == "".join(ANSWER)
    row = settled_row(accepted["request_id"])
    assert row.provider == backup
    [failed] = row.failed_over
    expected = "could not connect to the remote provider 'primary'" if failure == "refused" else "is rate limiting or out of quota (HTTP 429"
    assert failed.startswith("primary: ") and expected in failed
    assert_nothing_held(row, primary)


def test_a_failure_after_text_was_streamed_does_not_fail_over(live_stack, alice, alice_capped, remotes):
    midway, answering = serve(remotes, "midway", "answer")
    backup = provider("backup", answering.url, 1_000_000, 2_000_000)
    feature, primary = failover_feature(midway.url, backup)

    accepted, *tokens, error = ask(live_stack, alice)

    assert "".join(frame["text"] for frame in tokens) == "".join(ANSWER[:2])  # what the user saw stays theirs
    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "the GPU fell over" in error["message"]
    assert answering.received == []
    row = settled_row(accepted["request_id"])
    assert row.status == TokenLog.Status.FAILED and row.provider == primary and row.failed_over == []


@pytest.fixture(scope="module")
def impatient_stack(live_stack, redis_db):
    """A stack whose worker waits 2 s for a first token (the default is 50 s)."""
    started_stack, started = start_stack(redis_db, "failover", "test-failover@%h", queue="inference-failover",
                                         CEILING_ENGINE_FIRST_TOKEN_S="2")
    yield started_stack
    processes.stop_all(started)


def test_no_first_token_in_time_fails_over(impatient_stack, alice, alice_capped, remotes):
    silent, answering = serve(remotes, "silent", "answer")
    backup = provider("backup", answering.url, 1_000_000, 2_000_000)
    feature, primary = failover_feature(silent.url, backup)

    accepted, *tokens, done = ask(impatient_stack, alice)

    assert done["type"] == "done"
    assert "".join(frame["text"] for frame in tokens) == "".join(ANSWER)
    row = settled_row(accepted["request_id"])
    assert row.provider == backup
    assert row.failed_over == ["primary: the remote provider 'primary' produced nothing for 2 s"]
    assert_nothing_held(row, primary)


# --- when no provider can serve ---------------------------------------------------------------------


def test_when_every_provider_fails_the_error_names_each(live_stack, alice, alice_capped, remotes, settings):
    first, second = serve(remotes, 503, 429)
    backup = provider("backup", second.url, 1_000_000, 2_000_000)
    feature, primary = failover_feature(first.url, backup)

    accepted, error = ask(live_stack, alice)

    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "the remote provider 'primary' failed (HTTP 503" in error["message"]
    assert "the remote provider 'backup' is rate limiting or out of quota (HTTP 429" in error["message"]
    row = settled_row(accepted["request_id"])
    assert row.status == TokenLog.Status.FAILED and row.completion_tokens == 0
    assert row.cost_micro_usd <= row.reserved_cost_micro_usd  # a failed request's prompt, as ever, at the last one's price
    assert [entry.split(":", 1)[0] for entry in row.failed_over] == ["primary", "backup"]
    assert_nothing_held(row, primary)
    assert scrape_failovers(settings) == 1


def test_a_dearer_backup_or_one_with_a_spend_limit_is_passed_over_and_named(live_stack, alice, alice_capped, remotes):
    failing, dear_server, limited_server = serve(remotes, 503, "answer", "answer")
    dearer = provider("dearer", dear_server.url, 10_000_000, 20_000_000)
    limited = provider("limited", limited_server.url, 1_000_000, 1_000_000, monthly_limit_micro_usd=1_000_000)
    feature, primary = failover_feature(failing.url, dearer, limited)

    accepted, error = ask(live_stack, alice)

    assert error["type"] == "error" and error["code"] == "engine_failed"
    assert "the provider 'dearer' was passed over: it costs $10.00/$20.00 per million" in error["message"]
    assert "the provider 'limited' was passed over: it has a monthly spend limit" in error["message"]
    assert dear_server.received == [] and limited_server.received == []  # the ceiling is never at stake
    row = settled_row(accepted["request_id"])
    assert row.provider == primary
    assert [entry.split(":", 1)[0] for entry in row.failed_over] == ["primary", "dearer", "limited"]


# --- staff list the backups on the feature page ------------------------------------------------------


def test_staff_list_backups_by_name_on_the_feature_page_and_it_is_audited(staff, transactional_db):
    primary = provider("primary", "http://127.0.0.1:9/v1", 10, 10)
    first, second = provider("first", "http://127.0.0.1:9/v1", 1, 1), provider("second", "http://127.0.0.1:9/v1", 1, 1)
    feature = Feature.objects.create(name="resilient", provider=primary)
    client = Client()
    client.force_login(staff)
    form = {"name": "resilient", "mode": "chat", "enabled": "on", "max_input_tokens": 2048, "max_output_tokens": 512,
            "provider": primary.pk, "cache_ttl_s": 0}

    response = client.post(f"/staff/features/{feature.pk}/", {**form, "backup_providers": "second, first"})

    assert response.status_code == 302, response.content.decode()[:2000]
    feature.refresh_from_db()
    assert feature.backup_providers == [second.pk, first.pk]  # in the order given
    entry = AuditEntry.objects.get(target="feature resilient", field="backup_providers")
    assert (entry.before, entry.after) == ("none", "second, first")  # names, in order
    page = client.get(f"/staff/features/{feature.pk}/").content.decode()
    assert 'value="second, first"' in page


@pytest.mark.parametrize(("typed", "said"), [
    ("nobody", "There is no provider named 'nobody'."),
    ("local", "'local' is not a remote provider"),
    ("primary", "'primary' is the feature's own provider"),
    ("first, first", "'first' is listed twice."),
])
def test_the_feature_page_refuses_a_backup_that_cannot_be_one(staff, transactional_db, typed, said):
    primary = provider("primary", "http://127.0.0.1:9/v1", 10, 10)
    provider("first", "http://127.0.0.1:9/v1", 1, 1)
    Provider.default()
    feature = Feature.objects.create(name="resilient", provider=primary)
    client = Client()
    client.force_login(staff)
    form = {"name": "resilient", "mode": "chat", "enabled": "on", "max_input_tokens": 2048, "max_output_tokens": 512,
            "provider": primary.pk, "cache_ttl_s": 0, "backup_providers": typed}

    response = client.post(f"/staff/features/{feature.pk}/", form)

    assert response.status_code == 200
    assert said in response.content.decode().replace("&#x27;", "'")
    feature.refresh_from_db()
    assert feature.backup_providers == []
