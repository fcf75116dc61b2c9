"""Staff in a real browser: the engine panel shows each worker's weights; the int8 switch explains a refusal."""

from __future__ import annotations

import pytest

from tests.e2e.test_chat_page import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_engine_panel_shows_the_weights_each_worker_serves(live_stack, page, staff):
    log_in(page, live_stack, "staff", "staff-password-1", landing="/staff/")
    page.wait_for_function("document.querySelector('#engine-panel tbody').textContent.includes('MiB')")
    panel = page.locator("#engine-panel tbody").inner_text()
    assert "none · 513 MiB" in panel  # SmolLM2-135M in fp32: 538,060,288 bytes


def test_switching_a_never_evaluated_feature_to_int8_is_refused_with_the_reason(live_stack, page, staff, chat_feature):
    log_in(page, live_stack, "staff", "staff-password-1", landing=f"/staff/features/{chat_feature.pk}/")
    assert "No int8 evaluation yet" in page.locator("#weights").inner_text()
    page.get_by_role("button", name="Serve with int8 weights").click()
    flash = page.locator(".flash").inner_text()
    assert "Not switched: No int8 evaluation of chat has been run yet" in flash
    assert page.locator("#current-weights").inner_text() == "full precision"
