"""What `make run` relies on: demo data, a private Redis when none answers, model files on disk."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from budgets.models import Feature
from inference.modelfiles import bundled_gguf_path, is_complete, model_dir
from project import stack


@pytest.mark.django_db
def test_seed_demo_creates_users_once_and_prints_passwords_once(monkeypatch):
    monkeypatch.delenv("CEILING_DEMO_PASSWORD", raising=False)
    first, second = io.StringIO(), io.StringIO()
    call_command("seed_demo", stdout=first)
    call_command("seed_demo", stdout=second)

    assert User.objects.get(username="staff").is_staff
    assert not User.objects.get(username="alice").is_staff
    assert Feature.objects.filter(name="chat", enabled=True).count() == 1
    assert first.getvalue().count("with password") == 2
    assert "with password" not in second.getvalue()
    password = first.getvalue().split("created end user 'alice' with password ")[1].split()[0]
    assert User.objects.get(username="alice").check_password(password)


@pytest.mark.django_db
def test_seed_demo_uses_the_configured_password(monkeypatch):
    monkeypatch.setenv("CEILING_DEMO_PASSWORD", "demo-password-42")
    call_command("seed_demo", stdout=io.StringIO())
    assert User.objects.get(username="staff").check_password("demo-password-42")


def test_a_private_redis_starts_on_a_unix_socket(tmp_path):
    process, url = stack.start_private_redis(tmp_path)
    try:
        assert url == f"unix://{tmp_path}/redis.sock"
        assert stack.redis_answers(url)
    finally:
        stack.stop_all([process])
    assert not stack.redis_answers(url)


def test_nothing_answers_where_no_redis_runs():
    assert not stack.redis_answers(f"redis://127.0.0.1:{stack.free_port()}/0", timeout=0.3)


def test_the_converted_model_is_a_plain_safetensors_folder():
    assert bundled_gguf_path().suffix == ".gguf"
    folder = model_dir()
    assert is_complete(folder)
    assert "quantization_config" not in (folder / "config.json").read_text()
