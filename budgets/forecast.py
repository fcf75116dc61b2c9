"""When each cost cap runs out at the current rate, and which days' spend is a spike.

Read-only, from the ledger: every cap's daily spend comes from one GROUP BY (scope, local day)
query per kind of scope, never row by row (tags, kept as text on each row, from one GROUP BY local
day with a conditional sum per capped tag).

The rate. Over the trailing window (today so far and the 6 full days before it, fewer when the
scope is younger), spend is assumed uniform inside each day: base × factor(weekday) per day. With
fewer than 3 weeks of history every factor is 1 and base is plainly spend / days. With 3 weeks
or more, factor(weekday) is that weekday's mean over the last full weeks (up to 8) divided by the
mean of all their days, so a Saturday with no traffic is forecast as one, and base is estimated
from the window with the same factors (spend / Σ factor × share of the day in the window).
Walking forward day by day from now, the cap runs out where the cumulated forecast spend reaches
what is left; past the period's end it does not run out (the counter resets first).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

from django.contrib.auth import get_user_model
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDate

from .guard import SETTLED
from .models import CALENDAR_PERIODS, Period, Provider, Quota, TagQuota, TeamQuota, TokenLog
from .money import format_usd
from .periods import local_zone, period_bounds
from .tags import TAGGED, tags_text

TRAILING_FULL_DAYS = 6  # plus today so far: a 7-day window
WEEKDAY_AWARE_AFTER_DAYS = 21
MAX_WEEKS = 8
LOOKBACK_DAYS = 7 * MAX_WEEKS  # covers the weekday weeks and any month so far
SPIKE_FACTOR = 3
SPIKE_MEDIAN_DAYS = 7
TAG_GROUP = ("tag",)  # not a column: a tag's rows are those whose tags text holds ",name,"
# A projection barely before the reset is noise, not news: alert only when it is at least this early.
MIN_EARLY = {Period.DAY: timedelta(hours=1), Period.MONTH: timedelta(days=1)}


@dataclass(frozen=True)
class CostCap:
    """One cost cap on one scope: a provider's monthly limit, a user's or a team's (or their per-feature) cap."""

    scope: str  # as Alert.scope spells it: "provider:local", "user:alice", "user:alice/feature:chat"
    period: str  # day | month
    cap_micro_usd: int
    # The ledger's key for this scope: ("provider_id", 3), ("user_id", 7) or (("user_id", "feature_id"), (7, 2)).
    group: tuple[str, ...] = field(compare=False)
    key: tuple = field(compare=False)

    @property
    def scope_kind(self) -> str:
        return self.scope.split(":", 1)[0]


@dataclass(frozen=True)
class History:
    """One scope's settled spend per local day over the lookback, and its first day of activity."""

    daily: dict[date, int]
    first_day: date | None

    def spend(self, day: date) -> int:
        return self.daily.get(day, 0)


@dataclass(frozen=True)
class Forecast:
    cap: CostCap
    now: datetime
    spent_micro_usd: int  # so far this period
    daily_rate_micro_usd: float  # base rate per average day
    weekday_aware: bool
    exhausted_at: datetime | None  # None: not before the period ends
    period_end: datetime

    @property
    def exhausted(self) -> bool:
        return self.spent_micro_usd >= self.cap.cap_micro_usd

    @property
    def seconds_left(self) -> float:
        """For /metrics: 0 when spent, +Inf when it lasts the period, else seconds from now."""
        if self.exhausted:
            return 0.0
        if self.exhausted_at is None:
            return math.inf
        return max(0.0, (self.exhausted_at - self.now).total_seconds())

    @property
    def early(self) -> timedelta | None:
        return self.period_end - self.exhausted_at if self.exhausted_at else None

    @property
    def worth_an_alert(self) -> bool:
        early = self.early
        return not self.exhausted and early is not None and early >= MIN_EARLY[self.cap.period]

    @property
    def text(self) -> str:
        """Beside the cap on the staff pages: 'runs out 18 Dec 14:00 (13 days early)'."""
        if self.exhausted:
            return "spent"
        if self.exhausted_at is None:
            return "lasts the period" if self.daily_rate_micro_usd else "no recent spend"
        when = self.exhausted_at.astimezone(local_zone())
        shown = f"{when:%H:%M}" if self.cap.period == Period.DAY else f"{when.day} {when:%b %H:%M}"
        early = self.early
        ahead = f"{early.days} days early" if early.days >= 2 else f"{int(early.total_seconds() // 3600)} h early"
        return f"runs out {shown} ({ahead})"

    @property
    def rate_text(self) -> str:
        return f"{format_usd(round(self.daily_rate_micro_usd))}/day" + (" by weekday" if self.weekday_aware else "")


