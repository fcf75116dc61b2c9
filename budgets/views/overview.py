"""The staff overview and the live charts. Figures start from SQL aggregates (budgets/charts.py);
the page's JS then folds in one point per settled request pushed over /ws/dashboard/."""

from __future__ import annotations

from dataclasses import asdict

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from .. import charts
from ..models import AuditEntry, Feature
from ..money import format_usd
from ..permissions import staff_required
from ..tags import TAG_RULE, is_tag, normalise_tag


@staff_required
def overview(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    spend = charts.provider_spend_this_month(now)
    by_feature = charts.tokens_today_by_feature(now)
    data = {
        "providers": [asdict(p) for p in spend],
        "features": by_feature,
        "ttft": charts.ttft_percentiles(now),
    }
    context = {
        "spend": [(p, format_usd(p.spent_micro_usd), format_usd(p.limit_micro_usd) if p.limit_micro_usd else "no limit") for p in spend],
        "features": by_feature,
        "last_hour": charts.last_hour_counts(now),
        "alerts": charts.alerts_this_month(now),
        "cache": _cache_view(charts.cache_savings_this_month(now)),
        "retrieval": charts.retrieval_cache_this_month(now),
        "ttft": data["ttft"],
        "weights": feature_weights(),
        "overview_data": data,
    }
    return render(request, "budgets/overview.html", context)


def feature_weights() -> list[dict]:
    """Each enabled feature's weights and their latest switch: who (a person, or the start-up's
    adoption of the shipped verdict, which has no actor) and when, so a switch nobody clicked is seen."""
    features = list(Feature.objects.filter(enabled=True).order_by("name"))
    switches: dict[str, AuditEntry] = {}
    entries = AuditEntry.objects.select_related("actor").filter(
        field="quantization", target__in=[f"feature {f.name}" for f in features]).order_by("at")
    for entry in entries:
        switches[entry.target] = entry  # the latest wins
    return [{"feature": f, "switch": switches.get(f"feature {f.name}")} for f in features]


def _cache_view(savings: dict) -> dict:
    return {"hits": savings["hits"] or 0, "saved": format_usd(savings["saved_micro_usd"] or 0)}


@staff_required
def charts_page(request: HttpRequest) -> HttpResponse:
    range_name = request.GET.get("range", "24h")
    if range_name not in charts.RANGES:
        range_name = "24h"
    tag = normalise_tag(request.GET.get("tag", ""))
    tag_error = "" if not tag or is_tag(tag) else f"{tag[:40]!r} is not a tag: a tag is {TAG_RULE}."
    tag = tag if not tag_error else ""
    now = timezone.now()
    series = charts.feature_series(now, range_name, tag)
    back = charts.RANGES[range_name][0]
    data = {
        "range": range_name,
        "tag": tag,  # the live feed carries no tags: a tagged view is redrawn on reload only
        "x_range": [(now - back).isoformat(), now.isoformat()],
        "bucket_s": int(charts.RANGES[range_name][2].total_seconds()),
        "series": {name: asdict(s) for name, s in series.items()},
        "refusals": asdict(charts.refusal_series(now, range_name, tag)),
        "retrieval_latency": asdict(charts.retrieval_latency_series(now, range_name, tag)),
    }
    return render(request, "budgets/charts.html",
                  {"charts_data": data, "range": range_name, "tag": tag, "tag_error": tag_error})


