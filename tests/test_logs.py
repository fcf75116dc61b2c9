"""Log lines name the request they are about, from the web process to the worker and its settle;
CEILING_LOG_FORMAT=json writes one JSON object per line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from django.conf import settings
from openai import OpenAI

from accounts.actions import do_create_api_key
from budgets.models import TokenLog
from project import stack
from project.logs import JsonFormatter, PlainFormatter, RequestIdFilter, request_context
from tests.conftest import wait_for


def record(message: str, exc_info=None) -> logging.LogRecord:
    made = logging.LogRecord("inference.test", logging.WARNING, __file__, 1, message, (), exc_info)
    RequestIdFilter().filter(made)
    return made


def test_a_json_line_carries_the_request_id_while_a_request_is_served():
    with request_context("abc123"):
        inside = json.loads(JsonFormatter().format(record("a %s")))
    outside = json.loads(JsonFormatter().format(record("no request")))

    assert inside["request_id"] == "abc123" and inside["level"] == "WARNING" and inside["logger"] == "inference.test"
    assert inside["message"] == "a %s" and inside["ts"].endswith("+00:00")
    assert "request_id" not in outside


def test_a_json_line_holds_its_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        line = JsonFormatter().format(record("failed", sys.exc_info()))
    assert "\n" not in line
    assert json.loads(line)["exc"].endswith("ValueError: boom")


def test_a_plain_line_ends_with_the_request_id_when_there_is_one():
    with request_context("abc123"):
        assert PlainFormatter().format(record("admitted")).endswith("inference.test: admitted request_id=abc123")
    assert PlainFormatter().format(record("idle")).endswith("inference.test: idle")


def manage_py_logs(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = (
        "import logging; from project.logs import request_context\n"
        "with request_context('r-1'): logging.getLogger('inference.x').warning('hello')\n"
    )
    return subprocess.run([sys.executable, "manage.py", "shell", "-c", code], env=stack.child_env(**env),
                          capture_output=True, text=True, timeout=120, cwd=settings.BASE_DIR)


def test_ceiling_log_format_json_makes_every_line_json():
    done = manage_py_logs({"CEILING_LOG_FORMAT": "json"})
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr
    assert {"logger": "inference.x", "message": "hello", "request_id": "r-1"}.items() <= lines[-1].items()


def test_an_unknown_log_format_is_refused_at_start():
    done = subprocess.run([sys.executable, "manage.py", "check"], env=stack.child_env(CEILING_LOG_FORMAT="xml"),
                          capture_output=True, text=True, timeout=120, cwd=settings.BASE_DIR)
    assert done.returncode != 0 and "CEILING_LOG_FORMAT='xml' must be plain or json" in done.stderr


@pytest.mark.django_db(transaction=True)
def test_one_chat_is_followed_by_its_request_id_from_daphne_to_the_worker(live_stack, alice, chat_feature):
    client = OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=do_create_api_key(alice, "logs")[1], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=settings.CEILING_MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    request_id = raw.headers["x-request-id"]
    assert TokenLog.objects.get(request_id=request_id).status == TokenLog.Status.OK

    tagged = f"request_id={request_id}"
    web = [line for line in live_stack.daphne_output().splitlines() if line.endswith(tagged)]
    assert any("chat accepted" in line for line in web) and any("chat done" in line for line in web)
    worker = wait_for(lambda: [line for line in live_stack.worker_output().splitlines() if line.endswith(tagged)], timeout=10)
    assert any("generation picked up" in line for line in worker)
    wait_for(lambda: "generation settled" in live_stack.worker_output(), timeout=10)
