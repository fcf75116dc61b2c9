"""A new user's first ten minutes: `make run` on a fresh clone, then the ceiling seen in a browser.

The repository's committed HEAD is cloned into a temporary folder (no var/: no database, no Redis
socket, no converted model) and `make run` runs there exactly as a person types it, with the same
Makefile, on its default SQLite file and, since nothing answers at its REDIS_URL, on the private
redis-server it starts under var/. Then, in Debian's chromium: alice is refused once her daily cap
is spent, with the sentence and the reset time; staff see non-zero local spend on the overview and
charts with data. Ctrl-C (SIGINT to make's process group, as a terminal sends it) stops it all.

Two things are not redone, to keep the test at a few minutes: the clone uses the suite's virtual
environment (a symlink; `make -o .venv/.installed` tells make not to reinstall it, however new the
clone's requirements files look) and the model this checkout converted already (CEILING_MODEL; the
conversion itself is tests/test_run_support.py's). Uncommitted changes are not in the clone.
On a busy 2-core machine it takes 95-145 s, most of it load_docs embedding the docs (30-85 s) and
the worker loading its engine after daphne answers (25-70 s); it prints each step's time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from itertools import pairwise
from pathlib import Path

import pytest
import redis
from django.conf import settings

from budgets.management.commands.seed_demo import ALICE_DAILY_CAPS, LOCAL_MONTHLY_LIMIT_MICRO_USD
from budgets.money import format_usd
from inference.engines import model_dir
from project import stack
from tests.conftest import engine_stats, stack_log_dir
from tests.e2e.test_chat_page import log_in

pytestmark = [pytest.mark.browser]

PASSWORD = "first-run-demo-1"  # CEILING_DEMO_PASSWORD: both demo users get it
ALICE_REQUESTS_PER_DAY = 2  # set_quota lowers the demo's 20 so that two chats reach it
# What `make run` prints as it goes, in order: how long each step took goes into the test's output.
STEPS = ("manage.py migrate", "manage.py seed_demo", "manage.py load_docs", "manage.py runstack", "Ceiling is running")
REFUSAL = re.compile(
    rf"You have made {ALICE_REQUESTS_PER_DAY} of your {ALICE_REQUESTS_PER_DAY} requests for today\. "
    r"Your allowance resets at 00:00 \S+, in (\d+ h )?\d+ min\."
)
# A chart "has data" when its Plotly traces have a value above zero (on y, or on x for horizontal
# bars; a date is not a number), and Plotly drew their bars or markers: not the empty axes of no data.
CHART_POINTS = """(id) => {
  const chart = document.getElementById(id);
  const values = chart.data.flatMap((trace) => [...(trace.x || []), ...(trace.y || [])]);
  const points = values.filter((v) => typeof v === "number" && v > 0).length;
  return {points, drawn: chart.querySelectorAll("g.trace .point").length};
}"""


@dataclass
class FirstRun:
    folder: Path
    port: int
    env: dict[str, str]
    log: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def manage(self, *args: str) -> str:
        """A management command on the clone, run as its README says: `.venv/bin/python manage.py …`."""
        done = subprocess.run([".venv/bin/python", "manage.py", *args], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def private_redis(self) -> redis.Redis:
        return redis.Redis.from_url(f"unix://{self.folder / 'var' / 'redis.sock'}")


def fresh_clone(folder: Path) -> None:
    subprocess.run(["git", "clone", "--quiet", str(settings.BASE_DIR), str(folder)], check=True, timeout=120)
    assert not (folder / "var").exists()
    # The suite's own virtual environment (sys.prefix), as the clone's .venv: nothing is installed.
    (folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)


def first_run_env(port: int) -> dict[str, str]:
    """A new user's shell: none of the suite's database, Redis or CEILING_* settings."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("CEILING_", "DATABASE_", "REDIS_", "DJANGO_"))}
    return env | {
        "CEILING_DEMO_PASSWORD": PASSWORD,
        # Nothing listens there, so runstack starts its private redis-server under var/, as on a
        # machine without Redis: the clone shares no queue, counter or cache with the suite.
        "REDIS_URL": f"redis://127.0.0.1:{stack.free_port()}/0",
        "CEILING_MODEL": str(model_dir()),
        "CEILING_COMPILE_DECODE": "0",
        "PYTHONUNBUFFERED": "1",
    }


def wait_for_output(run: FirstRun, process: subprocess.Popen, timeout: float) -> dict[str, float]:
    """Wait for "Ceiling is running"; the seconds at which each step of STEPS began."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - started < timeout:
        text = run.output()
        for step in STEPS:
            if step not in seen and step in text:
                seen[step] = time.monotonic() - started
        if STEPS[-1] in seen:
            return seen
        if process.poll() is not None:
            pytest.fail(f"make run exited with code {process.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"make run did not say 'Ceiling is running' within {timeout:.0f} s:\n{run.output()[-4000:]}")


def interrupt(process: subprocess.Popen, timeout: float = 30) -> bool:
    """Ctrl-C: SIGINT to make's process group, as a terminal sends it. False if something had to be killed."""
    group = process.pid
    try:
        os.killpg(group, signal.SIGINT)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap make itself, or its zombie keeps the group alive
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)
    process.wait()
    return False


