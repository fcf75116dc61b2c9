"""No start-up tax: inductor's cache lands where the configuration says, and `make run` answers the page
only once each worker serves at full speed (runstack waits for its stats, one worker at a time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management.base import CommandError

from inference.bus.stats import STATS_KEY_PREFIX
from inference.management.commands.runstack import worker_ready
from project import stack
from tests.conftest import stack_env

ROOT = settings.BASE_DIR


def test_an_engine_sets_its_compile_cache_folder_before_its_load_picks_the_temp_one(tmp_path):
    # The load itself asks inductor for its cache folder, which writes the system temp folder into the
    # environment when it is unset: the compile thread's setdefault came too late and var/inductor
    # never filled. A fresh process, as a worker is, with no folder in its environment.
    script = textwrap.dedent(f"""
        import dataclasses, os
        import django
        django.setup()
        from pathlib import Path
        from inference.engine.loop import Engine
        from inference.engines import engine_config_from_settings, model_dir
        config = dataclasses.replace(engine_config_from_settings(model_dir()), compile_cache_dir=Path({str(tmp_path / "inductor")!r}))
        Engine(config).load(progress=lambda line: None)
        print("cache:", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env |= {"DJANGO_SETTINGS_MODULE": "project.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    assert f"cache: {tmp_path / 'inductor'}" in done.stdout
    assert (tmp_path / "inductor").is_dir()


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_runstack_waits_for_a_worker_until_it_publishes_its_stats(redis_db, sleeper):
    key = f"{STATS_KEY_PREFIX}testhost:{sleeper.pid}:abc123"
    redis_db.delete(key)
    assert not worker_ready(settings.REDIS_URL, sleeper, timeout=1.0)

    redis_db.set(key, "{}", ex=5)  # what publish_stats_forever writes once the engine serves
    began = time.monotonic()
    assert worker_ready(settings.REDIS_URL, sleeper, timeout=10.0)
    assert time.monotonic() - began < 5
    redis_db.delete(key)


def test_runstack_refuses_to_go_on_when_a_worker_exits_before_it_served(redis_db):
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()

    with pytest.raises(CommandError, match="exited with code 3 before it served"):
        worker_ready(settings.REDIS_URL, process, timeout=10.0)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def test_sigterm_while_a_worker_starts_stops_that_worker_too(transactional_db, redis_db):
    # It ended runstack at once and left the starting worker behind, orphaned, compiling for minutes.
    runstack = subprocess.Popen([sys.executable, "manage.py", "runstack", "--port", str(stack.free_port()), "--variants", "none"],
                                cwd=ROOT, env=stack_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stack.wait_until(lambda: _children(runstack.pid), timeout=120, what="runstack's worker")
        worker = _children(runstack.pid)[0]
        runstack.send_signal(signal.SIGTERM)
        runstack.wait(timeout=30)
        stack.wait_until(lambda: not Path(f"/proc/{worker}").exists() or "Z" in _state(worker), timeout=5,
                         what="the worker's end")
    finally:
        runstack.kill()
        runstack.wait()
    assert "Stopping…" in runstack.stdout.read()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_web_process_has_its_tokenizer_before_it_listens():
    # Loaded in a background thread, the page answered while it loaded and the first chat sent right
    # after waited ~900 ms for it (bench --first-run): the ASGI module now loads it on import, and
    # daphne imports the application before it binds its port.
    script = textwrap.dedent("""
        import project.asgi
        from inference.web import tokenizer
        print("loaded:", tokenizer._tokenizer is not None)
    """)
    env = os.environ | {"DJANGO_SETTINGS_MODULE": "project.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded: True" in done.stdout
