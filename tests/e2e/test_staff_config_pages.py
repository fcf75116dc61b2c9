"""Staff in a real browser (Debian's chromium via Playwright): change a cap, and the next chat obeys it.

Screenshots of every configuration page are saved under var/screenshots/ for a person to look at.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.utils import timezone

from budgets.models import AuditEntry, ModelPrice, Provider, Quota, TokenLog
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "screenshots"


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    # New caps apply at once anyway (counters are keyed by their limits' scope and rebuilt from the
    # ledger); emptying them keeps this test independent of the ones before it.
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)



def log_in_as_staff(page, live_stack) -> None:
    page.goto(f"{live_stack.http_url}/staff/users/")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", "staff")
    page.fill("#id_password", "staff-password-1")
    page.click("button[type=submit]")
    page.wait_for_url("**/staff/users/")


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def chat_in_another_thread(live_stack, cookie: str, frame: dict) -> list[dict]:
    # Playwright's loop belongs to this thread; the websocket client gets a loop of its own.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, chat(live_stack, cookie, frame)).result(timeout=120)


def some_history(alice, chat_feature) -> Provider:
    """A little of everything, so the pages (and their screenshots) show real rows."""
    provider = Provider.default()
    ModelPrice.objects.create(
        provider=provider, model=settings.CEILING_MODEL_NAME, input_per_million_micro_usd=100_000,
        output_per_million_micro_usd=400_000, effective_from=datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")),
    )
    Quota.objects.create(period="month", max_requests=500, max_cost_micro_usd=2_000_000)
    TokenLog.objects.create(
        request_id="earlier", user=alice, feature=chat_feature, provider=provider, model=settings.CEILING_MODEL_NAME,
        status=TokenLog.Status.OK, prompt_tokens=30, completion_tokens=12, cost_micro_usd=8, created_at=timezone.now(),
    )
    return provider


def test_staff_lower_a_users_daily_token_cap_and_her_next_chat_is_refused(live_stack, page, staff, alice, chat_feature):
    provider = some_history(alice, chat_feature)
    log_in_as_staff(page, live_stack)
    screenshot(page, "staff-users")

    page.get_by_role("link", name="alice", exact=True).click()
    page.wait_for_url(f"**/staff/users/{alice.pk}/")
    page.fill("input[name='all-day-max_tokens']", "5")
    # Typing in a row that followed the default switched it to the user's own caps.
    assert page.locator("select[name='all-day-source']").input_value() == "own"
    page.click("text=Save caps")
    page.locator(".flash li").wait_for()
    assert "Saved" in page.locator(".flash li").inner_text()
    assert page.locator("input[name='all-day-max_tokens']").input_value() == "5"
    screenshot(page, "staff-user")

    assert Quota.objects.get(user=alice, feature=None, period="day").max_tokens == 5
    frames = chat_in_another_thread(live_stack, session_cookie(alice), chat_frame("hello", 8))
    refused = frames[-1]
    assert refused["type"] == "refused", frames
    assert refused["code"] == "user_tokens_per_day"
    assert "of your 5 tokens for today" in refused["message"]

    page.goto(f"{live_stack.http_url}/staff/audit/")
    assert "quota alice/all/day" in page.locator("table.data").inner_text()
    screenshot(page, "staff-audit")

    for name, path in [
        ("staff-defaults", "/staff/defaults/"),
        ("staff-features", "/staff/features/"),
        ("staff-feature", f"/staff/features/{chat_feature.pk}/"),
        ("staff-providers", "/staff/providers/"),
        ("staff-provider", f"/staff/providers/{provider.pk}/"),
    ]:
        page.goto(f"{live_stack.http_url}{path}")
        assert page.locator("h1").count() == 1
        screenshot(page, name)


def test_invalid_input_in_the_browser_shows_the_error_and_saves_nothing(live_stack, page, staff, alice, chat_feature):
    provider = Provider.default()
    log_in_as_staff(page, live_stack)
    page.goto(f"{live_stack.http_url}/staff/providers/{provider.pk}/")

    page.fill("#id_thresholds", "50, 80, 120")
    page.fill("#id_recipients", "ops@example.com, nobody")
    page.click("text=Save settings")
    page.locator(".errorlist").first.wait_for()
    shown = " ".join(page.locator(".errorlist").all_inner_texts())
    assert "A threshold above 100% is not allowed (120%)" in shown
    assert "“nobody” is not an email address." in shown
    assert "Nothing was saved" in page.locator(".flash").inner_text()
    screenshot(page, "staff-provider-settings-errors")

    page.fill("#id_model", "gpt-imaginary")
    page.fill("#id_input_usd", "1")
    page.fill("#id_output_usd", "2")
    page.click("text=Add price")
    page.locator(".errorlist").first.wait_for()
    assert "Unknown model “gpt-imaginary”" in page.locator("form:has(input[value=price]) .errorlist").inner_text()
    screenshot(page, "staff-provider-errors")

    provider.refresh_from_db()
    assert (provider.alert_thresholds, provider.alert_recipients) == ([50, 80, 100], "")
    assert not ModelPrice.objects.exists() and not AuditEntry.objects.exists()
