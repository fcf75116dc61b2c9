"""Users and quotas, defaults, features, providers and prices, audit trail (staff only).

Input comes through a Form; every change is saved by budgets.actions with one AuditEntry per
changed field in the same transaction, and a form that is not valid changes nothing. Usage is read
from the TokenLog ledger by budgets.usage, one aggregate query per page, never row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.db import transaction
from django.db.models import Count, Max, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from ..actions import PRICE_FIELDS, do_save_provider, do_save_with_audit, do_set_in_flight_cap, do_set_quota, snapshot
from ..forecast import forecasts_by_scope, provider_caps, user_caps
from ..forms import (
    AuditFilterForm,
    CapsForm,
    FeatureForm,
    InFlightForm,
    PriceForm,
    ProviderForm,
    SearchForm,
    caps_forms,
    describe_caps,
    known_models,
)
from ..models import AuditEntry, Feature, InFlightCap, ModelPrice, Period, Provider, Quota, TokenLog, memberships_of
from ..money import exact_usd, format_usd
from ..permissions import staff_required
from ..selfhosted import LocalCost
from ..usage import NO_USAGE, Gauge, caps_of, effective_caps, gauges, total_usage, usage_by

USERS_PER_PAGE = 50
AUDIT_PER_PAGE = 50
PRICES_PER_PAGE = 50
# Every field the form edits is saved and audited: a field missing here would be shown, accepted
# and silently dropped on an existing feature (as mode and the cache settings once were).
FEATURE_FIELDS = tuple(FeatureForm.Meta.fields)
PROVIDER_FIELDS = ("name", "kind", "base_url", "remote_model", "api_key_env", "api_key_encrypted",
                   "monthly_limit_micro_usd", "alert_thresholds", "alert_recipients",
                   "hourly_cost_micro_usd", "utilisation_percent")


# --- users and their caps ------------------------------------------------------------------------


@dataclass(frozen=True)
class UserRow:
    user: object
    own_periods: list[str]
    day: list[Gauge]
    month: list[Gauge]


@staff_required
def users(request: HttpRequest) -> HttpResponse:
    search = SearchForm(request.GET)
    query = search.cleaned_data["q"].strip() if search.is_valid() else ""
    people = get_user_model().objects.order_by("username")
    if query:
        people = people.filter(Q(username__icontains=query) | Q(email__icontains=query))
    page = Paginator(people, USERS_PER_PAGE).get_page(request.GET.get("page"))
    ids = [person.pk for person in page]
    usage = usage_by(TokenLog.objects.filter(user_id__in=ids), "user_id", timezone.now())
    quotas = Quota.objects.filter(feature__isnull=True).filter(Q(user_id__in=ids) | Q(user__isnull=True))
    defaults = {q.period: q for q in quotas if q.user_id is None}
    own = {(q.user_id, q.period): q for q in quotas if q.user_id is not None}
    projected = forecasts_by_scope(user_caps(timezone.now(), user_ids=ids), timezone.now())
    rows = []
    for person in page:
        used = usage.get(person.pk, NO_USAGE)
        # A user's own row replaces the default for its period as a whole (as in the guard).
        caps = {period: caps_of(own.get((person.pk, period)) or defaults.get(period)) for period in Period.values}
        own_periods = [period for period in Period.values if (person.pk, period) in own]
        day, month = (
            with_forecast(gauges(used[period], caps[period]), projected.get((f"user:{person.get_username()}", period)))
            for period in (Period.DAY, Period.MONTH)
        )
        rows.append(UserRow(person, own_periods, day, month))
    return render(request, "budgets/users.html", {"page": page, "rows": rows, "search": search, "query": query})


def _teams_of(person) -> list:
    """The person's teams, the one that pays by default (joined first) first."""
    return [m.team for m in memberships_of(person.pk).select_related("team")]


def with_forecast(row: list[Gauge], projection) -> list[Gauge]:
    """The gauges with the cost cap's projection beside it (the last gauge is the cost)."""
    if projection is None:
        return row
    return [*row[:-1], replace(row[-1], forecast=projection.text)]


