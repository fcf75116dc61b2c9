"""The browser for every page test: Debian's chromium driven by Playwright (never a downloaded one)."""

from __future__ import annotations

import os
import shutil

import pytest
from django.db import connections

CHROMIUM = os.environ.get("CEILING_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def page(tmp_path):
    # Playwright's wait_for_function evaluates its predicate with eval(), which our Content Security
    # Policy forbids; page tests bypass the policy, and `strict_page` keeps it (tests/e2e/test_hostile_pages.py).
    yield from _browser_page(tmp_path, bypass_csp=True)


@pytest.fixture
def strict_page(tmp_path):
    """A page that enforces the site's CSP: wait with locators, never wait_for_function."""
    yield from _browser_page(tmp_path, bypass_csp=False)


def _browser_page(tmp_path, *, bypass_csp: bool):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the ORM calls the tests make are
    # plain blocking calls between browser steps, never inside the loop.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 860}, bypass_csp=bypass_csp)
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
