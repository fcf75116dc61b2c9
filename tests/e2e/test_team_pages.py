"""Teams in a real browser (Debian's chromium via Playwright): staff create a team, put alice in it,
give it a cap, and her next chat is refused with the team's name and numbers; the trail has it all."""

from __future__ import annotations

import pytest

from budgets.models import AuditEntry, Team, TeamQuota
from tests.conftest import session_cookie
from tests.e2e.test_staff_config_pages import chat_in_another_thread, clean_counters, log_in_as_staff, screenshot  # noqa: F401
from tests.wsclient import chat_frame

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_staff_create_a_team_cap_it_and_a_members_next_chat_is_refused(live_stack, page, staff, alice, chat_feature):
    log_in_as_staff(page, live_stack)
    page.get_by_role("link", name="Teams", exact=True).click()
    page.wait_for_url("**/staff/teams/")
    page.fill("#id_name", "Support")
    page.get_by_role("button", name="Create team").click()
    team = Team.objects.get(name="Support")
    page.wait_for_url(f"**/staff/teams/{team.pk}/")

    page.fill("#id_username", "alice")
    page.get_by_role("button", name="Add", exact=True).click()
    page.wait_for_url(f"**/staff/teams/{team.pk}/")
    assert page.get_by_role("link", name="alice", exact=True).is_visible()
    page.fill("input[name='all-day-max_requests']", "0")
    page.get_by_role("button", name="Save caps").click()
    page.wait_for_url(f"**/staff/teams/{team.pk}/")
    assert "Saved (1 change)." in page.content()
    assert TeamQuota.objects.get(team=team, feature=None, period="day").max_requests == 0
    screenshot(page, "staff-team")

    frames = chat_in_another_thread(live_stack, session_cookie(alice), chat_frame("Say yes.", 2))
    refused = frames[-1]
    assert refused["type"] == "refused" and refused["code"] == "team_requests_per_day"
    assert refused["message"].startswith("Your team 'Support' has made 0 of its 0 requests for today.")

    page.goto(f"{live_stack.http_url}/staff/teams/")
    row = page.locator("tr", has=page.get_by_role("link", name="Support", exact=True))
    assert "0 / 0" in row.inner_text()  # requests today against the cap; a refusal uses nothing
    screenshot(page, "staff-teams")
    trail = set(AuditEntry.objects.filter(actor=staff).values_list("target", "field", "after"))
    assert {("team Support", "name", "Support"), ("user alice", "team", "Support"),
            ("team quota Support/all/day", "max_requests", "0")} <= trail


def test_staff_give_a_team_alert_channels_then_delete_it_after_confirming(live_stack, page, staff, alice):
    from budgets.actions import do_create_team
    from budgets.models import AlertWebhook, TeamMembership

    team, _ = do_create_team(None, "Support", [alice])
    log_in_as_staff(page, live_stack)
    page.goto(f"{live_stack.http_url}/staff/teams/{team.pk}/")

    page.fill("#id_thresholds", "50, 90")
    page.fill("#id_recipients", "lead@example.com")
    page.get_by_role("button", name="Save alert settings").click()
    page.wait_for_url(f"**/staff/teams/{team.pk}/")
    team.refresh_from_db()
    assert (team.alert_thresholds, team.alert_recipients) == ([50, 90], "lead@example.com")

    page.fill("#id_url", "https://hooks.example.com/support")
    page.select_option("#id_body_format", "slack")
    page.get_by_role("button", name="Add webhook").click()
    page.wait_for_url(f"**/staff/teams/{team.pk}/")
    hook = AlertWebhook.objects.get(team=team)
    assert f"Its signing secret, shown only now: {hook.secret}" in page.content()
    assert "https://hooks.example.com/support" in page.locator("#team-webhooks").inner_text()
    screenshot(page, "staff-team-alerts")

    page.click("#delete-team")
    page.wait_for_url(f"**/staff/teams/{team.pk}/delete/")
    assert "Its 1 member will be in no team" in page.content()
    page.fill("#id_confirm_name", "Support")
    screenshot(page, "staff-team-delete")
    page.get_by_role("button", name="Delete the team").click()
    page.wait_for_url("**/staff/teams/")
    assert "Deleted the team Support; members released: 1." in page.content()
    assert not Team.objects.exists() and not TeamMembership.objects.exists() and not AlertWebhook.objects.exists()
    assert AuditEntry.objects.filter(actor=staff, target="team Support", action="delete", field="name").exists()