@staff_required
def user_detail(request: HttpRequest, user_id: int) -> HttpResponse:
    person = get_object_or_404(get_user_model(), pk=user_id)
    features = list(Feature.objects.order_by("name"))
    quotas = list(Quota.objects.filter(Q(user=person) | Q(user__isnull=True)))
    data = request.POST if request.method == "POST" else None
    forms = caps_forms(data, user=person, features=features, quotas=quotas)
    in_flight = _in_flight_form(data, person)
    if request.method == "POST" and _save_caps(request, forms, in_flight, user=person) is not None:
        return redirect("staff-user", person.pk)
    usage = usage_by(TokenLog.objects.filter(user=person), "feature_id", timezone.now())
    total = total_usage(list(usage.values()))
    for form in forms:
        form.used = (usage.get(form.feature.pk, NO_USAGE) if form.feature else total)[form.period]
        form.default_text = describe_caps(form.default_caps)
    scoped = {(q.user_id is not None, q.period): q for q in quotas if q.feature_id is None}
    projected = forecasts_by_scope(user_caps(timezone.now(), user_ids=[person.pk]), timezone.now())
    summary = []
    for period, label in ((Period.DAY, "Today"), (Period.MONTH, "This month")):
        caps, own = effective_caps(scoped, period)
        row = with_forecast(gauges(total[period], caps), projected.get((f"user:{person.get_username()}", period)))
        summary.append({"label": label, "own": own, "gauges": row})
    context = {"person": person, "scopes": _scopes(forms), "summary": summary, "for_user": True,
               "keys": person.api_keys.filter(revoked_at__isnull=True),
               "teams": _teams_of(person), "in_flight_form": in_flight}
    return render(request, "budgets/user_detail.html", context)


@staff_required
def defaults(request: HttpRequest) -> HttpResponse:
    features = list(Feature.objects.order_by("name"))
    quotas = list(Quota.objects.filter(user__isnull=True))
    data = request.POST if request.method == "POST" else None
    forms = caps_forms(data, user=None, features=features, quotas=quotas)
    in_flight = _in_flight_form(data, None)
    if request.method == "POST" and _save_caps(request, forms, in_flight, user=None) is not None:
        return redirect("staff-defaults")
    overrides = Quota.objects.filter(user__isnull=False).values("user_id").distinct().count()
    context = {"scopes": _scopes(forms), "for_user": False, "overrides": overrides, "in_flight_form": in_flight}
    return render(request, "budgets/defaults.html", context)


def _scopes(forms: list[CapsForm]) -> list[tuple[str, list[CapsForm]]]:
    # caps_forms() puts the two all-features forms first.
    per_scope = len(Period.values)  # caps_forms: every period of one scope, then the next scope
    return [("All features", forms[:per_scope]), ("Per feature", forms[per_scope:])]


def _in_flight_form(data, person) -> InFlightForm:
    caps = dict(InFlightCap.objects.filter(Q(user=person) | Q(user__isnull=True)).values_list("user_id", "max_in_flight"))
    if person is None:
        return InFlightForm(data, current=caps.get(None), for_user=False)
    return InFlightForm(data, current=caps.get(person.pk), default=caps.get(None), for_user=True)


def _save_caps(request: HttpRequest, forms: list[CapsForm], in_flight: InFlightForm, *, user) -> int | None:
    """Save every scope whose form changed, all or nothing; None (and the errors shown) when any is invalid."""
    if not all([form.is_valid() for form in [*forms, in_flight]]):  # a list: every form shows its errors
        messages.error(request, "Nothing was saved: please correct the errors below.")
        return None
    with transaction.atomic():
        entries = [
            entry
            for form in forms
            if form.has_changed()
            for entry in do_set_quota(request.user, user=user, feature=form.feature, period=form.period, caps=form.caps())
        ]
        if in_flight.has_changed():
            entries += do_set_in_flight_cap(request.user, user, in_flight.value())
    flash_saved(request, len(entries))
    return len(entries)


def flash_saved(request: HttpRequest, changes: int) -> None:
    if changes:
        messages.success(request, f"Saved ({changes} change{'s' if changes != 1 else ''}).")
    else:
        messages.info(request, "Saved — nothing had changed.")


# --- features ------------------------------------------------------------------------------------


@staff_required
def features(request: HttpRequest) -> HttpResponse:
    form = FeatureForm(request.POST if request.method == "POST" else None)
    if form.is_bound and form.is_valid():
        feature = form.instance
        do_save_with_audit(request.user, feature, FEATURE_FIELDS, None, target=f"feature {feature.name}")
        messages.success(request, f"Saved the new feature {feature.name}.")
        return redirect("staff-feature", feature.pk)
    rows = list(Feature.objects.select_related("provider", "fallback").order_by("name"))
    usage = usage_by(TokenLog.objects.all(), "feature_id", timezone.now())
    for feature in rows:
        feature.month = usage.get(feature.pk, NO_USAGE)[Period.MONTH]
        feature.month_cost = format_usd(feature.month.cost_micro_usd)
    return render(request, "budgets/features.html", {"features": rows, "form": form})


# --- providers and prices ------------------------------------------------------------------------


