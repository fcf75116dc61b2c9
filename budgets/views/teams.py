"""Teams and tags (staff only): each team's usage against its caps, its members, its caps, its alert
channels (thresholds, recipients, webhooks); deleting a team; each tag's spend this month against its
cap, with its forecast; every change audited.

As the users pages: input through Forms, writes through budgets.actions (one AuditEntry per changed
field, in the same transaction), usage from one aggregate query over the ledger rows that record
the team (TokenLog.team: the team the request was admitted under, as the guard counted it).
"""

from __future__ import annotations

from dataclasses import dataclass

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from ..actions import (
    do_create_team,
    do_create_webhook,
    do_delete_team,
    do_join_team,
    do_leave_team,
    do_set_tag_quota,
    do_set_team_alerts,
    do_set_team_quota,
)
from ..forecast import forecasts_by_scope, tag_caps, team_caps
from ..forms import NOT_NEGATIVE, CapsForm, DollarsField, TagField, TeamAlertsForm, TeamWebhookForm, to_micro_usd
from ..models import (
    Feature,
    Period,
    TagQuota,
    Team,
    TeamMembership,
    TeamQuota,
    TokenLog,
    WebhookDelivery,
    tag_validator,
)
from ..permissions import staff_required
from ..usage import NO_USAGE, Gauge, caps_of, gauges, tag_month_spend, total_usage, usage_by
from ..webhooks import new_secret
from .config import flash_saved, with_forecast

TEAMS_PER_PAGE = 50


class TeamForm(forms.ModelForm):
    class Meta:
        model = Team
        fields = ["name"]


class MemberForm(forms.Form):
    username = forms.CharField(max_length=150, label="Add a member")

    def clean_username(self):
        username = self.cleaned_data["username"].strip()
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise forms.ValidationError(f"There is no user named “{username}”.")
        return user


@dataclass(frozen=True)
class TeamRow:
    team: Team
    members: int
    day: list[Gauge]
    month: list[Gauge]


@staff_required
def teams(request: HttpRequest) -> HttpResponse:
    form = TeamForm(request.POST if request.method == "POST" else None)
    if form.is_bound and form.is_valid():
        team, _ = do_create_team(request.user, form.cleaned_data["name"])
        messages.success(request, f"Created the team {team.name}.")
        return redirect("staff-team", team.pk)
    page = Paginator(Team.objects.annotate(member_count=Count("memberships")).order_by("name"), TEAMS_PER_PAGE).get_page(
        request.GET.get("page")
    )
    ids = [team.pk for team in page]
    usage = usage_by(TokenLog.objects.filter(team_id__in=ids), "team_id", timezone.now())
    quotas = {(q.team_id, q.period): q for q in TeamQuota.objects.filter(team_id__in=ids, feature__isnull=True)}
    projected = forecasts_by_scope(team_caps(team_ids=ids), timezone.now())
    rows = [
        TeamRow(
            team, team.member_count,
            *(with_forecast(gauges(usage.get(team.pk, NO_USAGE)[period], caps_of(quotas.get((team.pk, period)))),
                            projected.get((f"team:{team.name}", period)))
              for period in (Period.DAY, Period.MONTH)),
        )
        for team in page
    ]
    return render(request, "budgets/teams.html", {"page": page, "rows": rows, "form": form})


def _posted(request: HttpRequest, button: str):
    """The POST data when this form's button was pressed, else None (one page, several forms)."""
    return request.POST if request.method == "POST" and button in request.POST else None


