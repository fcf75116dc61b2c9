"""Prometheus metrics for the whole stack, kept in Redis and rendered on scrape.

Web servers and workers are separate processes, several of each at scale, so a per-process
prometheus_client registry would show each scrape one process's share. Instead every settled or
refused request adds to counters in Redis (budgets.live's batch → record_settled_many: one script
of HINCRBY/HINCRBYFLOAT per batch), and GET /metrics renders those counters plus every worker's
live engine stats (inference.bus.read_engine_stats) through a custom Collector.

Layout in Redis: one hash per metric, KEY_PREFIX + name. A field is the JSON of [part, labels]:
part is "value" for a counter; for a histogram it is "sum", "count" or one bucket's upper bound
("+Inf" for the overflow). Bucket counts are stored per bucket, not cumulative, and added up at
scrape time, so changing the bounds later never corrupts what was stored.

Names follow vLLM's (`vllm:` → `ceiling:`) where they mean the same. Not exported:
request_queue_time_seconds — the ledger has no moment when the engine scheduled a request, only
admission (created_at), first token and end, so queueing is part of time to first token.
"""

from __future__ import annotations

import bisect
import hmac
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache, partial

import redis
from django.conf import settings
from django.db.models import Q, QuerySet, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from budgets import live as budget_live
from budgets.forecast import all_cost_caps, forecasts
from budgets.guard import SETTLED
from budgets.models import TokenLog
from budgets.periods import period_bounds
from budgets.tags import TAGGED

from .bus.stats import read_engine_stats

log = logging.getLogger(__name__)

KEY_PREFIX = "ceiling:metrics:"
NAME_PREFIX = "ceiling:"
# Recording sits on the path that settles a request (before its done frame is sent), so a slow
# Redis may cost it half a second at most; the counters are then missing one request, logged.
REDIS_TIMEOUT_S = 0.5
NO_FEATURE = "(none)"  # as on the staff dashboard

# vLLM's bounds (vllm/v1/metrics/loggers.py), with a few smaller ones: a GPU decodes a 135M model
# in a few milliseconds per token, and an answer served from a cache ends in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# finished_reason as vLLM spells it: a cancelled request is an "abort", a failed one an "error".
FINISHED_REASON = {TokenLog.Status.CANCELLED: "abort", TokenLog.Status.FAILED: "error"}
CACHE_KINDS = ("exact", "semantic")


@dataclass(frozen=True)
class Spec:
    """One metric kept in Redis: its name without the prefix (and without _total for counters)."""

    name: str
    kind: str  # "counter" or "histogram"
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.name


# model_name as vLLM labels its metrics (the ledger's model: "<model>@int8" for a variant, a remote's
# model name), beside Ceiling's own feature, so vLLM's dashboards work unchanged.
MODEL_LABELS = ("feature", "model_name")
TTFT = Spec("time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds (from admission).", MODEL_LABELS, TTFT_BUCKETS)
TPOT = Spec("time_per_output_token_seconds", "histogram", "Histogram of time per output token in seconds.", MODEL_LABELS, TPOT_BUCKETS)
E2E = Spec("e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds (admission to end).", MODEL_LABELS, E2E_BUCKETS)
PROMPT_TOKENS = Spec("prompt_tokens", "counter", "Number of prefill tokens processed.", MODEL_LABELS)
GENERATION_TOKENS = Spec("generation_tokens", "counter", "Number of generation tokens processed.", MODEL_LABELS)
REQUEST_SUCCESS = Spec("request_success", "counter", "Count of finished requests (stop, length, abort = cancelled, error = failed).", (*MODEL_LABELS, "finished_reason"))
REQUESTS_REFUSED = Spec("requests_refused", "counter", "Requests the budget guard or the front door refused, by refusal code and the scope of the limit.", ("code", "scope"))
PREFIX_CACHE_HITS = Spec("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached prompt tokens.")
CACHE_HITS = Spec("cache_hits", "counter", "Answers served from the response cache, by kind (exact, semantic).", ("kind",))
COST = Spec("cost_micro_usd", "counter", "Spend in micro-dollars, at the price in force at admission.", MODEL_LABELS)
RETRIEVAL = Spec("retrieval_seconds", "histogram", "Histogram of a docs feature's retrieval time in seconds (before admission).", ("feature",), TTFT_BUCKETS)
RETRIEVED_TOKENS = Spec("retrieved_tokens", "counter", "Prompt tokens that retrieval placed in docs features' prompts.", ("feature",))
RETRIEVAL_CACHE = Spec("retrieval_cache_lookups", "counter", "Retrieval cache lookups of docs features, by result (hit, miss).", ("result",))
OVERSHOOTS = Spec("overshoot_requests", "counter", "Requests a remote billed beyond their reservation (the estimate rises after each).", ("feature",))
OVERSHOOT_TOKENS = Spec("overshoot_tokens", "counter", "Tokens billed beyond reservations (always 0 on the local engine).", ("feature",))
OVERSHOOT_COST = Spec("overshoot_cost_micro_usd", "counter", "Micro-dollars billed beyond reservations.", ("feature",))
FAILOVERS = Spec("failover_requests", "counter", "Requests whose feature's provider failed before the first token and that moved to a backup provider (served or not).", ("feature",))
RETRIEVAL_SAVED = Spec("retrieval_cache_saved_seconds", "counter", "Seconds of retrieval the retrieval cache saved (each replayed search's time less its hit's).")

