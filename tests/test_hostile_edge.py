"""The hostile edge, through a real daphne (as `make run` starts it): bodies too big, JSON nested too
deep, bytes that are not UTF-8, numbers too long to parse. None may reach a 500, an HTML page on
/v1, or close a chat socket.

Every input here is refused before a request is admitted, so this daphne runs without a worker.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from accounts.actions import do_create_api_key
from budgets.models import TokenLog
from project import stack
from project.bodylimit import limit_for
from tests.conftest import Stack, session_cookie, stack_env, stack_log_dir
from tests.wsclient import chat_frame, chat_socket, next_frame, send

pytestmark = pytest.mark.django_db(transaction=True)

DEEP = "[" * 3000 + "]" * 3000
TEN_MB = 10 * 1024 * 1024
API = "/v1/chat/completions"


@pytest.fixture(scope="module")
def edge(django_db_setup, redis_db) -> Iterator[Stack]:
    log = stack_log_dir() / "edge-daphne.log"
    port = stack.free_port()
    daphne = subprocess.Popen(stack.daphne_argv("127.0.0.1", port), env=stack_env(),
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=60, what="daphne")
        yield Stack("127.0.0.1", port, log, log)
    finally:
        stack.stop_all([daphne])
    assert "Traceback" not in log.read_text(errors="replace")  # nothing hostile reached an unhandled error


@pytest.fixture
def key(alice) -> str:
    return do_create_api_key(alice, "edge")[1]


def post(edge: Stack, body: bytes, key: str | None = None, **headers: str) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{edge.http_url}{API}", content=body, headers={"Content-Type": "application/json", **headers}, timeout=60)


def openai_error(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- JSON that Python's parser chokes on -------------------------------------------------------------


@pytest.mark.parametrize("body", [
    DEEP,
    '{"model": "m", "messages": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"messages": [{"role": "user", "content": ' + '{"a": ' * 2000 + "1" + "}" * 2000 + "}]}",
])
def test_deep_nesting_is_a_400_bad_json_in_openais_shape(edge, key, body):
    response = post(edge, body.encode(), key)
    assert response.status_code == 400
    error = openai_error(response)
    assert error["code"] == "bad_json" and "deeper than 100 levels" in error["message"]


def test_a_body_that_is_not_utf8_is_a_400(edge, key):
    response = post(edge, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc0"}]}', key)
    assert response.status_code == 400 and openai_error(response)["code"] == "bad_json"


@pytest.mark.parametrize("number", ["1" * 5000, "1e999999", "-" + "9" * 4400])
def test_numbers_too_long_or_too_large_are_a_400(edge, key, number):
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": {number}}}'.encode()
    response = post(edge, body, key)
    assert response.status_code == 400, response.text[:300]
    openai_error(response)
    assert not TokenLog.objects.exists()


# --- bodies too big ----------------------------------------------------------------------------------------


def test_a_10_mb_body_is_a_413_in_openais_shape_with_or_without_a_key(edge, key):
    for with_key in (None, key):
        response = post(edge, b"{" + b" " * TEN_MB + b"}", with_key)
        assert response.status_code == 413
        error = openai_error(response)
        assert error["code"] == "request_too_large" and "10,485,762 bytes" in error["message"]
    assert not TokenLog.objects.exists()


def test_a_declared_size_over_the_limit_is_answered_before_the_body_is_sent(edge):
    """Only the headers go out: the 413 comes back while the 10 MB are still owed."""
    with socket.create_connection((edge.host, edge.port), timeout=10) as raw:
        raw.sendall(f"POST {API} HTTP/1.1\r\nHost: {edge.host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {TEN_MB}\r\n\r\n".encode())
        answer = raw.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b'"code": "request_too_large"' in answer


def test_a_chunked_body_is_counted_and_cut_off_at_the_limit(edge):
    limit = limit_for(API)

    def chunks() -> Iterator[bytes]:
        for _ in range(TEN_MB // 65536):  # no Content-Length: sent chunked, 10 MB in all
            yield b" " * 65536

    response = httpx.post(f"{edge.http_url}{API}", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert openai_error(response)["message"] == f"The request body is over {limit:,} bytes; the limit is {limit:,} bytes."


def test_a_page_body_over_the_limit_is_a_plain_413_and_the_server_carries_on(edge):
    response = httpx.post(f"{edge.http_url}/accounts/login/", content=b"x" * TEN_MB, timeout=60)
    assert response.status_code == 413 and response.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"{edge.http_url}/accounts/login/", timeout=30).status_code == 200


# --- the chat socket -----------------------------------------------------------------------------------------


def test_hostile_frames_get_error_frames_and_the_socket_stays_open(edge, alice, chat_feature):
    hostile = [
        (DEEP, "bad_json"),
        (json.dumps(chat_frame("hi"))[:-1] + ', "x": ' + "[" * 3000 + "]" * 3000 + "}", "bad_json"),
        ('{"type": "chat", "max_tokens": ' + "1" * 5000 + "}", "bad_json"),
        ('{"type": "chat", "max_tokens": 1e999999, "messages": [{"role": "user", "content": "hi"}]}', "bad_max_tokens"),
        ('{"type": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}', "bad_text"),
    ]

    cookie = session_cookie(alice)

    async def run() -> list[dict]:
        async with chat_socket(edge, cookie) as ws:
            answers = []
            for frame, _ in hostile:
                started = time.monotonic()
                await send(ws, frame)
                answers.append(await next_frame(ws, timeout=30))
                assert time.monotonic() - started < 30
            await ws.ping()  # still open after all of them
            return answers

    answers = asyncio.run(run())
    assert [(a["type"], a["code"]) for a in answers] == [("error", code) for _, code in hostile]
    assert "deeper than 100 levels" in answers[0]["message"]
