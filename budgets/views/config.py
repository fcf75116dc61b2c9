"""Users and quotas, defaults, features, providers and prices, audit trail (staff only).

Input comes through a Form; every change is saved by budgets.actions with one AuditEntry per
changed field in the same transaction, and a form that is not valid changes nothing. Usage is read
from the TokenLog ledger with one aggregate query per page, never row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.db import transaction
from django.db.models import Count, F, Max, Q, QuerySet, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from ..actions import do_save_with_audit, do_set_quota, exact_usd, snapshot
from ..counters import Usage
from ..forms import (
    AuditFilterForm,
    CapsForm,
    FeatureForm,
    PriceForm,
    ProviderForm,
    SearchForm,
    caps_forms,
    caps_of,
    describe_caps,
    known_models,
)
from ..guard import SETTLED
from ..models import AuditEntry, Feature, ModelPrice, Period, Provider, Quota, TokenLog
from ..money import format_usd
from ..periods import period_bounds
from ..permissions import staff_required

USERS_PER_PAGE = 50
AUDIT_PER_PAGE = 50
PRICES_PER_PAGE = 50
FEATURE_FIELDS = ("name", "description", "enabled", "max_input_tokens", "max_output_tokens", "provider")
PROVIDER_FIELDS = ("name", "kind", "monthly_limit_micro_usd", "alert_thresholds", "alert_recipients")
PRICE_FIELDS = (
    "model",
    "input_per_million_micro_usd",
    "output_per_million_micro_usd",
    "cached_input_per_million_micro_usd",
    "effective_from",
)
NO_USAGE = {Period.DAY: Usage(), Period.MONTH: Usage()}


# --- usage from the ledger -----------------------------------------------------------------------


@dataclass(frozen=True)
class Gauge:
    """What was used so far against a cap, as one table cell shows it."""

    used: int
    cap: int | None
    money: bool = False
    uncapped: str = "no cap"

    def _text(self, amount: int) -> str:
        return format_usd(amount) if self.money else f"{amount:,}"

    @property
    def used_text(self) -> str:
        return self._text(self.used)

    @property
    def cap_text(self) -> str:
        return self.uncapped if self.cap is None else self._text(self.cap)

    @property
    def full(self) -> bool:
        return self.cap is not None and self.used >= self.cap


def gauges(usage: Usage, caps: dict[str, int | None]) -> list[Gauge]:
    return [
        Gauge(usage.requests, caps["max_requests"]),
        Gauge(usage.tokens, caps["max_tokens"]),
        Gauge(usage.cost_micro_usd, caps["max_cost_micro_usd"], money=True),
    ]


def usage_by(logs: QuerySet, group_by: str, now: datetime) -> dict[object, dict[str, Usage]]:
    """Today's and this month's settled usage per `group_by` value: one aggregate query.

    Running and refused rows are not "used" (the guard counts them the same way); today lies
    inside this month, so one month-wide scan with a conditional filter gives both.
    """
    day_start, day_end = period_bounds(Period.DAY, now)
    month_start, month_end = period_bounds(Period.MONTH, now)
    today = Q(created_at__gte=day_start, created_at__lt=day_end)
    tokens = F("prompt_tokens") + F("completion_tokens")
    rows = (
        logs.filter(SETTLED, created_at__gte=month_start, created_at__lt=month_end)
        .order_by()
        .values(group_by)
        .annotate(
            day_requests=Count("id", filter=today),
            day_tokens=Sum(tokens, filter=today),
            day_cost=Sum("cost_micro_usd", filter=today),
            month_requests=Count("id"),
            month_tokens=Sum(tokens),
            month_cost=Sum("cost_micro_usd"),
        )
    )
    return {
        row[group_by]: {
            Period.DAY: Usage(row["day_requests"], row["day_tokens"] or 0, row["day_cost"] or 0),
            Period.MONTH: Usage(row["month_requests"], row["month_tokens"] or 0, row["month_cost"] or 0),
        }
        for row in rows
    }


def _total(usages: list[dict[str, Usage]]) -> dict[str, Usage]:
    """Sum of a few already-aggregated groups (one per feature), not of log rows."""
    return {
        period: Usage(
            sum(u[period].requests for u in usages),
            sum(u[period].tokens for u in usages),
            sum(u[period].cost_micro_usd for u in usages),
        )
        for period in (Period.DAY, Period.MONTH)
    }


def _effective(quotas: dict[tuple[bool, str], Quota], period: str) -> tuple[dict[str, int | None], bool]:
    """The caps in force for one period (a user's own row replaces the default) and whether they are own."""
    own = quotas.get((True, period))
    return caps_of(own or quotas.get((False, period))), own is not None


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
    rows = []
    for person in page:
        used = usage.get(person.pk, NO_USAGE)
        # A user's own row replaces the default for its period as a whole (as in the guard).
        caps = {period: caps_of(own.get((person.pk, period)) or defaults.get(period)) for period in Period.values}
        own_periods = [period for period in Period.values if (person.pk, period) in own]
        day, month = (gauges(used[period], caps[period]) for period in (Period.DAY, Period.MONTH))
        rows.append(UserRow(person, own_periods, day, month))
    return render(request, "budgets/users.html", {"page": page, "rows": rows, "search": search, "query": query})


@staff_required
def user_detail(request: HttpRequest, user_id: int) -> HttpResponse:
    person = get_object_or_404(get_user_model(), pk=user_id)
    features = list(Feature.objects.order_by("name"))
    quotas = list(Quota.objects.filter(Q(user=person) | Q(user__isnull=True)))
    forms = caps_forms(request.POST if request.method == "POST" else None, user=person, features=features, quotas=quotas)
    if request.method == "POST" and _save_caps(request, forms, user=person) is not None:
        return redirect("staff-user", person.pk)
    usage = usage_by(TokenLog.objects.filter(user=person), "feature_id", timezone.now())
    total = _total(list(usage.values()))
    for form in forms:
        form.used = (usage.get(form.feature.pk, NO_USAGE) if form.feature else total)[form.period]
        form.default_text = describe_caps(form.default_caps)
    scoped = {(q.user_id is not None, q.period): q for q in quotas if q.feature_id is None}
    summary = []
    for period, label in ((Period.DAY, "Today"), (Period.MONTH, "This month")):
        caps, own = _effective(scoped, period)
        summary.append({"label": label, "own": own, "gauges": gauges(total[period], caps)})
    context = {"person": person, "scopes": _scopes(forms), "summary": summary, "for_user": True}
    return render(request, "budgets/user_detail.html", context)


@staff_required
def defaults(request: HttpRequest) -> HttpResponse:
    features = list(Feature.objects.order_by("name"))
    quotas = list(Quota.objects.filter(user__isnull=True))
    forms = caps_forms(request.POST if request.method == "POST" else None, user=None, features=features, quotas=quotas)
    if request.method == "POST" and _save_caps(request, forms, user=None) is not None:
        return redirect("staff-defaults")
    overrides = Quota.objects.filter(user__isnull=False).values("user_id").distinct().count()
    context = {"scopes": _scopes(forms), "for_user": False, "overrides": overrides}
    return render(request, "budgets/defaults.html", context)


def _scopes(forms: list[CapsForm]) -> list[tuple[str, list[CapsForm]]]:
    # caps_forms() puts the two all-features forms first.
    return [("All features", forms[:2]), ("Per feature", forms[2:])]


def _save_caps(request: HttpRequest, forms: list[CapsForm], *, user) -> int | None:
    """Save every scope whose form changed, all or nothing; None (and the errors shown) when any is invalid."""
    if not all([form.is_valid() for form in forms]):  # a list: every form gets validated and shows its errors
        messages.error(request, "Nothing was saved: please correct the errors below.")
        return None
    with transaction.atomic():
        entries = [
            entry
            for form in forms
            if form.has_changed()
            for entry in do_set_quota(request.user, user=user, feature=form.feature, period=form.period, caps=form.caps())
        ]
    _flash_saved(request, len(entries))
    return len(entries)


def _flash_saved(request: HttpRequest, changes: int) -> None:
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
    rows = list(Feature.objects.select_related("provider").order_by("name"))
    usage = usage_by(TokenLog.objects.all(), "feature_id", timezone.now())
    for feature in rows:
        feature.month = usage.get(feature.pk, NO_USAGE)[Period.MONTH]
        feature.month_cost = format_usd(feature.month.cost_micro_usd)
    return render(request, "budgets/features.html", {"features": rows, "form": form})


@staff_required
def feature_detail(request: HttpRequest, feature_id: int) -> HttpResponse:
    feature = get_object_or_404(Feature.objects.select_related("provider"), pk=feature_id)
    if request.method == "POST" and request.POST.get("form") == "quantization":
        return _switch_quantization(request, feature)
    before = snapshot(feature, FEATURE_FIELDS)  # the form writes into the instance while validating
    form = FeatureForm(request.POST if request.method == "POST" else None, instance=feature)
    if form.is_bound and form.is_valid():
        entries = do_save_with_audit(request.user, feature, FEATURE_FIELDS, before, target=f"feature {feature.name}")
        _flash_saved(request, len(entries))
        return redirect("staff-feature", feature.pk)
    context = {"feature": feature, "name": before["name"], "form": form} | _quantization_context(feature)
    return render(request, "budgets/feature_detail.html", context)


def _quantization_context(feature: Feature) -> dict:
    """Each quantized variant's latest evaluation of the feature and why a switch to it would be refused (or None)."""
    from inference.actions import evaluation_refusal
    from inference.models import QuantizationEvaluation

    candidates = []
    for mode, label in Feature.Quantization.choices:
        if mode == Feature.Quantization.NONE:
            continue
        latest = QuantizationEvaluation.latest_for(feature, mode)  # one query per variant, read once
        candidates.append(
            {"mode": mode, "label": label, "evaluation": latest, "switch_refusal": evaluation_refusal(feature, mode, latest)}
        )
    return {"candidates": candidates}


def _switch_quantization(request: HttpRequest, feature: Feature) -> HttpResponse:
    """Serve the feature with other weights; refused with the reason unless its latest evaluation passed."""
    from inference.actions import SwitchRefused, do_switch_quantization

    mode = request.POST.get("quantization", "")
    try:
        entries = do_switch_quantization(request.user, feature, mode)
    except SwitchRefused as exc:
        messages.error(request, f"Not switched: {exc}")
    else:
        if entries:
            messages.success(request, f"{feature.name} is now served with {feature.get_quantization_display()}.")
        else:
            messages.info(request, f"{feature.name} was already served with {feature.get_quantization_display()}.")
    return redirect("staff-feature", feature.pk)


# --- providers and prices ------------------------------------------------------------------------


@staff_required
def providers(request: HttpRequest) -> HttpResponse:
    form = ProviderForm(request.POST if request.method == "POST" else None)
    if form.is_bound and form.is_valid():
        provider = form.instance
        do_save_with_audit(request.user, provider, PROVIDER_FIELDS, None, target=f"provider {provider.name}")
        messages.success(request, f"Saved the new provider {provider.name}.")
        return redirect("staff-provider", provider.pk)
    rows = list(Provider.objects.annotate(price_count=Count("prices")).order_by("name"))
    usage = usage_by(TokenLog.objects.all(), "provider_id", timezone.now())
    for provider in rows:
        spent = usage.get(provider.pk, NO_USAGE)[Period.MONTH].cost_micro_usd
        provider.spend = Gauge(spent, provider.monthly_limit_micro_usd, money=True, uncapped="no limit")
    return render(request, "budgets/providers.html", {"providers": rows, "form": form})


@staff_required
def provider_detail(request: HttpRequest, provider_id: int) -> HttpResponse:
    provider = get_object_or_404(Provider, pk=provider_id)
    before = snapshot(provider, PROVIDER_FIELDS)
    posted = request.POST.get("form") if request.method == "POST" else None
    provider_form = ProviderForm(request.POST if posted == "provider" else None, instance=provider)
    models = known_models(provider)
    price_form = PriceForm(request.POST if posted == "price" else None, provider=provider, known_models=models)
    if posted == "provider" and provider_form.is_valid():
        entries = do_save_with_audit(request.user, provider, PROVIDER_FIELDS, before, target=f"provider {provider.name}")
        _flash_saved(request, len(entries))
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
