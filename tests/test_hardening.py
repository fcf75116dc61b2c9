"""Production settings, the Content Security Policy, login throttling and oversized bodies.

API keys stored only as a hash: tests/test_api_keys.py::test_a_key_is_stored_only_as_its_hash.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from project.csp import POLICY

pytestmark = pytest.mark.django_db

BASE_DIR = Path(settings.BASE_DIR)
PRODUCTION = {
    "SECRET_KEY": secrets.token_urlsafe(64),
    "ALLOWED_HOSTS": "ceiling.example",
    "CSRF_TRUSTED_ORIGINS": "https://ceiling.example",
    "CEILING_HTTPS": "true",
    "DEBUG": "false",
}


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "ALLOWED_HOSTS", "CEILING_HTTPS")}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=environment, capture_output=True, text=True, timeout=120
    )


def test_check_deploy_passes_with_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize("env", [{"CEILING_HTTPS": "true"}, {"ALLOWED_HOSTS": "ceiling.example"}], ids=["https", "public-host"])
def test_production_refuses_to_start_without_a_secret_key(env):
    result = manage("check", **{**PRODUCTION, **env, "SECRET_KEY": ""})
    assert result.returncode != 0 and "SECRET_KEY must be set" in result.stderr


def test_every_response_carries_a_policy_without_inline_script(alice):
    client = Client()
    client.force_login(alice)
    for url in ("/accounts/login/", "/chat/", "/v1/models", "/usage/"):
        policy = client.get(url)["Content-Security-Policy"]
        assert policy == POLICY, url
    script_src = next(part for part in POLICY.split("; ") if part.startswith("script-src"))
    assert script_src == "script-src 'self'"  # no 'unsafe-inline', no 'unsafe-eval'
    assert "object-src 'none'" in POLICY and "frame-ancestors 'none'" in POLICY


def test_no_template_has_an_inline_script_or_handler():
    for template in (BASE_DIR / "templates").rglob("*.html"):
        text = template.read_text()
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag, f"{template}: inline {tag} (move it to static/, hand data over with json_script)"
        assert not re.search(r"\son[a-z]+\s*=", text), f"{template}: an inline event handler"
        assert "javascript:" not in text, template


def log_in(client: Client, username: str, password: str, ip: str = "203.0.113.7"):
    return client.post("/accounts/login/", {"username": username, "password": password}, REMOTE_ADDR=ip)


def test_logins_are_throttled_per_username_and_address(alice):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert log_in(client, "alice", "wrong").status_code == 200  # the form again, with its error
    assert log_in(client, "alice", "wrong").status_code == 429  # the limit-th failure locks the pair
    locked = log_in(client, "alice", "alice-password-1")
    assert locked.status_code == 429  # even the right password waits now
    # Someone else's failures never lock alice out from her own address.
    assert log_in(Client(), "alice", "alice-password-1", ip="198.51.100.9").status_code == 302


def test_a_successful_login_resets_the_count(alice):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        log_in(client, "alice", "wrong")
    assert log_in(client, "alice", "alice-password-1").status_code == 302
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert log_in(Client(), "alice", "wrong").status_code == 200


def test_a_form_body_over_djangos_limit_is_refused():
    big = "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)
    response = Client().post("/accounts/login/", {"username": big, "password": "p"})
    assert response.status_code == 400


def test_an_api_body_is_refused_by_its_declared_size_before_it_is_read(alice):
    from accounts.actions import do_create_api_key
    from budgets.models import TokenLog

    _, key = do_create_api_key(alice, "big")
    body = b"{" + b" " * (settings.CEILING_MAX_FRAME_BYTES * 4) + b"}"
    response = Client().post("/v1/chat/completions", body, content_type="application/json", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert not TokenLog.objects.exists()
    # Without a key nothing is read at all: the answer is the 401.
    anonymous = Client().post("/v1/chat/completions", body, content_type="application/json")
    assert anonymous.status_code == 401