@pytest.fixture
def first_run(tmp_path_factory) -> FirstRun:
    # A short path: the private Redis listens on var/redis.sock, and a unix socket's path is at most 107 bytes.
    folder = tmp_path_factory.mktemp("fresh") / "ceiling"
    started = time.monotonic()
    fresh_clone(folder)
    cloned = time.monotonic() - started
    port = stack.free_port()
    run = FirstRun(folder, port, first_run_env(port), stack_log_dir() / "first-run.log")
    with run.log.open("w") as log:
        # Its own session (process group), so that Ctrl-C reaches make and everything below it.
        process = subprocess.Popen(["make", "-o", ".venv/.installed", "run", f"RUN_ARGS=--port {port}"],
                                   cwd=folder, env=run.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stopped_cleanly = False
    try:
        steps = wait_for_output(run, process, timeout=540)  # runstack answers once its workers serve
        print(f"clone {cloned:.1f} s; " + "; ".join(
            f"{step.removeprefix('manage.py ')} {steps[after] - steps[step]:.1f} s" for step, after in pairwise(STEPS)))
        yield run
    finally:
        stopped_cleanly = interrupt(process)
        print(f"make run's output: {run.log}; the whole first run took {time.monotonic() - started:.0f} s")
    assert stopped_cleanly, f"something still ran 30 s after Ctrl-C:\n{run.output()[-3000:]}"


def wait_for_the_worker(run: FirstRun, timeout: float = 240) -> float:
    client = run.private_redis()
    started = time.monotonic()
    try:
        stack.wait_until(lambda: engine_stats(client), timeout=timeout, what="the clone's worker engine")
    finally:
        client.close()
    return time.monotonic() - started


def send(page, prompt: str) -> None:
    page.wait_for_function("['Connected.', 'Ready.', 'Refused.'].includes(document.getElementById('status').textContent)")
    page.fill("#prompt", prompt)
    page.click("#send")


@pytest.mark.timeout(840)
def test_a_fresh_clone_shows_the_ceiling_the_spend_and_the_charts(first_run, page):
    print(first_run.manage("set_quota", "alice", "--period", "day", "--requests", str(ALICE_REQUESTS_PER_DAY)).strip())

    # alice: what is left today, two short answers, then the refusal with its sentence and reset time.
    log_in(page, first_run, "alice", PASSWORD)
    allowance = page.locator("#allowance")
    tokens = f"{ALICE_DAILY_CAPS['max_tokens']:,}"  # the demo's 20,000: set_quota changed only the requests
    assert allowance.inner_text().startswith(
        f"Left today: {ALICE_REQUESTS_PER_DAY} of {ALICE_REQUESTS_PER_DAY} requests · {tokens} of {tokens} tokens · resets at 00:00")
    print(f"waited {wait_for_the_worker(first_run):.1f} s more for the worker's engine")
    page.fill("#max-tokens", "4")
    for n in range(1, ALICE_REQUESTS_PER_DAY + 1):
        send(page, f"Say {n}.")
        page.locator("li.assistant .meta").nth(n - 1).wait_for(timeout=90_000)
    page.wait_for_function(
        f"document.getElementById('allowance').textContent.startsWith('Left today: 0 of {ALICE_REQUESTS_PER_DAY} requests')")
    send(page, "One more, please.")
    # (The answer that spent the last request came with a notice of its own: "You have used 100% …".)
    refusal = page.locator("li.notice", has_text="You have made")
    refusal.wait_for(timeout=30_000)
    assert page.locator("#status").inner_text() == "Refused."
    assert REFUSAL.fullmatch(refusal.inner_text()), refusal.inner_text()
    assert page.locator("li.assistant").count() == ALICE_REQUESTS_PER_DAY

    # staff: the local provider's spend this month is more than nothing, on the table and its chart.
    page.context.clear_cookies()
    log_in(page, first_run, "staff", PASSWORD, landing="/staff/")
    local = page.locator("section.card", has_text="Spend this month").locator("tbody tr", has_text="local")
    spent = local.locator("td").nth(1).inner_text()
    print(f"local spend this month: {spent}")
    assert Decimal(spent.removeprefix("$").replace(",", "")) > 0, spent
    assert local.locator("td").nth(2).inner_text() == format_usd(LOCAL_MONTHLY_LIMIT_MICRO_USD)
    for chart in ("spend-chart", "features-chart"):
        drawn = page.evaluate(f"({CHART_POINTS})('{chart}')")
        assert drawn["points"] > 0 and drawn["drawn"] > 0, (chart, drawn)

    # The charts page: every chart has points (30 days of history, alice's chats and her refusal).
    page.goto(f"{first_run.http_url}/staff/charts/")
    for chart in ("tokens-chart", "cost-chart", "refusals-chart", "latency-chart"):
        drawn = page.evaluate(f"({CHART_POINTS})('{chart}')")
        assert drawn["points"] > 0 and drawn["drawn"] > 0, (chart, drawn)