SPECS = (TTFT, TPOT, E2E, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, REQUESTS_REFUSED, PREFIX_CACHE_HITS, CACHE_HITS, COST,
         RETRIEVAL, RETRIEVED_TOKENS, RETRIEVAL_CACHE, RETRIEVAL_SAVED, OVERSHOOTS, OVERSHOOT_TOKENS, OVERSHOOT_COST,
         FAILOVERS)


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


def metrics_redis() -> redis.Redis:
    return _client(settings.REDIS_URL)


def _field(part: str, labels: dict[str, str]) -> str:
    return json.dumps([part, labels], sort_keys=True, separators=(",", ":"))


# --- recording: one script per batch of settled requests --------------------------------------------


@dataclass(frozen=True)
class Increment:
    spec: Spec
    part: str
    labels: dict[str, str]
    amount: int | float


def increments_for(row: TokenLog) -> list[Increment]:
    """What one settled or refused ledger row adds to the metrics (nothing for a running one)."""
    if row.status == TokenLog.Status.RUNNING:
        return []
    retrieval = _retrieval_increments(row, {"feature": row.feature.name if row.feature_id else NO_FEATURE})
    if row.status == TokenLog.Status.REFUSED:
        code = row.refusal_code or "unknown"
        return [Increment(REQUESTS_REFUSED, "value", {"code": code, "scope": refusal_scope(code)}, 1), *retrieval]
    feature = {"feature": row.feature.name if row.feature_id else NO_FEATURE, "model_name": row.model or NO_FEATURE}
    reason = FINISHED_REASON.get(row.status) or row.finish_reason or "stop"
    out = [
        Increment(REQUEST_SUCCESS, "value", feature | {"finished_reason": reason}, 1),
        Increment(PROMPT_TOKENS, "value", feature, row.prompt_tokens),
        Increment(GENERATION_TOKENS, "value", feature, row.completion_tokens),
        Increment(COST, "value", feature, row.cost_micro_usd),
    ]
    if row.overshoot_tokens or row.overshoot_micro_usd:
        out += [Increment(OVERSHOOTS, "value", feature, 1), Increment(OVERSHOOT_TOKENS, "value", feature, row.overshoot_tokens),
                Increment(OVERSHOOT_COST, "value", feature, row.overshoot_micro_usd)]
    if getattr(row, "failed_over", None):  # the ledger row names the providers that failed it
        out.append(Increment(FAILOVERS, "value", {"feature": feature["feature"]}, 1))
    if row.cached_tokens > 0:
        out.append(Increment(PREFIX_CACHE_HITS, "value", {}, row.cached_tokens))
    # The ledger has no cache column yet; once a response cache records its kind on the row, it counts here.
    cache = getattr(row, "cache", "")
    if cache in CACHE_KINDS:
        out.append(Increment(CACHE_HITS, "value", {"kind": cache}, 1))
    if row.ttft_ms is not None:
        out += _observe(TTFT, feature, row.ttft_ms / 1000)
    if row.total_ms is not None:
        out += _observe(E2E, feature, row.total_ms / 1000)
    if row.ttft_ms is not None and row.total_ms is not None and row.completion_tokens > 1:
        decode_s = max(0, row.total_ms - row.ttft_ms) / 1000
        out += _observe(TPOT, feature, decode_s / (row.completion_tokens - 1))
    return out + retrieval


