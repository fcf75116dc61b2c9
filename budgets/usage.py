"""Read-only usage calculations over the ledger: usage against caps for the staff pages, the
cost-per-user long tail and a user's own caps.

Every number here comes from SQL aggregates. The long tail pulls one row per *user* (the GROUP BY
result), never one per TokenLog row, and does the percentiles in Python on those totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db.models import Count, F, Q, QuerySet, Sum

from accounts.models import ApiKey

from .actions import QUOTA_FIELDS
from .counters import Usage
from .guard import IN_FLIGHT, SETTLED, Ceiling, Scopes, applicable_ceilings, ledger_sums, request_scopes
from .models import Feature, Period, Provider, Quota, Team, TokenLog
from .money import format_usd
from .periods import describe_reset, period_bounds
from .tags import tags_text

TOP_USERS = 50
BINS_PER_DECADE = 4  # log-spaced histogram: 1, 1.8, 3.2, 5.6, 10, ... micro-dollars
CURVE_POINTS = 200  # the concentration curve is downsampled to at most this many points
NO_USAGE = {period: Usage() for period in Period.values}  # a group with no settled rows this month


# --- usage against caps: the staff pages' gauges --------------------------------------------------


def caps_of(quota: Quota | None) -> dict[str, int | None]:
    """A Quota row's caps by field name; no row: no caps."""
    return {name: getattr(quota, name) if quota else None for name in QUOTA_FIELDS}


@dataclass(frozen=True)
class Gauge:
    """What was used so far against a cap, as one table cell shows it."""

    used: int
    cap: int | None
    money: bool = False
    uncapped: str = "no cap"
    forecast: str = ""  # a cost cap's projection, "runs out 18 Dec 14:00 (13 days early)" (budgets.forecast)

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
    """This minute's, hour's, day's and month's settled usage per `group_by` value: one aggregate query.

    Running and refused rows are not "used" (the guard counts them the same way); the minute, hour
    and day lie inside this month, so one month-wide scan with conditional filters gives them all.
    """
    month_start, month_end = period_bounds(Period.MONTH, now)
    tokens = F("prompt_tokens") + F("completion_tokens")
    sums = {}
    for period in INNER_PERIODS:
        start, end = period_bounds(period, now)
        inside = Q(created_at__gte=start, created_at__lt=end)
        sums |= {f"{period}_requests": Count("id", filter=inside), f"{period}_tokens": Sum(tokens, filter=inside),
                 f"{period}_cost": Sum("cost_micro_usd", filter=inside)}
    sums |= {"month_requests": Count("id"), "month_tokens": Sum(tokens), "month_cost": Sum("cost_micro_usd")}
    rows = (
        logs.filter(SETTLED, created_at__gte=month_start, created_at__lt=month_end)
        .order_by()
        .values(group_by)
        .annotate(**sums)
    )
    return {
        row[group_by]: {
            period: Usage(row[f"{period}_requests"], row[f"{period}_tokens"] or 0, row[f"{period}_cost"] or 0)
            for period in Period.values
        }
        for row in rows
    }


# The periods inside the month that usage_by sums with a filter of their own.
INNER_PERIODS = (Period.MINUTE, Period.HOUR, Period.DAY)


def total_usage(usages: list[dict[str, Usage]]) -> dict[str, Usage]:
    """Sum of a few already-aggregated groups (one per feature), not of log rows."""
    return {
        period: Usage(
            sum(u[period].requests for u in usages),
            sum(u[period].tokens for u in usages),
            sum(u[period].cost_micro_usd for u in usages),
        )
        for period in Period.values
    }


def effective_caps(quotas: dict[tuple[bool, str], Quota], period: str) -> tuple[dict[str, int | None], bool]:
    """The caps in force for one period (a user's own row replaces the default) and whether they are own.

    `quotas` is keyed by (is the user's own row, period), all-features rows only.
    """
    own = quotas.get((True, period))
    return caps_of(own or quotas.get((False, period))), own is not None


