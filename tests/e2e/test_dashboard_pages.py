"""Staff watch the dashboard in a real browser: a chat completing adds a point without a reload."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.conf import settings

from tests.conftest import session_cookie
from tests.e2e.test_chat_page import log_in
from tests.wsclient import chat, chat_frame

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "screenshots"

def chat_in_thread(live_stack, cookie: str, frame: dict) -> list[dict]:
    """Playwright's sync API keeps an event loop in this thread; the websocket client needs its own."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(chat(live_stack, cookie, frame))).result(timeout=120)


TOKENS_IN_CHART = "document.getElementById('tokens-chart').data.reduce((s, t) => s + t.y.reduce((a, b) => a + (b || 0), 0), 0)"


def test_a_chat_completing_adds_a_point_to_the_open_token_chart(live_stack, page, staff, alice, chat_feature):
    log_in(page, live_stack, "staff", "staff-password-1", landing="/staff/charts/")
    page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
    before = page.evaluate(TOKENS_IN_CHART)

    frames = chat_in_thread(live_stack, session_cookie(alice), chat_frame("Name a colour.", 6))
    usage = frames[-1]["usage"]
    expected = before + usage["prompt_tokens"] + usage["completion_tokens"]
    page.wait_for_function(f"{TOKENS_IN_CHART} === {expected}", timeout=5_000)
    assert page.url.endswith("/staff/charts/")  # no reload happened
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "staff-charts.png"), full_page=True)


def test_the_overview_shows_spend_engine_and_live_counts(live_stack, page, staff, alice, chat_feature):
    log_in(page, live_stack, "staff", "staff-password-1", landing="/staff/")
    page.wait_for_function("!document.querySelector('#engine-panel tbody').textContent.includes('Waiting')")
    assert "kv" not in page.locator("#engine-panel tbody").inner_text().lower()
    requests_before = int(page.locator("#kpi-requests").inner_text())
    chat_in_thread(live_stack, session_cookie(alice), chat_frame("Say ok.", 3))
    page.wait_for_function(f"Number(document.getElementById('kpi-requests').textContent) === {requests_before + 1}", timeout=5_000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "staff-overview.png"), full_page=True)