@staff_required
def providers(request: HttpRequest) -> HttpResponse:
    form = ProviderForm(request.POST if request.method == "POST" else None)
    if form.is_bound and form.is_valid():
        provider = form.instance
        do_save_provider(request.user, provider, PROVIDER_FIELDS, None, model=settings.CEILING_MODEL_NAME)
        messages.success(request, f"Saved the new provider {provider.name}.")
        return redirect("staff-provider", provider.pk)
    rows = list(Provider.objects.annotate(price_count=Count("prices")).order_by("name"))
    now = timezone.now()
    usage = usage_by(TokenLog.objects.all(), "provider_id", now)
    projected = forecasts_by_scope(provider_caps(rows), now)
    for provider in rows:
        spent = usage.get(provider.pk, NO_USAGE)[Period.MONTH].cost_micro_usd
        projection = projected.get((f"provider:{provider.name}", Period.MONTH))
        provider.spend = Gauge(
            spent, provider.monthly_limit_micro_usd, money=True, uncapped="no limit",
            forecast=projection.text if projection else "",
        )
    return render(request, "budgets/providers.html", {"providers": rows, "form": form})


@staff_required
def provider_detail(request: HttpRequest, provider_id: int) -> HttpResponse:
    provider = get_object_or_404(Provider, pk=provider_id)
    before = snapshot(provider, PROVIDER_FIELDS)
    local_cost = LocalCost.of(provider)  # now: a form that fails validation has changed the instance
    posted = request.POST.get("form") if request.method == "POST" else None
    provider_form = ProviderForm(request.POST if posted == "provider" else None, instance=provider)
    models = known_models(provider)
    price_form = PriceForm(request.POST if posted == "price" else None, provider=provider, known_models=models)
    if posted == "provider" and provider_form.is_valid():
        entries = do_save_provider(request.user, provider, PROVIDER_FIELDS, before, model=settings.CEILING_MODEL_NAME)
        flash_saved(request, len(entries))
        return redirect("staff-provider", provider.pk)
    if posted == "price" and price_form.is_valid():
        price = price_form.build()
        do_save_with_audit(request.user, price, PRICE_FIELDS, None, target=f"price {before['name']}/{price.model}")
        messages.success(request, f"Saved the new price of {price.model}.")
        return redirect("staff-provider", provider.pk)
    if posted in ("provider", "price"):
        messages.error(request, "Nothing was saved: please correct the errors below.")
    context = {
        "provider": provider,
        "local_cost": local_cost,
        "local_cost_output": exact_usd(local_cost.output_per_million()) if local_cost else "",
        "local_cost_input": exact_usd(local_cost.input_per_million()) if local_cost else "",
        "name": before["name"],
        "provider_form": provider_form,
        "price_form": price_form,
        "known_models": models,
    }
    context["page"], context["prices"], context["model_filter"] = _price_history(request, provider, timezone.now())
    return render(request, "budgets/provider_detail.html", context)


@dataclass(frozen=True)
class PriceRow:
    price: ModelPrice
    state: str  # "in force", "scheduled", or "" (replaced)

    # Exact dollars: prices per million tokens are often fractions of a cent per token.
    @property
    def input(self) -> str:
        return exact_usd(self.price.input_per_million_micro_usd)

    @property
    def output(self) -> str:
        return exact_usd(self.price.output_per_million_micro_usd)

    @property
    def cached_input(self) -> str:
        return exact_usd(self.price.cached_input_per_million_micro_usd)


def _price_history(request: HttpRequest, provider: Provider, now: datetime) -> tuple[Page, list[PriceRow], str]:
    """One page of the price history, newest first, each row marked in force / scheduled / replaced.

    A provider imported from the catalog can have thousands of rows, hence the pages; which row is
    in force for each model on the page takes one aggregate query, not one per model.
    """
    model_filter = request.GET.get("model", "").strip()
    prices = provider.prices.order_by("-effective_from", "model")
    if model_filter:
        prices = prices.filter(model__icontains=model_filter)
    page = Paginator(prices, PRICES_PER_PAGE).get_page(request.GET.get("page"))
    models_here = {price.model for price in page}
    in_force = dict(
        provider.prices.filter(model__in=models_here, effective_from__lte=now)
        .values("model")
        .annotate(latest=Max("effective_from"))
        .values_list("model", "latest")
    )
    rows = []
    for price in page:
        if price.effective_from > now:
            state = "scheduled"
        else:
            state = "in force" if in_force.get(price.model) == price.effective_from else ""
        rows.append(PriceRow(price, state))
    return page, rows, model_filter


# --- audit trail ---------------------------------------------------------------------------------


@staff_required
def audit(request: HttpRequest) -> HttpResponse:
    search = AuditFilterForm(request.GET)
    target = search.cleaned_data["target"].strip() if search.is_valid() else ""
    entries = AuditEntry.objects.select_related("actor").order_by("-at", "-id")
    if target:
        entries = entries.filter(target__icontains=target)
    page = Paginator(entries, AUDIT_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "budgets/audit.html", {"page": page, "search": search, "target": target})