def tag_month_spend(tags: list[str], now: datetime) -> dict[str, int]:
    """This month's settled spend (micro-dollars) of the requests carrying each tag: one aggregate,
    a conditional sum per tag. Cache hits cost nothing and are left out, as the guard counts them."""
    if not tags:
        return {}
    start, end = period_bounds(Period.MONTH, now)
    sums = TokenLog.objects.filter(SETTLED, cache="", created_at__gte=start, created_at__lt=end).aggregate(**{
        f"t{i}": Sum("cost_micro_usd", filter=Q(tags__contains=tags_text([tag]))) for i, tag in enumerate(tags)
    })
    return {tag: sums[f"t{i}"] or 0 for i, tag in enumerate(tags)}


# --- cost per user: the long tail ---------------------------------------------------------------


@dataclass(frozen=True)
class UserCost:
    user_id: int
    username: str
    requests: int
    tokens: int
    cost_micro_usd: int
    share: float  # of all spend in the period, 0..1

    @property
    def cost_shown(self) -> str:
        return format_usd(self.cost_micro_usd)

    @property
    def share_shown(self) -> str:
        return f"{100 * self.share:.1f}%"


@dataclass(frozen=True)
class HistogramBin:
    """Users whose cost in the period is in [low, high) micro-dollars (the zero bin is [0, 0])."""

    low_micro_usd: int
    high_micro_usd: int
    users: int

    @property
    def label(self) -> str:
        if self.high_micro_usd == 0:
            return "$0"
        return f"{short_usd(self.low_micro_usd)}–{short_usd(self.high_micro_usd)}"


def short_usd(micro_usd: int) -> str:
    """Two significant digits, for axis labels: $0.00018, $0.0032, $1.8, $18, $1,800."""
    dollars = micro_usd / 1_000_000
    if dollars >= 100:
        return f"${dollars:,.0f}"
    decimals = max(0, 1 - math.floor(math.log10(dollars))) if dollars > 0 else 0
    text = f"{dollars:.{decimals}f}"
    return "$" + (text.rstrip("0").rstrip(".") if "." in text else text)


@dataclass(frozen=True)
class CostTail:
    start: datetime
    end: datetime
    users: int  # users with at least one request in the period
    requests: int
    total_micro_usd: int
    p50_micro_usd: int
    p90_micro_usd: int
    p99_micro_usd: int
    top_percent_users: int  # how many users make up "the top 1%" (at least one)
    top_percent_share: float  # their share of all spend, 0..1
    histogram: list[HistogramBin]
    # (share of users, share of spend) from the biggest spender down: the Lorenz-style tail curve.
    concentration: list[tuple[float, float]]
    top_users: list[UserCost]

    # Shown amounts, so templates need no filters of their own.
    @property
    def total_shown(self) -> str:
        return format_usd(self.total_micro_usd)

    @property
    def p50_shown(self) -> str:
        return format_usd(self.p50_micro_usd)

    @property
    def p90_shown(self) -> str:
        return format_usd(self.p90_micro_usd)

    @property
    def p99_shown(self) -> str:
        return format_usd(self.p99_micro_usd)

    @property
    def top_percent_share_shown(self) -> str:
        return f"{100 * self.top_percent_share:.1f}%"


def cost_per_user(start: datetime, end: datetime, top: int = TOP_USERS) -> CostTail:
    """The distribution of spend over users in [start, end): one GROUP BY user query, then the top names."""
    # Grouped by user_id alone (a hash aggregate); joining auth_user into the GROUP BY made
    # PostgreSQL sort every row by user first, twice as slow over a million rows.
    rows = list(
        TokenLog.objects.filter(created_at__gte=start, created_at__lt=end, user__isnull=False)
        .values("user")
        .annotate(
            requests=Count("id"),
            tokens=Sum(F("prompt_tokens") + F("completion_tokens")),
            cost=Sum("cost_micro_usd"),
        )
        .order_by("-cost", "-requests", "user")
    )
    top_ids = [row["user"] for row in rows[:top]]
    names = dict(get_user_model().objects.filter(pk__in=top_ids).values_list("id", "username"))
    costs = sorted(row["cost"] or 0 for row in rows)  # ascending, for percentiles
    total = sum(costs)
    top_n = max(1, math.ceil(len(costs) / 100)) if costs else 0
    top_sum = sum(costs[-top_n:]) if top_n else 0
    return CostTail(
        start=start,
        end=end,
        users=len(costs),
        requests=sum(row["requests"] for row in rows),
        total_micro_usd=total,
        p50_micro_usd=percentile(costs, 50),
        p90_micro_usd=percentile(costs, 90),
        p99_micro_usd=percentile(costs, 99),
        top_percent_users=top_n,
        top_percent_share=top_sum / total if total else 0.0,
        histogram=log_histogram(costs),
        concentration=concentration_curve(costs),
        top_users=[
            UserCost(
                row["user"], names.get(row["user"], ""), row["requests"], row["tokens"] or 0, row["cost"] or 0,
                (row["cost"] or 0) / total if total else 0.0,
            )
            for row in rows[:top]
        ],
    )


