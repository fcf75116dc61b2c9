"""A user in several teams (issue #39): each request is paid by one team — the one X-Ceiling-Team or
the API key names, else the team the user joined first — and counts against that team's caps only."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client
from django.urls import reverse

from accounts.actions import do_create_api_key
from budgets.actions import do_create_team, do_delete_team, do_join_team, do_leave_team, do_rotate_api_key
from budgets.guard import AdmissionRequest, admit, request_scopes
from budgets.models import AuditEntry, Period, Team, TeamMembership, TeamQuota, TokenLog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def two_teams(alice):
    """alice joined Support first, then Research; each team allows 2 requests a day."""
    support, _ = do_create_team(None, "Support", [alice])
    research, _ = do_create_team(None, "Research", [alice])
    for team in (support, research):
        TeamQuota.objects.create(team=team, period=Period.DAY, max_requests=2)
    return support, research


def ask(user, feature, team: str = "", api_key=None):
    return admit(AdmissionRequest(uuid.uuid4().hex, user, feature, "test-model", 10, 10, api_key=api_key, team=team))


def test_the_team_joined_first_pays_unless_another_is_named(alice, chat_feature, two_teams):
    support, research = two_teams

    firsts = [ask(alice, chat_feature) for _ in range(3)]
    named = [ask(alice, chat_feature, team="Research") for _ in range(3)]

    assert [d.admitted for d in firsts] == [True, True, False]
    assert firsts[2].code == "team_requests_per_day" and "Your team 'Support'" in firsts[2].message
    # Research's caps were untouched by Support's requests: the caps of several teams never add up.
    assert [d.admitted for d in named] == [True, True, False]
    assert "Your team 'Research'" in named[2].message
    paid = TokenLog.objects.filter(status=TokenLog.Status.RUNNING).values_list("team__name", flat=True)
    assert sorted(paid) == ["Research", "Research", "Support", "Support"]


def test_an_api_keys_team_pays_for_its_requests_and_survives_rotation(alice, chat_feature, two_teams):
    key, _ = do_create_api_key(alice, "research-bot")
    key.team_name = "Research"
    key.save()

    assert request_scopes(alice, key).team.name == "Research"
    assert request_scopes(alice, key, team_name="Support").team.name == "Support"  # the header wins
    assert ask(alice, chat_feature, api_key=key).admitted
    assert TokenLog.objects.get(api_key=key).team.name == "Research"
    successor, _ = do_rotate_api_key(None, key.pk, grace=__import__("datetime").timedelta(hours=1))
    assert successor.team_name == "Research"


def test_a_name_the_user_is_not_in_falls_back_to_the_first_team(alice, chat_feature, two_teams):
    """The API refuses such a name before the guard (team_not_member); if the membership ends in
    between, the request is still paid by a team of the user's, never by none."""
    assert request_scopes(alice, team_name="Sales").team.name == "Support"


def test_joining_keeps_other_teams_and_leaving_removes_one(alice, two_teams):
    support, research = two_teams
    ops = Team.objects.create(name="Ops")

    do_join_team(None, alice, ops)
    assert do_join_team(None, alice, ops) == []  # already in it
    do_leave_team(None, alice, support)

    assert list(TeamMembership.objects.filter(user=alice).order_by("joined_at").values_list("team__name", flat=True)) == ["Research", "Ops"]
    trail = list(AuditEntry.objects.filter(target="user alice").order_by("pk").values_list("before", "after"))
    assert trail[-2:] == [("Support, Research", "Support, Research, Ops"), ("Support, Research, Ops", "Research, Ops")]


def test_deleting_a_team_leaves_its_members_other_teams(alice, two_teams):
    support, _ = two_teams
    do_delete_team(None, support)
    assert list(TeamMembership.objects.filter(user=alice).values_list("team__name", flat=True)) == ["Research"]


def test_the_team_page_adds_a_member_without_moving_them(alice, staff, two_teams):
    ops = Team.objects.create(name="Ops")
    client = Client()
    client.force_login(staff)

    response = client.post(reverse("staff-team", args=[ops.pk]), {"add_member": "1", "username": "alice"}, follow=True)

    assert "alice is now in Ops (also in Support, Research" in response.content.decode()
    assert TeamMembership.objects.filter(user=alice).count() == 3
    page = client.get(reverse("staff-user", args=[alice.pk])).content.decode()
    assert "Each request counts against one of them" in page and "else Support (joined first)" in page


def test_the_key_page_chooses_among_the_users_teams(alice, two_teams):
    key, _ = do_create_api_key(alice, "bot")
    client = Client()
    client.force_login(alice)
    url = reverse("api-key-caps", args=[key.pk])

    assert client.post(url, {"team_name": "Research"}).status_code == 302
    key.refresh_from_db()
    assert key.team_name == "Research"
    refused = client.post(url, {"team_name": "Sales"})
    assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()
