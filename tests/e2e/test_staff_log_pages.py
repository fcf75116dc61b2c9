"""Staff read the cost long tail and the token log, and a user reads "my usage", in a real browser.

Each test saves a screenshot under var/screenshots/ for a person to look at.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.utils import timezone

from budgets.models import Period, Quota, TokenLog
from tests.e2e.conftest import CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "screenshots"


@pytest.fixture
def browser_page():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; ORM calls are made between steps.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1300, "height": 900})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda message: message.type == "error" and errors.append(message.text))
        page.errors = errors
        yield page
        context.close()
        browser.close()
        connections.close_all()


def log_in(page, live_stack, username: str, password: str, then: str) -> None:
    page.goto(f"{live_stack.http_url}{then}")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"**{then}")


@pytest.fixture
def traffic(alice, chat_feature):
    """A few thousand synthetic requests, and some of alice's own, all inside this month."""
    call_command("synth_logs", "--rows", "3000", "--users", "80", "--days", "1", "--seed", "3", stdout=io.StringIO())
    now = timezone.now()
    for n, status in enumerate(["ok", "ok", "refused"]):
        TokenLog.objects.create(
            request_id=f"alice-{n}", user=alice, feature=chat_feature, model="m", status=status,
            refusal_code="user_tokens_per_day" if status == "refused" else "",
            prompt_tokens=120, completion_tokens=0 if status == "refused" else 80,
            cost_micro_usd=0 if status == "refused" else 60_000, created_at=now,
        )


def test_staff_see_the_long_tail_of_cost_per_user(live_stack, browser_page, staff, traffic):
    page = browser_page
    log_in(page, live_stack, "staff", "staff-password-1", "/staff/costs/")
    page.locator("#cost-histogram .main-svg").first.wait_for(timeout=30_000)
    page.locator("#cost-concentration .main-svg").first.wait_for(timeout=30_000)
    # Synthetic rows span the last day, which may straddle the month's start; alice's are always in it.
    users = int(page.locator("#kpi-users").inner_text().replace(",", ""))
    assert users > 50 or page.locator("#top-users a:has-text('alice')").count() == 1
    assert page.locator("#top-users tbody tr").count() == min(50, users)
    assert page.locator("#kpi-top-share").inner_text().endswith("%")
    first_user = page.locator("#top-users tbody tr a").first
    assert first_user.get_attribute("href").startswith("/staff/users/")
    page.screenshot(path=str(SCREENSHOTS / "staff-costs.png"), full_page=True)
    assert page.errors == []


def test_staff_filter_the_token_log_and_export_it(live_stack, browser_page, staff, traffic):
    page = browser_page
    log_in(page, live_stack, "staff", "staff-password-1", "/staff/logs/")
    assert page.locator("#log-rows tbody tr").count() == 100
    page.select_option("#id_status", "refused")
    page.select_option("#id_feature", "chat")
    page.click("#log-filters button[type=submit]")
    page.wait_for_url("**status=refused**")
    statuses = page.locator("#log-rows tbody tr td:nth-child(5)").all_inner_texts()
    assert statuses and set(statuses) == {"refused"}
    page.screenshot(path=str(SCREENSHOTS / "staff-logs.png"), full_page=False)

    # The export streams through daphne (the ASGI path) with the same filters.
    href = page.locator("#csv-export").get_attribute("href")
    response = page.request.get(f"{live_stack.http_url}/staff/logs/{href}")
    assert response.ok and response.headers["content-type"].startswith("text/csv")
    header, *rows = list(csv.reader(io.StringIO(response.text())))
    assert header[:2] == ["created_at", "request_id"]
    expected = TokenLog.objects.filter(status="refused", feature__name="chat").count()
    assert len(rows) == expected > 0
    assert {row[5] for row in rows} == {"refused"} and {row[3] for row in rows} == {"chat"}
    assert page.errors == []


def test_a_user_sees_what_is_left_of_their_allowance(live_stack, browser_page, alice, traffic):
    Quota.objects.create(user=None, feature=None, period=Period.DAY, max_requests=20, max_tokens=10_000)
    Quota.objects.create(user=alice, feature=None, period=Period.MONTH, max_cost_micro_usd=2_000_000)
    page = browser_page
    log_in(page, live_stack, "alice", "alice-password-1", "/chat/")
    page.click("header nav a:has-text('My usage')")
    page.wait_for_url("**/usage/")
    today = page.locator("section.cap[data-period=day]")
    assert "Today · all features" in today.inner_text()
    requests = today.locator("tr[data-metric=requests]")
    assert requests.locator("td.left").inner_text() == "18"  # two settled; the refusal does not count
    assert today.locator("tr[data-metric=tokens] td.left").inner_text() == "9,600"
    month = page.locator("section.cap[data-period=month]")
    assert month.locator("tr[data-metric=cost] td.left").inner_text() == "$1.88"
    assert "Resets on 1 " in month.inner_text()
    assert "Resets at 00:00" in today.inner_text()
    assert "synth-user" not in page.content()
    page.screenshot(path=str(SCREENSHOTS / "my-usage.png"), full_page=True)
    assert page.errors == []