def percentile(sorted_values: list[int], p: float) -> int:
    """Nearest rank: the smallest value that at least p% of the values are at or below.

    Chosen over interpolation because it is always a real user's cost, and reads plainly:
    "half of the users spent at most p50".
    """
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def log_histogram(sorted_values: list[int]) -> list[HistogramBin]:
    """Users per log-spaced cost bin; users who spent nothing get a bin of their own.

    A linear histogram of a long tail is one tall bar and a flat line; log bins show its shape.
    """
    zero = sum(1 for v in sorted_values if v <= 0)
    positive = sorted_values[zero:]
    bins = [HistogramBin(0, 0, zero)] if zero else []
    if not positive:
        return bins
    first = math.floor(math.log10(positive[0]) * BINS_PER_DECADE)
    last = math.floor(math.log10(positive[-1]) * BINS_PER_DECADE)
    edges = [_edge(k) for k in range(first, last + 2)]
    counts = [0] * (len(edges) - 1)
    index = 0
    for value in positive:  # ascending, so one pass moves the bin index forward only
        while index < len(counts) - 1 and value >= edges[index + 1]:
            index += 1
        counts[index] += 1
    bins.extend(HistogramBin(edges[i], edges[i + 1], n) for i, n in enumerate(counts))
    return bins


def _edge(k: int) -> int:
    return max(1, round(10 ** (k / BINS_PER_DECADE)))


def concentration_curve(sorted_values: list[int], points: int = CURVE_POINTS) -> list[tuple[float, float]]:
    """From the biggest spender down: after the top x of users, y of all spend is accounted for."""
    total = sum(sorted_values)
    n = len(sorted_values)
    if not n or not total:
        return []
    step = max(1, n // points)
    curve = [(0.0, 0.0)]
    running = 0
    for i, value in enumerate(reversed(sorted_values), start=1):
        running += value
        if i % step == 0 or i == n:
            curve.append((i / n, running / total))
    return curve


# --- my usage: what is left of each cap that applies to one user --------------------------------


@dataclass(frozen=True)
class Allowance:
    """One metric of one cap: used (settled + still held by answers in progress) against the limit."""

    metric: str  # requests | tokens | cost
    limit: int
    used: int
    in_progress: int

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used - self.in_progress)

    @property
    def percent_used(self) -> int:
        return min(100, round(100 * (self.used + self.in_progress) / self.limit)) if self.limit else 100

    def show(self, amount: int) -> str:
        return format_usd(amount) if self.metric == "cost" else f"{amount:,}"

    @property
    def shown_limit(self) -> str:
        return self.show(self.limit)

    @property
    def shown_used(self) -> str:
        return self.show(self.used + self.in_progress)

    @property
    def shown_left(self) -> str:
        return self.show(self.left)


@dataclass(frozen=True)
class CapUsage:
    period: str  # day | month
    title: str
    resets: str  # "at 00:00 UTC, in 3 h 12 min"
    allowances: list[Allowance]


@dataclass(frozen=True)
class Totals:
    """Settled requests (refused and running ones are not counted), and refusals on their own."""

    requests: int
    tokens: int
    cost_micro_usd: int
    refused: int

    @property
    def cost_shown(self) -> str:
        return format_usd(self.cost_micro_usd)


@dataclass(frozen=True)
class MyUsage:
    today: Totals
    month: Totals
    caps: list[CapUsage]
    team: Team | None = None
    # The team's caps, used by every member together; and each of the user's API keys' own caps.
    team_caps: list[CapUsage] = field(default_factory=list)
    key_caps: list[CapUsage] = field(default_factory=list)

    @property
    def periods(self) -> list[tuple[str, Totals]]:
        return [("Today", self.today), ("This month", self.month)]


