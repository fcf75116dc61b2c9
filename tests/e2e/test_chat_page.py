"""A person in a real browser (Debian's chromium via Playwright): log in, chat, watch the stream."""

from __future__ import annotations

import pytest

from budgets.models import Quota, TokenLog

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]




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


def test_the_page_shows_whats_left_today_and_updates_it_after_each_answer(live_stack, page, alice, chat_feature):
    Quota.objects.create(user=alice, period="day", max_requests=3)
    log_in(page, live_stack, "alice", "alice-password-1")
    allowance = page.locator("#allowance")
    assert allowance.inner_text().startswith("Left today: 3 of 3 requests · resets at 00:00")
    page.wait_for_function("document.getElementById('status').textContent.includes('Connected')")
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "Say yes.")
    page.click("#send")
    page.locator("li.assistant .meta").wait_for(timeout=60_000)
    page.wait_for_function("document.getElementById('allowance').textContent.startsWith('Left today: 2 of 3 requests')")