# --- the arithmetic: pure functions of a history ------------------------------------------------------


def weekday_factors(history: History, today: date) -> list[float] | None:
    """Each weekday's share of an average day over the last full weeks; None under 3 weeks of history."""
    if history.first_day is None:
        return None
    full_days = (today - history.first_day).days
    if full_days < WEEKDAY_AWARE_AFTER_DAYS:
        return None
    weeks = min(MAX_WEEKS, full_days // 7)
    days = [today - timedelta(days=k) for k in range(1, 7 * weeks + 1)]
    mean_all = sum(history.spend(d) for d in days) / len(days)
    if mean_all <= 0:
        return None
    by_weekday: dict[int, list[int]] = defaultdict(list)
    for d in days:
        by_weekday[d.weekday()].append(history.spend(d))
    return [statistics.fmean(by_weekday[w]) / mean_all for w in range(7)]


def day_start(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=local_zone())


def day_share(day: date, start: datetime, end: datetime) -> float:
    """The share of the local day `day` that [start, end) covers (days of 23 or 25 hours included)."""
    begin, finish = day_start(day), day_start(day + timedelta(days=1))
    covered = (min(end, finish) - max(start, begin)).total_seconds()
    return max(0.0, covered) / (finish - begin).total_seconds()


def base_rate(history: History, now: datetime, factors: list[float] | None) -> float:
    """Spend per average day over the trailing window: today so far and up to 6 full days before it."""
    today = now.astimezone(local_zone()).date()
    if history.first_day is None:
        return 0.0
    full_days = min(TRAILING_FULL_DAYS, max(0, (today - history.first_day).days))
    window = [today - timedelta(days=k) for k in range(full_days, 0, -1)]
    spend = sum(history.spend(d) for d in window) + history.spend(today)
    factor = (lambda d: factors[d.weekday()]) if factors else (lambda d: 1.0)
    weight = sum(factor(d) for d in window) + factor(today) * day_share(today, day_start(today), now)
    if weight <= 0 and factors:  # only days the weekday shape says are quiet: judge them flat
        return base_rate(history, now, None)
    return spend / weight if weight > 0 else 0.0


def exhaustion_at(now: datetime, period_end: datetime, left: float, rate_on: Callable[[date], float]) -> datetime | None:
    """Where the forecast spend from `now` reaches `left`, each day's rate spread over it; None past period_end."""
    if left <= 0:
        return now
    cursor = now
    while cursor < period_end:
        day = cursor.astimezone(local_zone()).date()
        end = min(day_start(day + timedelta(days=1)), period_end)
        per_day = rate_on(day)
        length = (day_start(day + timedelta(days=1)) - day_start(day)).total_seconds()
        expected = per_day * (end - cursor).total_seconds() / length
        if per_day > 0 and expected >= left:
            return cursor + timedelta(seconds=left / per_day * length)
        left -= expected
        cursor = end
    return None


def forecast(cap: CostCap, history: History, now: datetime) -> Forecast:
    start, end = period_bounds(cap.period, now)
    first, today = start.astimezone(local_zone()).date(), now.astimezone(local_zone()).date()
    spent = sum(amount for day, amount in history.daily.items() if first <= day <= today)
    factors = weekday_factors(history, today)
    rate = base_rate(history, now, factors)
    rate_on = (lambda d: rate * factors[d.weekday()]) if factors else (lambda d: rate)
    runs_out = exhaustion_at(now, end, cap.cap_micro_usd - spent, rate_on) if rate > 0 or spent >= cap.cap_micro_usd else None
    return Forecast(cap, now, spent, rate, factors is not None, runs_out, end)


def spike(history: History, now: datetime) -> tuple[int, int] | None:
    """(today's spend, the trailing median) when today is above 3x the median of the 7 days before; else None.

    Needs 7 full days of history and a median above zero: a first day or a first paid request is
    not a spike, only a change from a known normal is.
    """
    today = now.astimezone(local_zone()).date()
    if history.first_day is None or (today - history.first_day).days < SPIKE_MEDIAN_DAYS:
        return None
    median = statistics.median(history.spend(today - timedelta(days=k)) for k in range(1, SPIKE_MEDIAN_DAYS + 1))
    spent = history.spend(today)
    if median > 0 and spent > SPIKE_FACTOR * median:
        return spent, int(median)
    return None


# --- the scopes and their histories, from the ledger ---------------------------------------------------


def provider_caps(providers: list[Provider]) -> list[CostCap]:
    return [
        CostCap(f"provider:{p.name}", Period.MONTH, p.monthly_limit_micro_usd, ("provider_id",), (p.pk,))
        for p in providers
        if p.monthly_limit_micro_usd
    ]


def user_caps(now: datetime, user_ids: list[int] | None = None) -> list[CostCap]:
    """Every user's cost caps as the guard applies them: a user's own row for a (feature, period)
    replaces the default as a whole. Under a default, only users active in the trailing week count
    (a cap nobody spends against runs out never). `user_ids` limits it to those users (a page)."""
    # Minute and hour caps are windows against bursts: there is no period end to forecast against.
    quotas = list(Quota.objects.select_related("feature").filter(period__in=CALENDAR_PERIODS))
    own = {(q.user_id, q.feature_id, q.period): q for q in quotas if q.user_id is not None}
    defaults = [q for q in quotas if q.user_id is None and q.max_cost_micro_usd]
    if user_ids is None:
        active = set(
            TokenLog.objects.filter(SETTLED, created_at__gte=now - timedelta(days=7), user__isnull=False)
            .values_list("user_id", flat=True).distinct()
        )
        candidates = active | {user_id for user_id, _, _ in own}
    else:
        candidates = set(user_ids)
    names = dict(get_user_model().objects.filter(pk__in=candidates).values_list("id", "username"))
    scopes = {(q.feature_id, q.period): q.feature for q in quotas}
    caps = []
    for user_id in sorted(names):
        for (feature_id, period), feature in scopes.items():
            default = next((q for q in defaults if q.feature_id == feature_id and q.period == period), None)
            row = own.get((user_id, feature_id, period)) or default
            if row is None or not row.max_cost_micro_usd:
                continue
            if feature is None:
                caps.append(CostCap(f"user:{names[user_id]}", period, row.max_cost_micro_usd, ("user_id",), (user_id,)))
            else:
                caps.append(CostCap(
                    f"user:{names[user_id]}/feature:{feature.name}", period, row.max_cost_micro_usd,
                    ("user_id", "feature_id"), (user_id, feature_id),
                ))
    return caps


def team_caps(team_ids: list[int] | None = None) -> list[CostCap]:
    """Every team's cost caps (the whole team's, and per feature), counted from the ledger rows that
    recorded the team at admission, as the guard counts them. `team_ids` limits it (a page)."""
    rows = TeamQuota.objects.select_related("team", "feature").filter(max_cost_micro_usd__gt=0, period__in=CALENDAR_PERIODS)
    if team_ids is not None:
        rows = rows.filter(team_id__in=team_ids)
    caps = []
    for q in rows.order_by("team__name", "feature__name", "period"):
        if q.feature is None:
            caps.append(CostCap(f"team:{q.team.name}", q.period, q.max_cost_micro_usd, ("team_id",), (q.team_id,)))
        else:
            caps.append(CostCap(f"team:{q.team.name}/feature:{q.feature.name}", q.period, q.max_cost_micro_usd,
                                ("team_id", "feature_id"), (q.team_id, q.feature_id)))
    return caps


def tag_caps(tags: list[str] | None = None) -> list[CostCap]:
    """Every tag's monthly cost cap (TagQuota), whoever sends the requests. `tags` limits it."""
    rows = TagQuota.objects.filter(max_cost_micro_usd__gt=0)
    if tags is not None:
        rows = rows.filter(tag__in=tags)
    return [CostCap(f"tag:{q.tag}", Period.MONTH, q.max_cost_micro_usd, TAG_GROUP, (q.tag,)) for q in rows.order_by("tag")]


def all_cost_caps(now: datetime) -> list[CostCap]:
    providers = list(Provider.objects.filter(monthly_limit_micro_usd__isnull=False).order_by("name"))
    return provider_caps(providers) + user_caps(now) + team_caps() + tag_caps()


def histories(caps: list[CostCap], now: datetime) -> dict[tuple, History]:
    """(group, key) → History: one aggregate query per kind of scope, over the lookback window."""
    today = now.astimezone(local_zone()).date()
    since = day_start(today - timedelta(days=LOOKBACK_DAYS))
    wanted: dict[tuple[str, ...], set[tuple]] = defaultdict(set)
    for cap in caps:
        wanted[cap.group].add(cap.key)
    out: dict[tuple, History] = {}
    for group, keys in wanted.items():
        if group == TAG_GROUP:
            out |= tag_histories(sorted(tag for (tag,) in keys), since, now)
            continue
        rows = TokenLog.objects.filter(SETTLED, created_at__gte=since, created_at__lt=now)
        for position, name in enumerate(group):
            rows = rows.filter(**{f"{name}__in": {key[position] for key in keys}})
        daily: dict[tuple, dict[date, int]] = defaultdict(dict)
        for row in (
            rows.annotate(day=TruncDate("created_at", tzinfo=local_zone()))
            .order_by().values(*group, "day").annotate(spent=Sum("cost_micro_usd"), n=Count("id"))
        ):
            key = tuple(row[name] for name in group)
            if key in keys:
                daily[key][row["day"]] = row["spent"] or 0
        for key in keys:
            days = daily.get(key, {})
            out[(group, key)] = History(days, min(days) if days else None)
    return out


def tag_histories(tags: list[str], since: datetime, now: datetime) -> dict[tuple, History]:
    """(TAG_GROUP, (tag,)) → History for these tags: one query, grouped by local day, with a
    conditional sum per tag (a row with two capped tags counts for both, as the guard counts it)."""
    matching = [Q(tags__contains=tags_text([tag])) for tag in tags]
    any_tag = Q()
    for one in matching:
        any_tag |= one
    rows = (
        TokenLog.objects.filter(SETTLED, any_tag, created_at__gte=since, created_at__lt=now, **TAGGED)
        .annotate(day=TruncDate("created_at", tzinfo=local_zone()))
        .order_by().values("day")
        .annotate(**{f"t{i}": Sum("cost_micro_usd", filter=one) for i, one in enumerate(matching)})
    )
    daily: dict[str, dict[date, int]] = defaultdict(dict)
    for row in rows:
        for i, tag in enumerate(tags):
            if row[f"t{i}"] is not None:  # NULL: no row of this tag that day (0 is a day of free requests)
                daily[tag][row["day"]] = row[f"t{i}"]
    return {(TAG_GROUP, (tag,)): History(daily[tag], min(daily[tag]) if daily[tag] else None) for tag in tags}


def forecasts(caps: list[CostCap], now: datetime) -> list[Forecast]:
    found = histories(caps, now)
    return [forecast(cap, found[(cap.group, cap.key)], now) for cap in caps]


def forecasts_by_scope(caps: list[CostCap], now: datetime) -> dict[tuple[str, str], Forecast]:
    """(scope, period) → Forecast, for pages that show each beside its cap."""
    return {(f.cap.scope, f.cap.period): f for f in forecasts(caps, now)}