OWN_SCOPES = ("user", "feature")
TEAM_SCOPES = ("team", "team_feature")


def my_usage(user, now: datetime) -> MyUsage:
    """The caps the guard would apply to this user (per enabled feature), and what is left of each:
    the user's own, the team's (shared with its members) and each active API key's.

    Uses the guard's own applicable_ceilings() so this page can never disagree with a refusal; the
    user's amounts come from one aggregate query over the user's rows this month, the team's and
    keys' from one more over the team's and the keys' rows (only when there are such caps).
    """
    scopes = request_scopes(user)
    team_scopes = Scopes(scopes.team, scopes.team_quotas)
    own: dict[str, Ceiling] = {}
    team: dict[str, Ceiling] = {}
    served = _features_and_providers()
    for feature, provider in served:
        for ceiling in applicable_ceilings(user, feature, provider, now, None, team_scopes):
            # The provider's monthly limit is everyone's, not this user's allowance.
            if ceiling.scope in OWN_SCOPES:
                own.setdefault(ceiling.spec.key, ceiling)
            elif ceiling.scope in TEAM_SCOPES:
                team.setdefault(ceiling.spec.key, ceiling)
    keys = _key_ceilings_of(user, served[0] if served else None, now)
    sums = _ledger_sums(Q(user=user), list(own.values()), now)
    shared = list(team.values()) + [ceiling for _, ceiling in keys]
    shared_sums = _ledger_sums(_rows_of(scopes.team, {key for key, _ in keys}), shared, now) if shared else {}
    names = {ceiling.spec.key: f"API key {key.name!r}" for key, ceiling in keys}
    return MyUsage(
        today=Totals(sums["day_r"], sums["day_t"] or 0, sums["day_c"] or 0, sums["day_refused"]),
        month=Totals(sums["month_r"], sums["month_t"] or 0, sums["month_c"] or 0, sums["month_refused"]),
        caps=_sorted(_cap_usage(i, c, sums, now, _own_where(c)) for i, c in enumerate(own.values())),
        team=scopes.team,
        team_caps=_sorted(_cap_usage(i, c, shared_sums, now, _team_where(c)) for i, c in enumerate(shared)
                          if c.scope in TEAM_SCOPES),
        key_caps=_sorted(_cap_usage(i, c, shared_sums, now, names[c.spec.key]) for i, c in enumerate(shared)
                         if c.scope == "key"),
    )


def _features_and_providers() -> list[tuple[Feature, Provider]]:
    """Every enabled feature with the provider that serves it (the default one when it names none)."""
    default_provider = None
    served = []
    for feature in Feature.objects.filter(enabled=True).select_related("provider").order_by("name"):
        provider = feature.provider
        if provider is None:
            default_provider = default_provider or Provider.default()
            provider = default_provider
        served.append((feature, provider))
    return served


def _key_ceilings_of(user, served: tuple[Feature, Provider] | None, now: datetime) -> list[tuple]:
    """(key, ceiling) for each cap of each of the user's active API keys (a key's caps are the same
    whatever the feature, so any feature asks the guard)."""
    if served is None:
        return []
    found = []
    for key in ApiKey.objects.active().filter(user=user).order_by("name", "pk"):
        for ceiling in applicable_ceilings(user, *served, now, None, Scopes(api_key=key)):
            if ceiling.scope == "key":
                found.append((key, ceiling))
    return found


def _rows_of(team: Team | None, keys: set) -> Q:
    """The ledger rows the team's and the keys' caps count (whoever in the team sent them)."""
    rows = Q(pk__in=[])
    if team is not None:
        rows |= Q(team=team)
    if keys:
        rows |= Q(api_key__in=[key.pk for key in keys])
    return rows


def _own_where(ceiling: Ceiling) -> str:
    return "all features" if ceiling.scope == "user" else f"feature {ceiling.subject.removeprefix('your ')}"


def _team_where(ceiling: Ceiling) -> str:
    team = ceiling.subject.removeprefix("your ")
    return f"{team}, all features" if ceiling.scope == "team" else f"{team}, feature {ceiling.feature_name!r}"


def _sorted(caps) -> list[CapUsage]:
    return sorted(caps, key=lambda cap: (cap.period != Period.DAY, cap.title))


