"""Chart data for the staff overview and live charts: every number is one SQL aggregate.

Nothing here loops over TokenLog rows in Python; results are grouped rows (one per bucket and
feature at most), ready for Plotly traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, F, Q, Sum
from django.db.models.functions import TruncDay, TruncMinute

from .costmodel import latency_shares
from .models import Alert, Provider, TokenLog
from .periods import local_zone, period_bounds, period_key
from .tags import tag_filter

SETTLED = ~Q(status__in=[TokenLog.Status.RUNNING, TokenLog.Status.REFUSED])
TOKENS = F("prompt_tokens") + F("completion_tokens")


@dataclass(frozen=True)
class ProviderSpend:
    name: str
    spent_micro_usd: int
    limit_micro_usd: int | None


def provider_spend_this_month(now: datetime) -> list[ProviderSpend]:
    start, end = period_bounds("month", now)
    spent = dict(
        TokenLog.objects.filter(SETTLED, created_at__gte=start, created_at__lt=end)
        .values_list("provider_id")
        .annotate(total=Sum("cost_micro_usd"))
    )
    return [
        ProviderSpend(p.name, spent.get(p.pk) or 0, p.monthly_limit_micro_usd)
        for p in Provider.objects.order_by("name")
    ]


def tokens_today_by_feature(now: datetime) -> list[dict]:
    start, end = period_bounds("day", now)
    rows = (
        TokenLog.objects.filter(SETTLED, created_at__gte=start, created_at__lt=end)
        .values(name=F("feature__name"))
        .annotate(tokens=Sum(TOKENS), cost=Sum("cost_micro_usd"), requests=Count("id"))
        .order_by("-tokens")
    )
    return [{**row, "name": row["name"] or "(none)"} for row in rows]


def last_hour_counts(now: datetime) -> dict:
    counts = TokenLog.objects.filter(created_at__gte=now - timedelta(hours=1)).aggregate(
        requests=Count("id"),
        refused=Count("id", filter=Q(status=TokenLog.Status.REFUSED)),
        failed=Count("id", filter=Q(status=TokenLog.Status.FAILED)),
    )
    return counts


def cache_savings_this_month(now: datetime) -> dict:
    start, end = period_bounds("month", now)
    return TokenLog.objects.filter(created_at__gte=start, created_at__lt=end).exclude(cache="").aggregate(
        hits=Count("id"), saved_micro_usd=Sum("saved_micro_usd")
    )


@dataclass(frozen=True)
class RetrievalCacheStats:
    lookups: int
    hits: int
    saved_ms: int
    mean_retrieval_ms: float | None  # over every docs request, hit or miss

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


def retrieval_cache_this_month(now: datetime) -> RetrievalCacheStats:
    """The retrieval cache's lookups, hits and the milliseconds it saved this month, from the ledger."""
    start, end = period_bounds("month", now)
    sums = TokenLog.objects.filter(created_at__gte=start, created_at__lt=end).exclude(retrieval_cache="").aggregate(
        lookups=Count("id"), hits=Count("id", filter=Q(retrieval_cache="hit")),
        saved=Sum("retrieval_saved_ms"), mean=Avg("retrieval_ms"),
    )
    return RetrievalCacheStats(sums["lookups"], sums["hits"], sums["saved"] or 0, sums["mean"])


def alerts_this_month(now: datetime) -> list[Alert]:
    # startswith: a spike or a daily cap's alert is keyed by its day, "2026-12-03", inside the month.
    return list(Alert.objects.filter(period_key__startswith=period_key("month", now)).order_by("-created_at")[:20])


def percentile(queryset, field: str, fraction: float) -> int | None:
    """The value at `fraction` of an ordered column: a count and one OFFSET query (any database)."""
    values = queryset.exclude(**{f"{field}__isnull": True})
    count = values.count()
    if not count:
        return None
    index = min(count - 1, int(fraction * count))
    return values.order_by(field).values_list(field, flat=True)[index]


def ttft_percentiles(now: datetime, window: timedelta = timedelta(hours=1)) -> dict:
    recent = TokenLog.objects.filter(status=TokenLog.Status.OK, created_at__gte=now - window)
    return {"p50": percentile(recent, "ttft_ms", 0.50), "p95": percentile(recent, "ttft_ms", 0.95)}


# --- time series -----------------------------------------------------------------------------------

RANGES = {
    # name: (how far back, bucket function, bucket width)
    "24h": (timedelta(hours=24), TruncMinute, timedelta(minutes=1)),
    "30d": (timedelta(days=30), TruncDay, timedelta(days=1)),
}


@dataclass(frozen=True)
class Series:
    """Per-feature traces over buckets: x = bucket starts (ISO), y per feature, aligned."""

    x: list[str]
    traces: dict[str, list[float]]