# A refusal code's first word names whose limit said no (docs/protocol.md's codes); the rest are
# about the request itself (too long, a switched-off feature, a duplicate) or the service.
REFUSAL_SCOPES = ("user", "team", "key", "tag", "feature", "provider", "loop")


def refusal_scope(code: str) -> str:
    """user, team, key, tag, feature, provider, loop; "service" when ours failed; else "request"."""
    if code.endswith("_unavailable"):
        return "service"
    scope = code.split("_", 1)[0]
    if code == "feature_disabled" or scope not in REFUSAL_SCOPES:
        return "request"
    return scope


def _retrieval_increments(row: TokenLog, feature: dict[str, str]) -> list[Increment]:
    """A docs feature's retrieval: its time, its tokens, and whether the retrieval cache answered it."""
    out: list[Increment] = []
    if row.retrieval_ms is not None:
        out += _observe(RETRIEVAL, feature, row.retrieval_ms / 1000)
    if row.retrieved_tokens:
        out.append(Increment(RETRIEVED_TOKENS, "value", feature, row.retrieved_tokens))
    if row.retrieval_cache in ("hit", "miss"):
        out.append(Increment(RETRIEVAL_CACHE, "value", {"result": row.retrieval_cache}, 1))
    if row.retrieval_saved_ms:
        out.append(Increment(RETRIEVAL_SAVED, "value", {}, row.retrieval_saved_ms / 1000))
    return out


def _observe(spec: Spec, labels: dict[str, str], seconds: float) -> list[Increment]:
    index = bisect.bisect_left(spec.buckets, seconds)  # the first bound >= seconds (le is inclusive)
    bound = floatToGoString(spec.buckets[index]) if index < len(spec.buckets) else "+Inf"
    return [
        Increment(spec, bound, labels, 1),
        Increment(spec, "count", labels, 1),
        Increment(spec, "sum", labels, seconds),
    ]


ADD_LUA = """
for i = 1, #KEYS do
  local field, amount, kind = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  if kind == 'f' then
    redis.call('HINCRBYFLOAT', KEYS[i], field, amount)
  else
    redis.call('HINCRBY', KEYS[i], field, amount)
  end
end
return #KEYS
"""


@lru_cache(maxsize=4)
def _add_script(client: redis.Redis):
    return client.register_script(ADD_LUA)


def record_settled(row: TokenLog) -> None:
    """Add one settled or refused request to the shared counters (record_settled_many of one)."""
    record_settled_many([row])


def record_settled_many(rows: list[TokenLog]) -> None:
    """Add settled or refused requests to the shared counters, in one script call. Never raises: the
    ledger and the user's answer must not depend on metrics, so a failure is logged and the
    requests go uncounted."""
    try:
        totals = _summed(rows)
        if not totals:
            return
        # One script, so a scrape sees the whole batch or none of it; each (metric, field) once,
        # however many requests of the batch add to it.
        keys: list[str] = []
        args: list = []
        for (key, part, labels), amount in totals.items():
            keys.append(key)
            args += [_field(part, dict(labels)), amount, "f" if isinstance(amount, float) else "i"]
        _add_script(metrics_redis())(keys=keys, args=args)
    except redis.RedisError as exc:
        log.warning("metrics: could not record %d request(s) (%s…): %s", len(rows), _ids(rows), exc)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("metrics: could not record %d request(s) (%s…)", len(rows), _ids(rows))


