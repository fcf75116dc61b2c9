"""A person in a real browser (Debian's chromium via Playwright): log in, chat, watch the stream."""

from __future__ import annotations

import os
import shutil

import pytest
from django.db import connections

from budgets.models import TokenLog

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CEILING_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def page(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the ORM calls below are plain
    # blocking calls made between browser steps, never inside the loop.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context()
        page = context.new_page()
        messages = []
        page.on("console", lambda message: messages.append(message.text))
        yield page
        page.screenshot(path=str(tmp_path / "last.png"))
        print("browser console:", messages)
        context.close()
        browser.close()
        # ORM calls made while Playwright's loop was current opened a connection of their own.
        connections.close_all()


def log_in(page, live_stack, username: str, password: str, landing: str = "/chat/") -> None:
    page.goto(f"{live_stack.http_url}{landing}")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"**{landing}")


def test_a_user_logs_in_chats_and_sees_the_answer_stream(live_stack, page, alice, chat_feature):
    log_in(page, live_stack, "alice", "alice-password-1")
    page.wait_for_function("document.getElementById('status').textContent.includes('Connected')")
    page.fill("#max-tokens", "40")
    page.fill("#prompt", "Describe a sunny beach in a few words.")
    page.click("#send")

    answer = page.locator("li.assistant").first
    # Streaming: the answer is visible with partial text before the done frame adds its summary.
    page.wait_for_function(
        "(() => { const li = document.querySelector('li.assistant'); return li && li.textContent.length > 0 && !li.querySelector('.meta'); })()"
    )
    partial = answer.inner_text()
    answer.locator(".meta").wait_for(timeout=60_000)
    final = answer.inner_text()
    assert len(final) > len(partial) > 0
    assert "tokens" in answer.locator(".meta").inner_text()

    log = TokenLog.objects.get()
    assert log.status == TokenLog.Status.OK and log.user == alice
    assert log.transcript.response_text in final


def test_model_output_with_markup_is_shown_as_text(live_stack, page, alice, chat_feature):
    log_in(page, live_stack, "alice", "alice-password-1")
    page.wait_for_function("document.getElementById('status').textContent.includes('Connected')")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", 'Repeat exactly: <img src=x onerror="window.pwned=1"><b>bold</b>')
    page.click("#send")
    page.locator("li.assistant .meta").wait_for(timeout=60_000)
    assert page.locator("li.user").inner_text().startswith("Repeat exactly: <img")
    assert page.locator("li img, li b").count() == 0
    assert page.evaluate("window.pwned") is None


def test_a_wrong_password_is_told_so(live_stack, page, alice):
    page.goto(f"{live_stack.http_url}/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "wrong")
    page.click("button[type=submit]")
    assert "didn't match" in page.locator(".alert").inner_text()