def _tagged(tag: str | None):
    """The ledger, or only the rows that carried `tag` (charts grouped by tag, as the token log filters)."""
    return TokenLog.objects.filter(**tag_filter(tag)) if tag else TokenLog.objects.all()


def feature_series(now: datetime, range_name: str, tag: str | None = None) -> dict[str, Series]:
    """tokens, cost (µ$), mean TTFT and total ms per feature and bucket, from one GROUP BY."""
    back, trunc, _ = RANGES[range_name]
    rows = (
        _tagged(tag).filter(SETTLED, created_at__gte=now - back)
        .annotate(bucket=trunc("created_at", tzinfo=local_zone()))
        .values("bucket", name=F("feature__name"))
        .annotate(tokens=Sum(TOKENS), cost=Sum("cost_micro_usd"), ttft=Sum("ttft_ms"), total=Sum("total_ms"),
                  timed=Count("ttft_ms"), requests=Count("id"))
        .order_by("bucket")
    )
    return _pivot(rows, {
        "tokens": (lambda r: r["tokens"] or 0, 0),
        "cost": (lambda r: r["cost"] or 0, 0),
        "ttft": (lambda r: round(r["ttft"] / r["timed"]) if r["timed"] else None, None),
        "total": (lambda r: round(r["total"] / r["timed"]) if r["timed"] else None, None),
    })


def refusal_series(now: datetime, range_name: str, tag: str | None = None) -> Series:
    back, trunc, _ = RANGES[range_name]
    rows = (
        _tagged(tag).filter(status=TokenLog.Status.REFUSED, created_at__gte=now - back)
        .annotate(bucket=trunc("created_at", tzinfo=local_zone()))
        .values("bucket", name=F("refusal_code"))
        .annotate(count=Count("id"))
        .order_by("bucket")
    )
    return _pivot(rows, {"count": (lambda r: r["count"], 0)})["count"]


def retrieval_latency_series(now: datetime, range_name: str, tag: str | None = None) -> Series:
    """Docs answers' mean time per bucket split as request_latency_parts splits one request:
    retrieval, prefill (admission to first token) and decode (the rest), in ms. Only answered
    requests that retrieved (retrieval_ms set) and were timed count."""
    back, trunc, _ = RANGES[range_name]
    rows = list(
        _tagged(tag).filter(SETTLED, created_at__gte=now - back, retrieval_ms__isnull=False,
                                ttft_ms__isnull=False, total_ms__isnull=False)
        .annotate(bucket=trunc("created_at", tzinfo=local_zone()))
        .values("bucket")
        .annotate(retrieval=Avg("retrieval_ms"), prefill=Avg("ttft_ms"), decode=Avg(F("total_ms") - F("ttft_ms")))
        .order_by("bucket")
    )
    return Series(
        [row["bucket"].isoformat() for row in rows],
        {part: [round(max(0.0, float(row[part])), 1) for row in rows] for part in ("retrieval", "prefill", "decode")},
    )


def _pivot(rows, metrics: dict) -> dict[str, Series]:
    """Grouped rows (bucket, name, values) → one aligned Series per metric; gaps get the metric's fill."""
    rows = list(rows)
    buckets = sorted({row["bucket"] for row in rows})
    position = {bucket: i for i, bucket in enumerate(buckets)}
    names = sorted({row["name"] or "(none)" for row in rows})
    x = [bucket.isoformat() for bucket in buckets]
    result = {}
    for metric, (value, fill) in metrics.items():
        traces = {name: [fill] * len(buckets) for name in names}
        for row in rows:
            traces[row["name"] or "(none)"][position[row["bucket"]]] = value(row)
        result[metric] = Series(x, traces)
    return result


@dataclass(frozen=True)
class LatencyPart:
    name: str
    ms: int
    share: float  # of the whole, 0..1


def request_latency_parts(row: TokenLog) -> list[LatencyPart]:
    """One request's time split as the cost model's latency budget splits it: retrieval, prefill, decode.

    Retrieval ran before admission (the ledger's clock starts there); prefill is admission to the
    first token (queueing included); decode is the rest. Parts the request did not have are left out.
    """
    parts: list[tuple[str, int]] = []
    if row.retrieval_ms is not None:
        parts.append(("retrieval", row.retrieval_ms))
    if row.ttft_ms is not None:
        parts.append(("prefill", row.ttft_ms))
        if row.total_ms is not None:
            parts.append(("decode", max(0, row.total_ms - row.ttft_ms)))
    shares = latency_shares({name: float(ms) for name, ms in parts})
    return [LatencyPart(name, ms, shares[name]) for name, ms in parts]
