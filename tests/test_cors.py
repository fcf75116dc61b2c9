"""CORS for /v1 by configuration (CEILING_CORS_ORIGINS, django-cors-headers): off by default."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from django.conf import settings

from project import stack
from tests.conftest import Stack, _test_database_url, stack_log_dir

pytestmark = pytest.mark.django_db(transaction=True)

APP = "http://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


@pytest.fixture(scope="module")
def cors_stack(django_db_setup):
    """A daphne that lets APP call /v1 (preflights need no worker); one for the module's tests."""
    port = stack.free_port()
    env = stack.child_env(DATABASE_URL=_test_database_url(), REDIS_URL=settings.REDIS_URL, CEILING_CORS_ORIGINS=APP)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log_path = stack_log_dir() / "cors-daphne.log"
    process = subprocess.Popen(stack.daphne_argv("127.0.0.1", port), env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        stack.wait_until(lambda: stack.port_answers("127.0.0.1", port), timeout=60, what="daphne")
        yield Stack("127.0.0.1", port, log_path, log_path)
    finally:
        stack.stop_all([process])


def options(live: Stack, path: str, origin: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{live.http_url}{path}", method="OPTIONS", headers={"Origin": origin, **PREFLIGHT})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {name.lower(): value for name, value in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, {name.lower(): value for name, value in error.headers.items()}


def test_a_preflight_from_an_allowed_origin_is_answered(cors_stack):
    status, headers = options(cors_stack, "/v1/chat/completions", APP)
    assert status == 200 and headers["access-control-allow-origin"] == APP
    allowed = headers["access-control-allow-headers"]
    assert "authorization" in allowed and "x-stainless-os" in allowed
    assert "access-control-allow-credentials" not in headers  # keys, never cookies


def test_an_answer_exposes_the_request_id_to_the_allowed_origin(cors_stack):
    request = urllib.request.Request(f"{cors_stack.http_url}/v1/models", headers={"Origin": APP})
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(request, timeout=30)
    headers = unauthorized.value.headers
    assert unauthorized.value.code == 401 and headers["Access-Control-Allow-Origin"] == APP
    assert "x-request-id" in headers["Access-Control-Expose-Headers"]


def test_another_origin_gets_no_cors_headers(cors_stack):
    _, headers = options(cors_stack, "/v1/chat/completions", "http://evil.example")
    assert "access-control-allow-origin" not in headers


def test_cors_is_off_by_default(live_stack):
    status, headers = options(live_stack, "/v1/chat/completions", APP)
    assert status == 401 and "access-control-allow-origin" not in headers


def test_an_origin_that_is_not_one_is_refused_at_start():
    done = subprocess.run([sys.executable, "manage.py", "check"], env=stack.child_env(CEILING_CORS_ORIGINS="app.example"),
                          capture_output=True, text=True, timeout=120, cwd=settings.BASE_DIR)
    assert done.returncode != 0 and "'app.example' is not an origin" in done.stderr
