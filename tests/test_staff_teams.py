"""The staff teams pages: each team's usage against its caps, its members and caps, all audited."""

from __future__ import annotations

import itertools

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets.actions import do_create_team
from budgets.models import AuditEntry, Team, TeamMembership, TeamQuota, TokenLog
from tests.test_staff_config import caps_data

pytestmark = pytest.mark.django_db

_ids = itertools.count()


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


@pytest.fixture
def support(alice, bob) -> Team:
    team, _ = do_create_team(None, "Support", [alice, bob])
    return team


def settled(user, team, feature, *, tokens: int, cost: int, n: int) -> None:
    TokenLog.objects.bulk_create([
        TokenLog(request_id=f"r{next(_ids)}", user=user, team=team, feature=feature, model="m",
                 status=TokenLog.Status.OK, prompt_tokens=tokens, cost_micro_usd=cost, created_at=timezone.now())
        for _ in range(n)
    ])


def test_the_teams_page_shows_each_teams_usage_against_its_caps(staff_client, support, alice, bob, chat_feature):
    TeamQuota.objects.create(team=support, period="month", max_cost_micro_usd=50_000_000, max_requests=100)
    settled(alice, support, chat_feature, tokens=10, cost=24_100_000, n=1)
    settled(bob, support, chat_feature, tokens=10, cost=24_100_000, n=1)
    settled(bob, None, chat_feature, tokens=10, cost=1_000_000, n=1)  # before bob joined: not the team's

    page = staff_client.get(reverse("staff-teams")).content.decode()

    assert reverse("staff-team", args=[support.pk]) in page and "Support" in page
    assert "$48.20" in page and "$50.00" in page
    assert ">2<" in page  # members
    detail = staff_client.get(reverse("staff-team", args=[support.pk])).content.decode()
    assert "$48.20" in detail and "alice" in detail and "bob" in detail


def test_end_users_cannot_see_the_teams_pages(client, alice, support):
    client.force_login(alice)
    assert client.get(reverse("staff-teams")).status_code == 403
    assert client.get(reverse("staff-team", args=[support.pk])).status_code == 403


def test_staff_create_a_team_and_add_and_remove_members_with_an_audit_trail(staff_client, staff, alice, support):
    response = staff_client.post(reverse("staff-teams"), {"name": "Sales"})
    sales = Team.objects.get(name="Sales")
    assert response.url == reverse("staff-team", args=[sales.pk])

    staff_client.post(reverse("staff-team", args=[sales.pk]), {"add_member": "1", "username": "alice"})
    # Still in Support: a user may be in several teams (the first joined pays unless one is named).
    assert set(TeamMembership.objects.filter(user=alice).values_list("team__name", flat=True)) == {"Support", "Sales"}
    staff_client.post(reverse("staff-team", args=[sales.pk]), {"remove_member": str(alice.pk)})
    assert list(TeamMembership.objects.filter(user=alice).values_list("team__name", flat=True)) == ["Support"]

    trail = list(AuditEntry.objects.filter(actor=staff).order_by("id").values_list("target", "field", "before", "after"))
    assert trail == [
        ("team Sales", "name", "", "Sales"),
        ("user alice", "team", "Support", "Support, Sales"),
        ("user alice", "team", "Support, Sales", "Support"),
    ]


def test_adding_someone_who_does_not_exist_says_so(staff_client, support):
    response = staff_client.post(reverse("staff-team", args=[support.pk]), {"add_member": "1", "username": "nobody"})
    assert "There is no user named “nobody”." in response.content.decode()


def test_staff_set_a_teams_caps_per_period_and_feature_with_an_audit_trail(staff_client, staff, support, chat_feature):
    url = reverse("staff-team", args=[support.pk])
    page = staff_client.get(url)
    data = caps_data(page, **{"all-month-max_cost_usd": "50", f"{chat_feature.pk}-day-max_requests": "20"})
    staff_client.post(url, {**data, "save_caps": "1"})

    assert TeamQuota.objects.get(team=support, feature=None, period="month").max_cost_micro_usd == 50_000_000
    assert TeamQuota.objects.get(team=support, feature=chat_feature, period="day").max_requests == 20
    trail = set(AuditEntry.objects.filter(actor=staff).values_list("target", "field", "before", "after"))
    assert ("team quota Support/all/month", "max_cost", "no cap", "$50.00") in trail
    assert ("team quota Support/chat/day", "max_requests", "no cap", "20") in trail


def test_a_bad_cap_changes_nothing(staff_client, support):
    url = reverse("staff-team", args=[support.pk])
    data = caps_data(staff_client.get(url), **{"all-month-max_cost_usd": "50", "all-day-max_requests": "-3"})
    response = staff_client.post(url, {**data, "save_caps": "1"})
    assert "Nothing was saved" in response.content.decode()
    assert not TeamQuota.objects.exists()