def _ledger_sums(rows: Q, ceilings: list, now: datetime) -> dict:
    """One query over `rows` this month: today's and this month's totals, and used/in-progress per
    ceiling (as guard.ledger_sums counts them)."""
    month_start, month_end = period_bounds(Period.MONTH, now)
    day_start, day_end = period_bounds(Period.DAY, now)
    tokens = F("prompt_tokens") + F("completion_tokens")
    today = Q(created_at__gte=day_start, created_at__lt=day_end)
    refused = Q(status=TokenLog.Status.REFUSED)
    aggregates = {
        "day_r": Count("id", filter=today & SETTLED),
        "day_t": Sum(tokens, filter=today & SETTLED),
        "day_c": Sum("cost_micro_usd", filter=today & SETTLED),
        "day_refused": Count("id", filter=today & refused),
        "month_r": Count("id", filter=SETTLED),
        "month_t": Sum(tokens, filter=SETTLED),
        "month_c": Sum("cost_micro_usd", filter=SETTLED),
        "month_refused": Count("id", filter=refused),
    }
    for i, ceiling in enumerate(ceilings):
        scope = Q(**ceiling.ledger_filter)
        aggregates |= {
            f"c{i}_ur": Count("id", filter=scope & SETTLED),
            f"c{i}_ut": Sum(tokens, filter=scope & SETTLED),
            f"c{i}_uc": Sum("cost_micro_usd", filter=scope & SETTLED),
            f"c{i}_rr": Count("id", filter=scope & IN_FLIGHT),
            f"c{i}_rt": Sum("reserved_tokens", filter=scope & IN_FLIGHT),
            f"c{i}_rc": Sum("reserved_cost_micro_usd", filter=scope & IN_FLIGHT),
        }
    return TokenLog.objects.filter(rows, created_at__gte=month_start, created_at__lt=month_end).aggregate(
        **aggregates
    )


def _cap_usage(i: int, ceiling, sums: dict, now: datetime, where: str) -> CapUsage:
    limits = ceiling.spec.limits
    allowances = []
    for metric, limit, suffix in (
        ("requests", limits.requests, "r"),
        ("tokens", limits.tokens, "t"),
        ("cost", limits.cost_micro_usd, "c"),
    ):
        if limit is not None:
            allowances.append(Allowance(metric, limit, sums[f"c{i}_u{suffix}"] or 0, sums[f"c{i}_r{suffix}"] or 0))
    when = "Today" if ceiling.period == Period.DAY else "This month"
    return CapUsage(ceiling.period, f"{when} · {where}", describe_reset(ceiling.period, now), allowances)


# --- today's allowance: the chat page's line ------------------------------------------------------


def today_allowance(user, now: datetime) -> dict | None:
    """What is left today of the user's all-features daily cap, as the chat page shows it; None without one.

    The cap is chosen as the guard chooses it (the user's own row replaces the default), and the
    amounts are the guard's: settled usage plus what answers in progress still hold.
        {"requests": {"limit": 20, "left": 17}, "tokens": {...}, "cost_usd": {"limit": "1.00", "left": "0.98"},
         "resets": "at 00:00 UTC, in 3 h 12 min"}   (only the metrics the cap limits)
    """
    quotas = {q.user_id is not None: q for q in Quota.objects.filter(
        Q(user=user) | Q(user__isnull=True), feature__isnull=True, period=Period.DAY)}
    quota = quotas.get(True) or quotas.get(False)
    if quota is None or all(value is None for value in caps_of(quota).values()):
        return None
    start, end = period_bounds(Period.DAY, now)
    used, reserved = ledger_sums({"user_id": user.pk, "created_at__gte": start, "created_at__lt": end})
    allowance: dict = {"resets": describe_reset(Period.DAY, now)}
    for metric, limit, spent in (
        ("requests", quota.max_requests, used.requests + reserved.requests),
        ("tokens", quota.max_tokens, used.tokens + reserved.tokens),
        ("cost_usd", quota.max_cost_micro_usd, used.cost_micro_usd + reserved.cost_micro_usd),
    ):
        if limit is None:
            continue
        left = max(0, limit - spent)
        if metric == "cost_usd":
            allowance[metric] = {"limit": f"{limit / 1_000_000:.6f}", "left": f"{left / 1_000_000:.6f}"}
        else:
            allowance[metric] = {"limit": limit, "left": left}
    return allowance
