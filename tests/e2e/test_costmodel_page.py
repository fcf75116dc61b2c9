"""The cost model page in a real browser: charts render, nonsense is refused with a message."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings

from tests.e2e.test_chat_page import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_staff_model_a_feature_and_see_the_charts(live_stack, page, staff, chat_feature):
    log_in(page, live_stack, "staff", "staff-password-1", landing="/staff/costmodel/")
    page.locator("#cost-histogram .main-svg").first.wait_for(timeout=20_000)
    page.locator("#cost-vs-prompt .main-svg").first.wait_for(timeout=20_000)
    assert "/user/month the feature" in page.locator("#verdict h2").inner_text()
    assert page.locator("#controls tbody tr").count() == 5
    screenshots = Path(settings.BASE_DIR) / "var" / "screenshots"
    screenshots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(screenshots / "staff-costmodel.png"), full_page=True)

    # The browser's own min/max checks would stop this before the server: switch them off to see
    # the server refuse it (what a hand-edited URL or an old browser gets).
    page.evaluate("document.querySelector('form.costmodel-form').noValidate = true")
    page.fill("#id_users", "0")
    page.fill("#id_utilisation_percent", "250")
    page.click("form.costmodel-form button[type=submit]")
    page.wait_for_load_state()
    assert "greater than or equal to 1" in page.content()
    assert page.locator("#cost-histogram").count() == 0
