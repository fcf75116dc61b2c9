"""`bench --first-run`: what a new user meets, timed from `make run` on a fresh clone.

The repository's HEAD is cloned into a temporary folder and started with `make run` as a user
would, with the clone's own var/ (its SQLite database, converted model, compiled kernels and
inductor cache) and a Redis of its own, on a free port. The clock starts with the command; it
records the seconds until the login page answers, logs in as the demo's end user and sends ten
short chats over the chat socket one after another, each with the first token's time and the
time per token after it. With a peer (an OpenAI-compatible server such as llama.cpp's) the same
ten chats go to it too, for its time per token on the same machine.

Only the standard library and websockets, no Django: the stack under test is another process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.cookiejar import CookieJar
from pathlib import Path

from inference.engine.bench.measure import BenchError, RequestTiming
from inference.engine.bench.workload import BenchRequest

DEMO_USER = "alice"
CHATS = 10
CHAT_TOKENS = 64
QUESTIONS = [
    "What is a KV cache?",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Explain what a budget ceiling is in one paragraph.",
    "Write a haiku about autumn.",
    "What does a load balancer do?",
    "How do I boil an egg?",
    "Name three uses of Python.",
    "What is the capital of Japan, and what is it known for?",
    "Summarise the water cycle.",
]


@dataclass
class FirstRun:
    page_s: float | None = None  # `make run` started → the login page answered
    first_token_s: float | None = None  # `make run` started → the first chat's first token
    chats: list[dict] = field(default_factory=list)  # per chat: ttft_ms, ms_per_token, tokens, error
    peer_ms_per_token: list[float | None] = field(default_factory=list)
    clone: str = ""
    log: str = ""

    def as_dict(self) -> dict:
        ours = [chat["ms_per_token"] for chat in self.chats if chat.get("ms_per_token")]
        peers = [value for value in self.peer_ms_per_token if value]
        return {
            "page_s": self.page_s,
            "first_token_s": self.first_token_s,
            "chats": self.chats,
            "ms_per_token_median": round(statistics.median(ours), 2) if ours else None,
            "peer_ms_per_token": self.peer_ms_per_token,
            "peer_ms_per_token_median": round(statistics.median(peers), 2) if peers else None,
            "clone": self.clone,
            "log": self.log,
        }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clone_head(repository: Path, into: Path) -> str:
    """HEAD of `repository` cloned into `into`; returns its commit."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(repository), str(into)], check=True,
                   capture_output=True, text=True)
    return subprocess.run(["git", "-C", str(into), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def run_first_run(repository: Path, *, venv: Path | None, peer: str | None, timeout_s: float, keep: bool,
                  progress=print) -> FirstRun:
    """Clone, `make run`, time the page and ten chats; the stack is stopped (and the clone removed
    unless `keep`) whatever happens."""
    folder = Path(tempfile.mkdtemp(prefix="ceiling-first-run-"))
    result = FirstRun()
    stack = None
    try:
        commit = clone_head(repository, folder / "ceiling")
        clone = folder / "ceiling"
        result.clone, result.log = str(clone), str(folder / "make-run.log")
        progress(f"cloned {commit} into {clone}")
        port, password = free_port(), "first-run-" + os.urandom(6).hex()
        make = ["make", "run", f"RUN_ARGS=--port {port}"]
        if venv is not None:  # the user's install step is left out: the clone uses an installed venv
            (clone / ".venv").symlink_to(venv)
            make[1:1] = ["-o", ".venv/.installed"]
        env = first_run_env(password, clone)
        started = time.perf_counter()
        with open(result.log, "w") as log:
            stack = subprocess.Popen(make, cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        result.page_s = round(wait_for_page(f"{base}/accounts/login/", stack, started, timeout_s), 1)
        progress(f"the page answered {result.page_s} s after `make run`")
        cookie = log_in(base, DEMO_USER, password)
        timings = asyncio.run(chat_one_after_another(base, cookie, requests_for_chats()))
        first = timings[0]
        if first.first_token is not None:
            result.first_token_s = round(first.first_token - started, 1)
        result.chats = [chat_figures(timing) for timing in timings]
        if peer:
            result.peer_ms_per_token = peer_figures(peer, requests_for_chats())
        return result
    finally:
        if stack is not None:
            stop(stack)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def first_run_env(password: str, clone: Path) -> dict[str, str]:
    """The environment of a user's shell, less what points at this checkout's services: the clone
    makes its own SQLite database and var/, and a private Redis (nothing answers at port 1)."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("CEILING_", "DATABASE_URL", "REDIS_URL", "TEST_REDIS_URL", "DJANGO_"))}
    return env | {"CEILING_DEMO_PASSWORD": password, "REDIS_URL": "redis://127.0.0.1:1/0",
                  "CEILING_VAR_DIR": str(clone / "var")}


def wait_for_page(url: str, stack: subprocess.Popen, started: float, timeout_s: float) -> float:
    """Seconds from `started` until `url` answers 200; a BenchError if the stack exits or time runs out."""
    while time.perf_counter() - started < timeout_s:
        if stack.poll() is not None:
            raise BenchError(f"`make run` exited with status {stack.returncode} before the page answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.25)
    raise BenchError(f"the page did not answer within {timeout_s:.0f} s of `make run`")


def log_in(base: str, username: str, password: str) -> str:
    """The session cookie of `username`, through Django's login form as a browser fills it."""
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(f"{base}/accounts/login/", timeout=30) as response:
        page = response.read().decode()
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    if match is None:
        raise BenchError("the login page carries no CSRF token")
    form = urllib.parse.urlencode({"username": username, "password": password,
                                   "csrfmiddlewaretoken": match.group(1)}).encode()
    request = urllib.request.Request(f"{base}/accounts/login/", data=form, headers={"Referer": f"{base}/accounts/login/"})
    opener.open(request, timeout=30).close()
    session = next((cookie.value for cookie in jar if cookie.name == "sessionid"), None)
    if session is None:
        raise BenchError(f"logging in as {username} gave no session (wrong password?)")
    return session


def requests_for_chats() -> list[BenchRequest]:
    return [BenchRequest(index=i, arrival_s=0.0, output_tokens=CHAT_TOKENS, shared_prefix=False,
                         messages=[{"role": "user", "content": question}]) for i, question in enumerate(QUESTIONS[:CHATS])]


async def chat_one_after_another(base: str, cookie: str, requests: list[BenchRequest]) -> list[RequestTiming]:
    """Each chat sent when the one before it ended, as a user reading the answers would."""
    from websockets.asyncio.client import connect

    url = base.replace("http://", "ws://") + "/ws/chat/"
    timings = []
    async with connect(url, origin=base, additional_headers={"Cookie": f"sessionid={cookie}"}, open_timeout=60) as ws:
        for request in requests:
            timing = RequestTiming(request.index, arrival=time.perf_counter())
            await one_chat(ws, request, timing)
            timings.append(timing)
    return timings


async def one_chat(ws, request: BenchRequest, timing: RequestTiming) -> None:
    frame = {"type": "chat", "feature": "chat", "messages": request.messages, "max_tokens": request.output_tokens}
    await ws.send(json.dumps(frame))
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout=600))
        if timing.record_chat_frame(message, time.perf_counter()):
            return


def chat_figures(timing: RequestTiming) -> dict:
    if timing.error or timing.first_token is None:
        return {"error": timing.error or "no token"}
    tpot = timing.tpot_ms
    return {"ttft_ms": round(timing.ttft_ms, 1), "ms_per_token": None if tpot is None else round(tpot, 2),
            "tokens": timing.output_tokens,
            # the ledger's settlement before `done`: not part of the answer's time, shown beside it
            "done_after_last_token_ms": round(timing.done_after_last_token_ms, 1)}


def peer_figures(peer: str, requests: list[BenchRequest]) -> list[float | None]:
    """The same chats against the peer, one after another: its ms per token for each."""
    from inference.engine.bench.peer import check_peer, stream_one

    model = check_peer(peer)
    figures = []
    for request in requests:
        timing = RequestTiming(request.index, arrival=time.perf_counter())
        stream_one(peer, model, request, timing)
        figures.append(None if timing.error or timing.tpot_ms is None else round(timing.tpot_ms, 2))
    return figures


def stop(stack: subprocess.Popen) -> None:
    """`make run` and everything it started (its own session): SIGINT as Ctrl-C would, then SIGKILL."""
    for sent, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(stack.pid, sent)
        except ProcessLookupError:
            return
        try:
            stack.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