def _summed(rows: list[TokenLog]) -> dict[tuple[str, str, tuple], int | float]:
    """(metric key, part, labels) → the rows' increments added up; a float stays a float."""
    totals: dict[tuple[str, str, tuple], int | float] = {}
    for row in rows:
        for inc in increments_for(row):
            slot = (inc.spec.key, inc.part, tuple(sorted(inc.labels.items())))
            totals[slot] = totals.get(slot, 0) + inc.amount
    return totals


def _ids(rows: list[TokenLog]) -> str:
    return ", ".join(getattr(row, "request_id", "?") for row in rows[:3])


def clear_metrics(client: redis.Redis | None = None) -> int:
    """Delete every stored metric (tests; an operator resetting counters). Returns the keys deleted."""
    client = client or metrics_redis()
    keys = list(client.scan_iter(match=KEY_PREFIX + "*", count=500))
    return client.delete(*keys) if keys else 0


# --- rendering on scrape --------------------------------------------------------------------------


class CeilingCollector:
    """Reads the Redis hashes and the workers' engine stats at every scrape."""

    def collect(self) -> Iterator[Metric]:
        client = metrics_redis()
        pipe = client.pipeline(transaction=False)
        for spec in SPECS:
            pipe.hgetall(spec.key)
        for spec, stored in zip(SPECS, pipe.execute(), strict=True):
            fields = [(*json.loads(raw_field), raw_value) for raw_field, raw_value in stored.items()]
            yield self._histogram(spec, fields) if spec.kind == "histogram" else self._counter(spec, fields)
        yield from self._engine_gauges(read_engine_stats())
        yield from self._exhaustion_gauge()
        yield from self._spend_gauges()

    @staticmethod
    def _exhaustion_gauge() -> list[GaugeMetricFamily]:
        """Seconds until each cost cap runs out at the current rate, from the ledger at scrape time
        (a few GROUP BY day queries): 0 when spent, +Inf when it lasts until its period resets."""
        # Not vLLM's, so not its "ceiling:" spelling: colons are meant for recording rules, and the
        # issue that asked for it (and alert rules written against it) say ceiling_budget_exhaustion_seconds.
        labels = ["scope_kind", "scope", "period"]
        family = GaugeMetricFamily(
            "ceiling_budget_exhaustion_seconds",
            "Projected seconds until a cost cap is spent at the current rate (trailing 7 days, by weekday with 3 weeks of history); +Inf: lasts the period.",
            labels=labels,
        )
        remaining = GaugeMetricFamily("ceiling_budget_remaining_usd", "What is left of each cost cap this period, in dollars (0 when spent).", labels=labels)
        limit = GaugeMetricFamily("ceiling_budget_limit_usd", "Each cost cap, in dollars per period.", labels=labels)
        try:
            now = timezone.now()
            projections = forecasts(all_cost_caps(now), now)
        except Exception:  # noqa: BLE001 - the request metrics must still be scraped when this fails
            log.exception("metrics: budget forecasts failed")
            return [family, remaining, limit]
        for projection in sorted(projections, key=lambda f: (f.cap.scope, f.cap.period)):
            cap = projection.cap
            key = [cap.scope_kind, cap.scope, cap.period]
            family.add_metric(key, projection.seconds_left)
            remaining.add_metric(key, max(0, cap.cap_micro_usd - projection.spent_micro_usd) / 1_000_000)
            limit.add_metric(key, cap.cap_micro_usd / 1_000_000)
        return [family, remaining, limit]

    @staticmethod
    def _spend_gauges() -> list[GaugeMetricFamily]:
        """Spend this day and month per user, team, API key and tag: the top N of each, plus "other"."""
        family = GaugeMetricFamily(
            "ceiling_spend_usd",
            f"Settled spend this period in dollars, by user, team, API key and tag: the top {settings.CEILING_METRICS_TOP_N} "
            "of each by spend, the rest summed as scope=\"other\".",
            labels=["scope_kind", "scope", "period"],
        )
        try:
            series = spend_series(timezone.now(), settings.CEILING_METRICS_TOP_N)
        except Exception:  # noqa: BLE001 - as above
            log.exception("metrics: spend by scope failed")
            return [family]
        for (kind, scope, period), micro_usd in series:
            family.add_metric([kind, scope, period], micro_usd / 1_000_000)
        return [family]

    @staticmethod
    def _counter(spec: Spec, fields: list) -> CounterMetricFamily:
        family = CounterMetricFamily(NAME_PREFIX + spec.name, spec.documentation, labels=spec.labels)
        for _part, labels, raw in sorted(fields, key=lambda f: sorted(f[1].items())):
            family.add_metric([labels.get(name, "") for name in spec.labels], float(raw))
        return family

    @staticmethod
    def _histogram(spec: Spec, fields: list) -> HistogramMetricFamily:
        family = HistogramMetricFamily(NAME_PREFIX + spec.name, spec.documentation, labels=spec.labels)
        series: dict[tuple[str, ...], dict[str, float]] = {}
        for part, labels, raw in fields:
            values = series.setdefault(tuple(labels.get(name, "") for name in spec.labels), {})
            values[part] = values.get(part, 0.0) + float(raw)
        for label_values in sorted(series):
            values = series[label_values]
            count, total = values.pop("count", 0.0), values.pop("sum", 0.0)
            stored = [(float(bound), n) for bound, n in values.items()]
            buckets = [(floatToGoString(b), sum(n for le, n in stored if le <= b)) for b in spec.buckets]
            buckets.append(("+Inf", count))
            family.add_metric(list(label_values), buckets, total)
        return family

    @staticmethod
    def _engine_gauges(workers: list[dict]) -> Iterator[GaugeMetricFamily]:
        """One sample per worker and weight variant (a worker hosts one; CEILING_WORKER_VARIANTS may name more)."""
        labels = ["worker", "variant"]
        running = GaugeMetricFamily(NAME_PREFIX + "num_requests_running", "Number of requests in the engine's running batch.", labels=labels)
        waiting = GaugeMetricFamily(NAME_PREFIX + "num_requests_waiting", "Number of requests waiting to be processed.", labels=labels)
        kv = GaugeMetricFamily(NAME_PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        peak = GaugeMetricFamily(NAME_PREFIX + "peak_generation_tokens_per_second",
                                 "The engine's best 10-second decode rate since it started (what prices its tokens).", labels=labels)
        for stats in workers:
            for engine in [stats, *stats.get("variants", [])]:
                key = [stats["worker"], engine.get("quantization") or "none"]
                running.add_metric(key, engine.get("running", 0))
                waiting.add_metric(key, engine.get("waiting", 0))
                total = engine.get("kv_blocks_total") or 0
                kv.add_metric(key, engine.get("kv_blocks_used", 0) / total if total else 0.0)
                peak.add_metric(key, engine.get("peak_tokens_per_s") or 0.0)
        yield from (running, waiting, kv, peak)


# --- spend by scope, bounded ---------------------------------------------------------------------

OTHER = "other"
SPEND_SCOPES = (("user", "user_id"), ("team", "team_id"), ("key", "api_key_id"))
PERIODS = ("day", "month")

# scope → (spent today, spent this month), in micro-dollars
Spent = dict[object, tuple[int, int]]


def spend_series(now, top_n: int) -> list[tuple[tuple[str, str, str], int]]:
    """((scope_kind, scope, period), micro-dollars) for this day and month, per user, team, API key and tag.

    Each kind and period names its top_n scopes by spend and sums the rest as "other" (absent when
    nothing is left over), so the series stay bounded however many users or tags there are. One
    grouped ledger query per kind.
    """
    day_start, _ = period_bounds("day", now)
    month_start, _ = period_bounds("month", now)
    month = TokenLog.objects.filter(SETTLED, created_at__gte=month_start, created_at__lt=now)
    out: list[tuple[tuple[str, str, str], int]] = []
    for kind, column in SPEND_SCOPES:
        out += top_and_other(kind, column_spend(month, column, day_start), top_n, partial(scope_names, kind))
    out += top_and_other("tag", tag_spend(month, day_start), top_n, lambda tags: {tag: tag for tag in tags})
    return out


def column_spend(month: QuerySet, column: str, day_start) -> Spent:
    """Each scope named by `column` (user_id, team_id, api_key_id) → its spend today and this month."""
    rows = (
        month.filter(**{f"{column}__isnull": False}).values(column)
        .annotate(month=Sum("cost_micro_usd"), day=Sum("cost_micro_usd", filter=Q(created_at__gte=day_start)))
        .order_by()
    )
    return {row[column]: (row["day"] or 0, row["month"] or 0) for row in rows}


def tag_spend(month: QuerySet, day_start) -> Spent:
    """Each tag → its spend today and this month; a row with two tags counts for both, as the guard counts it.

    Grouped by the rows' stored tag lists (",a,b,"), of which there are far fewer than rows, and split
    here: SQLite has no unnest, and the list is what the trigram index covers (budgets/tags.py).
    """
    rows = (
        month.filter(**TAGGED).values("tags")
        .annotate(month=Sum("cost_micro_usd"), day=Sum("cost_micro_usd", filter=Q(created_at__gte=day_start)))
        .order_by()
    )
    spent: dict[str, tuple[int, int]] = {}
    for row in rows:
        for tag in filter(None, row["tags"].split(",")):
            day, month_to_date = spent.get(tag, (0, 0))
            spent[tag] = (day + (row["day"] or 0), month_to_date + (row["month"] or 0))
    return spent


def top_and_other(kind: str, spent: Spent, top_n: int, names_of: Callable[[list], dict]) -> list[tuple[tuple[str, str, str], int]]:
    """The top_n scopes of each period by spend, by name, and the rest summed as "other"; scopes that spent nothing are left out."""
    out: list[tuple[tuple[str, str, str], int]] = []
    for index, period in enumerate(PERIODS):
        ranked = sorted(((amounts[index], scope) for scope, amounts in spent.items() if amounts[index] > 0),
                        key=lambda pair: (-pair[0], pair[1]))
        top, rest = ranked[:top_n], ranked[top_n:]
        names = names_of([scope for _, scope in top])
        out += [((kind, names.get(scope, str(scope)), period), amount) for amount, scope in top]
        if rest:
            out.append(((kind, OTHER, period), sum(amount for amount, _ in rest)))
    return out


def scope_names(kind: str, ids: list[int]) -> dict[int, str]:
    """A label for each scope: the username, the team's name, "<username>/<key name>" for a key."""
    from django.contrib.auth import get_user_model

    from accounts.models import ApiKey
    from budgets.models import Team

    if kind == "user":
        return dict(get_user_model().objects.filter(pk__in=ids).values_list("pk", "username"))
    if kind == "team":
        return dict(Team.objects.filter(pk__in=ids).values_list("pk", "name"))
    keys = ApiKey.objects.filter(pk__in=ids).values_list("pk", "user__username", "name")
    return {pk: f"{username}/{name}" for pk, username, name in keys}


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(CeilingCollector())


# --- the endpoint ---------------------------------------------------------------------------------


def _bearer_matches(header: str, token: str) -> bool:
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics for Prometheus. 404 while CEILING_METRICS_TOKEN is empty, so nothing leaks by default."""
    token = settings.CEILING_METRICS_TOKEN
    if not token:
        raise Http404("metrics are disabled")
    if not _bearer_matches(request.headers.get("Authorization", ""), token):
        response = HttpResponse("A valid bearer token is required.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    budget_live.flush()  # this process's rows not yet announced count in this scrape
    try:
        body = generate_latest(REGISTRY)
    except redis.RedisError as exc:
        log.warning("metrics: scrape failed, Redis unreachable: %s", exc)
        return HttpResponse("Redis is unreachable; no metrics.\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