@staff_required
def team_detail(request: HttpRequest, team_id: int) -> HttpResponse:
    team = get_object_or_404(Team, pk=team_id)
    features = list(Feature.objects.order_by("name"))
    quotas = {(q.feature_id, q.period): q for q in TeamQuota.objects.filter(team=team)}
    data = _posted(request, "save_caps")
    caps = [
        CapsForm(data, prefix=f"{feature.pk if feature else 'all'}-{period}", feature=feature, period=period,
                 current=quotas.get((feature.pk if feature else None, period)))
        for feature in [None, *features]
        for period in Period.values
    ]
    member_form = MemberForm(_posted(request, "add_member"))
    alerts_form = TeamAlertsForm(_posted(request, "save_alerts"), team=team)
    webhook_form = TeamWebhookForm(_posted(request, "add_webhook"))
    if data is not None:
        if all([form.is_valid() for form in caps]):
            with transaction.atomic():
                changes = sum(
                    len(do_set_team_quota(request.user, team=team, feature=form.feature, period=form.period,
                                          caps=form.caps()))
                    for form in caps if form.has_changed()
                )
            flash_saved(request, changes)
            return redirect("staff-team", team.pk)
        messages.error(request, "Nothing was saved: please correct the errors below.")
    elif member_form.is_bound and member_form.is_valid():
        person = member_form.cleaned_data["username"]
        do_join_team(request.user, person, team)
        others = list(TeamMembership.objects.filter(user=person).exclude(team=team).values_list("team__name", flat=True))
        also = f" (also in {', '.join(others)}; the team they joined first pays unless a key or X-Ceiling-Team names another)" if others else ""
        messages.success(request, f"{person.get_username()} is now in {team.name}{also}.")
        return redirect("staff-team", team.pk)
    elif alerts_form.is_bound and alerts_form.is_valid():
        flash_saved(request, len(do_set_team_alerts(
            request.user, team, thresholds=alerts_form.cleaned_data["thresholds"],
            recipients=alerts_form.cleaned_data["recipients"],
        )))
        return redirect("staff-team", team.pk)
    elif webhook_form.is_bound and webhook_form.is_valid():
        secret = new_secret()
        hook, _ = do_create_webhook(request.user, team=team, url=webhook_form.cleaned_data["url"],
                                    body_format=webhook_form.cleaned_data["body_format"], secret=secret)
        # Like an API key: shown this once, so it goes into the receiver's configuration now.
        messages.success(request, f"Saved webhook {hook.pk}. Its signing secret, shown only now: {secret}")
        return redirect("staff-team", team.pk)
    elif request.method == "POST" and "remove_member" in request.POST:
        membership = TeamMembership.objects.filter(team=team, user_id=request.POST.get("remove_member")).first()
        if membership is not None:
            do_leave_team(request.user, membership.user, team)
            messages.success(request, f"{membership.user.get_username()} is no longer in {team.name}.")
        return redirect("staff-team", team.pk)
    usage = usage_by(TokenLog.objects.filter(team=team), "feature_id", timezone.now())
    total = total_usage(list(usage.values()))
    projected = forecasts_by_scope(team_caps(team_ids=[team.pk]), timezone.now())
    summary = [
        {"label": label, "gauges": with_forecast(gauges(total[period], caps_of(quotas.get((None, period)))),
                                                 projected.get((f"team:{team.name}", period)))}
        for period, label in ((Period.DAY, "Today"), (Period.MONTH, "This month"))
    ]
    members = TeamMembership.objects.filter(team=team).select_related("user").order_by("user__username")
    context = {
        "team": team, "members": members, "member_form": member_form, "summary": summary,
        "scopes": [("All features", caps[:len(Period.values)]), ("Per feature", caps[len(Period.values):])], "for_user": False,
        "alerts_form": alerts_form, "webhook_form": webhook_form, "webhooks": _team_webhooks(team),
        "has_monthly_cost_cap": bool(getattr(quotas.get((None, Period.MONTH)), "max_cost_micro_usd", None)),
    }
    return render(request, "budgets/team_detail.html", context)


def _team_webhooks(team: Team) -> list[tuple]:
    """(webhook, its latest delivery or None) for the team page: a failing receiver shows here too."""
    hooks = list(team.webhooks.order_by("id"))
    latest = {}
    for delivery in WebhookDelivery.objects.filter(webhook__in=hooks).select_related("alert").order_by("webhook_id", "-id"):
        latest.setdefault(delivery.webhook_id, delivery)
    return [(hook, latest.get(hook.pk)) for hook in hooks]


@staff_required
def team_delete(request: HttpRequest, team_id: int) -> HttpResponse:
    """GET: what deleting the team does, and a form that asks for its name; POST: delete it."""
    team = get_object_or_404(Team, pk=team_id)
    members = TeamMembership.objects.filter(team=team).count()
    error = ""
    if request.method == "POST":
        if request.POST.get("confirm_name", "").strip() == team.name:
            name = team.name
            do_delete_team(request.user, team)
            messages.success(request, f"Deleted the team {name}; members released: {members}.")
            return redirect("staff-teams")
        error = f"Type the team's name, {team.name}, to delete it."
    context = {"team": team, "members": members, "caps": TeamQuota.objects.filter(team=team).count(),
               "webhooks": team.webhooks.count(), "error": error}
    return render(request, "budgets/team_delete.html", context, status=400 if error else 200)


# --- tags: a monthly spend cap per tag -------------------------------------------------------------


class TagCapForm(forms.Form):
    tag = TagField(max_length=32, validators=[tag_validator])
    max_cost_usd = DollarsField(label="Cost per month ($)", required=False, error_messages=NOT_NEGATIVE,
                                help_text="Empty removes the tag's cap.")


@staff_required
def tags(request: HttpRequest) -> HttpResponse:
    form = TagCapForm(request.POST if request.method == "POST" else None)
    if form.is_bound and form.is_valid():
        tag = form.cleaned_data["tag"]
        flash_saved(request, len(do_set_tag_quota(request.user, tag, to_micro_usd(form.cleaned_data["max_cost_usd"]))))
        return redirect("staff-tags")
    quotas = list(TagQuota.objects.order_by("tag"))
    now = timezone.now()
    spent = tag_month_spend([q.tag for q in quotas], now)
    projected = forecasts_by_scope(tag_caps([q.tag for q in quotas]), now) if quotas else {}
    rows = [
        (q, with_forecast([Gauge(spent[q.tag], q.max_cost_micro_usd, money=True)],
                          projected.get((f"tag:{q.tag}", Period.MONTH)))[0])
        for q in quotas
    ]
    return render(request, "budgets/tags.html", {"rows": rows, "form": form})