def test_the_token_log_filters_by_tag_and_by_team_and_shows_the_tags(staff_client, support, alice, bob, chat_feature):
    common = dict(feature=chat_feature, model="m", status=TokenLog.Status.OK, created_at=timezone.now())
    TokenLog.objects.bulk_create([
        TokenLog(request_id="tagged-support", user=alice, team=support, tags=",support,beta,", **common),
        TokenLog(request_id="tagged-beta", user=bob, team=None, tags=",beta,", **common),
        TokenLog(request_id="tagged-supported", user=bob, team=None, tags=",supported,", **common),
    ])

    def ids(**query) -> set[str]:
        response = staff_client.get(reverse("staff-logs"), query)
        assert response.status_code == 200
        return {row.request_id for row in response.context["rows"]}

    assert ids(tag="support") == {"tagged-support"}  # not "supported": whole names only
    assert ids(tag="beta") == {"tagged-support", "tagged-beta"}
    assert ids(team="Support") == {"tagged-support"}
    assert '<span class="tag">beta</span>' in staff_client.get(reverse("staff-logs")).content.decode()
    assert staff_client.get(reverse("staff-logs"), {"tag": "Not a tag"}).status_code == 400
    assert staff_client.get(reverse("staff-logs"), {"team": "Nobody"}).status_code == 400


def test_the_tags_page_shows_each_tags_spend_against_its_cap_and_sets_caps_with_an_audit_trail(
        staff_client, staff, alice, bob, chat_feature):
    common = dict(feature=chat_feature, model="m", status=TokenLog.Status.OK, created_at=timezone.now())
    TokenLog.objects.bulk_create([
        TokenLog(request_id="t1", user=alice, tags=",support,", cost_micro_usd=1_500_000, **common),
        TokenLog(request_id="t2", user=bob, tags=",beta,support,", cost_micro_usd=1_000_000, **common),
        TokenLog(request_id="t3", user=bob, tags=",supported,", cost_micro_usd=9_000_000, **common),
    ])
    assert staff_client.post(reverse("staff-tags"), {"tag": "support", "max_cost_usd": "10"}).status_code == 302

    page = staff_client.get(reverse("staff-tags")).content.decode()
    assert "$2.50" in page and "$10.00" in page  # alice's and bob's, not the 'supported' row
    assert ("tag quota support/month", "max_cost", "no cap", "$10.00") in set(
        AuditEntry.objects.filter(actor=staff).values_list("target", "field", "before", "after"))
    assert staff_client.post(reverse("staff-tags"), {"tag": "support", "max_cost_usd": ""}).status_code == 302
    assert "No tag has a cap yet." in staff_client.get(reverse("staff-tags")).content.decode()
    bad = staff_client.post(reverse("staff-tags"), {"tag": "Not a tag", "max_cost_usd": "1"})
    assert bad.status_code == 200 and "A tag is 1 to 32 lowercase letters" in bad.content.decode()


# --- deleting a team -------------------------------------------------------------------------------


def test_staff_delete_a_team_after_confirming_its_name_and_its_members_are_released(
    staff_client, staff, support, alice, bob, chat_feature
):
    from budgets.guard import request_scopes
    from budgets.models import AlertWebhook

    TeamQuota.objects.create(team=support, period="month", max_cost_micro_usd=50_000_000)
    AlertWebhook.objects.create(team=support, url="https://hooks.example.com/support", secret="s")
    settled(alice, support, chat_feature, tokens=10, cost=1_000, n=3)
    url = reverse("staff-team-delete", args=[support.pk])
    assert f'href="{url}"' in staff_client.get(reverse("staff-team", args=[support.pk])).content.decode()

    confirm = staff_client.get(url).content.decode()
    assert "Delete the team Support?" in confirm and "Its 2 members will be in no team" in confirm
    assert "Its 1 cap and 1 webhook are removed." in confirm
    wrong = staff_client.post(url, {"confirm_name": "support"})  # not the name exactly: nothing happens
    assert wrong.status_code == 400 and "Type the team&#x27;s name, Support, to delete it." in wrong.content.decode()
    assert Team.objects.filter(pk=support.pk).exists()

    deleted = staff_client.post(url, {"confirm_name": "Support"}, follow=True)

    assert deleted.redirect_chain == [(reverse("staff-teams"), 302)]
    assert "Deleted the team Support; members released: 2." in deleted.content.decode()
    assert not Team.objects.exists() and not TeamMembership.objects.exists()
    assert not TeamQuota.objects.exists() and not AlertWebhook.objects.exists()
    assert TokenLog.objects.count() == 3 and not TokenLog.objects.filter(team__isnull=False).exists()  # the ledger stays
    assert request_scopes(alice).team is None  # her next request counts against no team
    trail = {(e.target, e.field): (e.action, e.before, e.after, e.actor_id) for e in AuditEntry.objects.filter(actor=staff)}
    assert trail == {
        ("team Support", "name"): ("delete", "Support", "", staff.pk),
        ("team Support", "caps"): ("delete", "1", "", staff.pk),
        ("team Support", "webhooks"): ("delete", "1", "", staff.pk),
        ("user alice", "team"): ("update", "Support", "none", staff.pk),
        ("user bob", "team"): ("update", "Support", "none", staff.pk),
    }


def test_end_users_cannot_delete_a_team(client, alice, support):
    client.force_login(alice)
    url = reverse("staff-team-delete", args=[support.pk])
    assert client.get(url).status_code == 403
    assert client.post(url, {"confirm_name": "Support"}).status_code == 403
    assert Team.objects.filter(pk=support.pk).exists() and TeamMembership.objects.count() == 2


def test_deleting_a_team_that_is_gone_is_a_404(staff_client, support):
    url = reverse("staff-team-delete", args=[support.pk])
    assert staff_client.post(url, {"confirm_name": "Support"}).status_code == 302
    assert staff_client.post(url, {"confirm_name": "Support"}).status_code == 404
