"""What `make run` relies on: demo data, a private Redis when none answers, model files on disk."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command

from budgets.models import Feature
from inference.engine.weights import CONVERTED_NAME, bundled_gguf_path, conversion_lock, is_complete
from inference.engines import model_dir
from project import stack


@pytest.mark.django_db
def test_seed_demo_creates_users_once_and_prints_passwords_once(monkeypatch):
    monkeypatch.delenv("CEILING_DEMO_PASSWORD", raising=False)
    first, second = io.StringIO(), io.StringIO()
    call_command("seed_demo", "--no-history", stdout=first)
    call_command("seed_demo", "--no-history", stdout=second)

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
    call_command("seed_demo", "--no-history", stdout=io.StringIO())
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


def test_a_process_that_finds_a_conversion_under_way_waits_for_it_and_converts_nothing(tmp_path):
    # On a fresh checkout daphne and every worker want the model at once; only one may convert it.
    target = tmp_path / "models" / CONVERTED_NAME
    waiting_line = ""
    with conversion_lock(target):
        child = subprocess.Popen(
            [sys.executable, "-c", "import django; django.setup(); from inference.engines import model_dir; "
             "print('using', model_dir(), flush=True)"],
            cwd=settings.BASE_DIR,
            env=stack.child_env(CEILING_VAR_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="project.settings"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        waiting_line = child.stdout.readline()
        # Play the converting process: the finished folder appears before the lock is let go.
        target.mkdir()
        for file in model_dir().iterdir():
            (target / file.name).symlink_to(file)
    rest, _ = child.communicate(timeout=120)

    assert waiting_line.startswith("Waiting for another process converting the model"), waiting_line
    assert child.returncode == 0, rest
    assert "Converting" not in rest
    assert rest.strip() == f"using {target}"
