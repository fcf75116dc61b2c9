"""The budget guard: which ceilings apply to a request, admit against all of them at once, settle.

    decision = admit(AdmissionRequest(...))     # before the request goes anywhere
    ...                                          # the model runs with decision.max_tokens
    settle(request_id, usage)                    # in a finally: always, exactly once

The ledger row (TokenLog) is written before the Redis admission, already claiming the reservation
the admission asks for (`admitted`, with the request granted in full): when the Lua call grants
exactly that, as it does unless a cap is nearly reached, the row needs no second statement. Only a
partial grant, a fallback or a refusal writes the row again. A counter rebuilt from the ledger
counts settled rows as used and claimed in-flight rows as reserved, so one rebuilt between the
INSERT and the Lua call holds this request already: the admit script takes it out before checking
and puts it back only if it admits (counters.ADMIT_LUA), and a refusal releases whatever a counter
rebuilt before its UPDATE took from the claim. Whether the Lua call granted a claimed row is its
admitted marker in Redis (reconcile.fail_lost_request reads it for rows a crash left running).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from . import ledger_sql, ledger_writer, refcache
from .batching import Batch
from .counter_store import EvictingRedis, counter_store, refuse_evicting_redis  # noqa: F401 - the guard's API
from .counters import AdmitResult, CounterGroup, CounterSpec, Limits, StaleRebuild, Usage, Versions
from .live import publish_on_commit
from .models import (
    CALENDAR_PERIODS,
    WINDOW_PERIODS,
    Feature,
    InFlightCap,
    ModelPrice,
    Period,
    Provider,
    Quota,
    RetrievalFacts,
    TagQuota,
    Team,
    TeamQuota,
    TokenLog,
    memberships_of,
)
from .money import format_usd
from .periods import describe_reset, period_bounds, period_key, seconds_until_reset
from .tags import tag_filter, tags_text

log = logging.getLogger(__name__)

WARN_PERMILLE = 800  # tell the user when a ceiling is 80% used
REBUILD_ATTEMPTS = 5
COUNTER_GRACE_S = 2 * 24 * 3600
# A minute's or an hour's counter is not read once its window has passed (a settle that finds it
# gone has nothing to release there): kept long enough for the window's answers to settle, not
# the days a calendar counter is kept, or every active user would leave 2,880 minute keys behind.
WINDOW_GRACE_S = 600


class GuardUnavailable(RuntimeError):
    pass


def provider_month_key(provider_id: int, at: datetime) -> str:
    """The counter of a provider's spend in the month of `at` (its monthly limit's ceiling)."""
    return f"ceiling:c:provider:{provider_id}:month:{period_key(Period.MONTH, at)}"


def team_key(team_id: int, feature_id: int | None, period: str, pkey: str) -> str:
    """The counter of a team's quota on all features (feature_id None) or on one, in one period."""
    return f"ceiling:c:team:{team_id}:{'all' if feature_id is None else f'f{feature_id}'}:{period}:{pkey}"


# --- which ceilings apply ------------------------------------------------------------------------


@dataclass(frozen=True)
class Ceiling:
    """One cap that applies to a request, with what a person should read when it says no."""

    spec: CounterSpec
    scope: str  # user | feature | team | team_feature | key | tag | provider | loop
    period: str | None  # day | month | None (a loop has no calendar period)
    subject: str  # "your", "the feature 'chat'", "the provider 'local'", "your team 'Support'"
    ledger_filter: dict = field(hash=False, compare=False)
    feature_name: str = ""  # a team's per-feature cap: the feature's name


@dataclass(frozen=True)
class LoopLimits:
    loop_id: str
    max_calls: int | None
    max_cost_micro_usd: int | None


@dataclass(frozen=True)
class Scopes:
    """Who else a request counts against besides its user: the user's team, its API key, its tags.

    Read once per admission (the primary feature and its fallback share it); the ledger row records
    the same team, key and tags, so a counter rebuilt from the ledger counts what the guard counted.
    """

    team: Team | None = None
    team_quotas: tuple[TeamQuota, ...] = ()
    api_key: object | None = None  # accounts.ApiKey, whose own caps it carries
    tags: tuple[str, ...] = ()
    tag_quotas: tuple[TagQuota, ...] = ()

    def team_quota(self, feature: Feature | None, period: str) -> TeamQuota | None:
        feature_id = feature.pk if feature else None
        return next((q for q in self.team_quotas if q.feature_id == feature_id and q.period == period), None)


def request_scopes(user, api_key=None, tags: tuple[str, ...] = (), team_name: str = "") -> Scopes:
    """The team that pays (below) and its caps, and the tags' caps: from this process's reference
    cache (budgets/refcache.py), else one query for a user without a team, one more for a team's
    caps, one more for tag caps.

    A user in several teams pays with one per request: the team `team_name` names (the
    X-Ceiling-Team header), else the one the API key names, else the team the user joined first.
    Only that team's caps apply, and the ledger row records it, so each team's counters count
    exactly the requests it paid for. The API refuses a name the user is not a member of before
    the guard (team_not_member); should the membership end in between, the first team pays."""
    wanted = team_name or (getattr(api_key, "team_name", "") or "")
    team = refcache.cache.get("team_of_user", ("teammembership", "team"), (user.pk, wanted),
                              lambda: paying_team(user.pk, wanted))
    team_quotas = (
        refcache.cache.get("team_quotas", ("teamquota",), team.pk, lambda: tuple(TeamQuota.objects.filter(team=team)))
        if team else ()
    )
    tags = tuple(tags)
    tag_quotas = (
        refcache.cache.get(
            "tag_quotas", ("tagquota",), tags, lambda: tuple(TagQuota.objects.filter(tag__in=tags).order_by("tag"))
        )
        if tags else ()
    )
    return Scopes(team, team_quotas, api_key, tags, tag_quotas)


def paying_team(user_id: int, name: str = "") -> Team | None:
    """The user's team called `name` when they are in it, else the team they joined first, else None."""
    teams = [m.team for m in memberships_of(user_id).select_related("team")]
    return next((team for team in teams if team.name == name), teams[0] if teams else None)


def applicable_ceilings(
    user, feature: Feature, provider: Provider, at: datetime, loop: LoopLimits | None = None,
    scopes: Scopes | None = None,
) -> list[Ceiling]:
    quotas = _quotas_for(user, feature)
    if scopes is None:
        scopes = request_scopes(user)
    ceilings = []
    for period in (*WINDOW_PERIODS, *CALENDAR_PERIODS):
        start, end = period_bounds(period, at)
        ttl = int((end - at).total_seconds()) + (WINDOW_GRACE_S if period in WINDOW_PERIODS else COUNTER_GRACE_S)
        pkey = period_key(period, at)
        window = {"created_at__gte": start, "created_at__lt": end}
        user_quota = quotas.get((True, False, period)) or quotas.get((False, False, period))
        if user_quota is not None:
            ceilings.append(
                Ceiling(
                    CounterSpec(f"ceiling:c:user:{user.pk}:all:{period}:{pkey}", _limits(user_quota), ttl),
                    "user", period, "your", {"user_id": user.pk, **window},
                )
            )
        feature_quota = quotas.get((True, True, period)) or quotas.get((False, True, period))
        if feature_quota is not None:
            ceilings.append(
                Ceiling(
                    CounterSpec(f"ceiling:c:user:{user.pk}:f{feature.pk}:{period}:{pkey}", _limits(feature_quota), ttl),
                    "feature", period, f"your {feature.name!r}",
                    {"user_id": user.pk, "feature_id": feature.pk, **window},
                )
            )
        ceilings += _team_ceilings(scopes, feature, period, pkey, ttl, window)
        ceilings += _key_ceilings(scopes.api_key, period, pkey, ttl, window)
    ceilings += _in_flight_ceilings(user, scopes.api_key, at)
    ceilings += _tag_ceilings(scopes, at)
    if provider.monthly_limit_micro_usd is not None:
        start, end = period_bounds(Period.MONTH, at)
        ttl = int((end - at).total_seconds()) + COUNTER_GRACE_S
        ceilings.append(
            Ceiling(
                CounterSpec(
                    provider_month_key(provider.pk, at),
                    Limits(cost_micro_usd=provider.monthly_limit_micro_usd),
                    ttl,
                ),
                "provider", Period.MONTH, f"the provider {provider.name!r}",
                {"provider_id": provider.pk, "created_at__gte": start, "created_at__lt": end},
            )
        )
    if loop is not None:
        ceilings.append(
            Ceiling(
                CounterSpec(
                    f"ceiling:c:loop:{user.pk}:{loop.loop_id}",
                    Limits(requests=loop.max_calls, cost_micro_usd=loop.max_cost_micro_usd),
                    COUNTER_GRACE_S,
                ),
                "loop", None, "this loop", {"user_id": user.pk, "loop_id": loop.loop_id},
            )
        )
    return [c for c in ceilings if c.spec.limits.any()]


# What a request's ceilings are computed from, besides the request itself: their versions tag each
# cached list, so a write to any of them is seen as it is by every other lookup of the cache.
CEILING_TABLES = ("quota", "team", "teammembership", "teamquota", "tagquota", "provider", "feature", "inflightcap")


def admission_ceilings(user, feature: Feature | None, provider: Provider, at: datetime, loop: LoopLimits | None,
                       scopes: Scopes) -> list[Ceiling]:
    """applicable_ceilings, computed once per process for the same user, feature, provider, loop,
    scopes and day while the reference cache holds them (~10% of an admission's CPU otherwise).

    The key carries every value of the arguments the list is built from that no version covers
    (the caller's feature, provider and key objects, the loop's limits); the minute's start fixes
    every period key (so a user's list is computed again once a minute). A cached list keeps the counter TTLs of its first use, at most the cache's
    MAX_AGE_S longer than exact, against a grace of COUNTER_GRACE_S past the period's end.
    """
    key_caps = scopes.api_key
    key = (
        # The minute's start fixes every period key (minute, hour, day, month) the list names.
        user.pk, period_bounds(Period.MINUTE, at)[0], loop, scopes.tags, scopes.team.pk if scopes.team else None,
        (feature.pk, feature.name) if feature is not None else None,
        (provider.pk, provider.name, provider.monthly_limit_micro_usd),
        (key_caps.pk, key_caps.name, key_caps.max_requests_per_day, key_caps.max_cost_per_day_micro_usd,
         key_caps.max_cost_per_month_micro_usd, key_caps.max_in_flight) if key_caps is not None else None,
    )
    return refcache.cache.get(
        "ceilings", CEILING_TABLES, key, lambda: applicable_ceilings(user, feature, provider, at, loop, scopes)
    )


def _team_ceilings(scopes: Scopes, feature: Feature, period: str, pkey: str, ttl: int, window: dict) -> list[Ceiling]:
    team = scopes.team
    if team is None:
        return []
    ceilings = []
    quota = scopes.team_quota(None, period)
    if quota is not None:
        ceilings.append(Ceiling(
            CounterSpec(team_key(team.pk, None, period, pkey), _limits(quota), ttl),
            "team", period, f"your team {team.name!r}", {"team_id": team.pk, **window},
        ))
    quota = scopes.team_quota(feature, period) if feature is not None else None
    if quota is not None:
        ceilings.append(Ceiling(
            CounterSpec(team_key(team.pk, feature.pk, period, pkey), _limits(quota), ttl),
            "team_feature", period, f"your team {team.name!r}",
            {"team_id": team.pk, "feature_id": feature.pk, **window},
            feature.name,
        ))
    return ceilings


def _key_ceilings(key, period: str, pkey: str, ttl: int, window: dict) -> list[Ceiling]:
    if key is None or period not in CALENDAR_PERIODS:
        return []
    if period == Period.DAY:
        limits = Limits(requests=key.max_requests_per_day, cost_micro_usd=key.max_cost_per_day_micro_usd)
    else:
        limits = Limits(cost_micro_usd=key.max_cost_per_month_micro_usd)
    return [Ceiling(
        CounterSpec(f"ceiling:c:key:{key.pk}:{period}:{pkey}", limits, ttl),
        "key", period, f"this API key ({key.name!r})", {"api_key_id": key.pk, **window},
    )]


# A concurrency counter has no period: it lives while its caller keeps sending (each admission
# renews it) and, when it has expired, is rebuilt from the ledger's rows of the last IN_FLIGHT_TTL_S,
# the only ones that can still be in flight (reconciliation settles a row the worker never did
# within CEILING_RESERVATION_TTL_S, minutes).
IN_FLIGHT_TTL_S = 24 * 3600
# What a refusal for too many answers in progress asks the client to wait: one usually ends soon.
IN_FLIGHT_RETRY_AFTER_S = 1


def _in_flight_ceilings(user, key, at: datetime) -> list[Ceiling]:
    """The user's cap on requests in flight at once (their own, else everyone's), and the key's."""
    ceilings = []
    since = {"created_at__gte": at - timedelta(seconds=IN_FLIGHT_TTL_S)}
    user_cap = in_flight_cap_of(user.pk)
    if user_cap is not None:
        ceilings.append(Ceiling(
            CounterSpec(f"ceiling:c:user:{user.pk}:inflight", Limits(in_flight=user_cap), IN_FLIGHT_TTL_S),
            "user_in_flight", None, "you", {"user_id": user.pk, **since},
        ))
    if key is not None and key.max_in_flight is not None:
        ceilings.append(Ceiling(
            CounterSpec(f"ceiling:c:key:{key.pk}:inflight", Limits(in_flight=key.max_in_flight), IN_FLIGHT_TTL_S),
            "key_in_flight", None, f"this API key ({key.name!r})", {"api_key_id": key.pk, **since},
        ))
    return ceilings


def in_flight_cap_of(user_id: int) -> int | None:
    """How many requests this user may have in flight: their own InFlightCap, else everyone's, else None."""
    def load() -> int | None:
        caps = {cap.user_id: cap.max_in_flight for cap in InFlightCap.objects.filter(Q(user_id=user_id) | Q(user__isnull=True))}
        return caps.get(user_id, caps.get(None))

    return refcache.cache.get("in_flight_cap", ("inflightcap",), user_id, load)


def _tag_ceilings(scopes: Scopes, at: datetime) -> list[Ceiling]:
    if not scopes.tag_quotas:
        return []
    start, end = period_bounds(Period.MONTH, at)
    ttl = int((end - at).total_seconds()) + COUNTER_GRACE_S
    pkey = period_key(Period.MONTH, at)
    return [
        Ceiling(
            CounterSpec(f"ceiling:c:tag:{q.tag}:month:{pkey}", Limits(cost_micro_usd=q.max_cost_micro_usd), ttl),
            "tag", Period.MONTH, f"the tag {q.tag!r}",
            {**tag_filter(q.tag), "created_at__gte": start, "created_at__lt": end},
        )
        for q in scopes.tag_quotas
    ]


def _quotas_for(user, feature: Feature) -> dict[tuple[bool, bool, str], Quota]:
    """(is the user's own, is per-feature, period) → quota; the user's own beats the default."""
    def load() -> dict[tuple[bool, bool, str], Quota]:
        rows = Quota.objects.filter(Q(user=user) | Q(user__isnull=True)).filter(Q(feature=feature) | Q(feature__isnull=True))
        return {(q.user_id is not None, q.feature_id is not None, q.period): q for q in rows}

    return refcache.cache.get("quotas", ("quota",), (user.pk, feature.pk if feature else None), load)


def _limits(quota: Quota) -> Limits:
    return Limits(quota.max_requests, quota.max_tokens, quota.max_cost_micro_usd)


# A local model served with other weights is logged as "<model>@<variant>" (int8, q4, bf16), priced by
# its own ModelPrice (measured from its own workers' throughput, or set by staff); until it has one,
# at the full-precision model's price, as before variants were priced apart.
VARIANT_SEPARATOR = "@"


def price_in_force(provider: Provider, model: str, at: datetime) -> ModelPrice | None:
    # Every price of the model, newest first (a handful of rows): `at` picks among them here, so
    # one cache entry serves every moment, including a price that takes effect later.
    prices = refcache.cache.get(
        "prices", ("modelprice",), (provider.pk, model),
        lambda: tuple(ModelPrice.objects.filter(provider=provider, model=model).order_by("-effective_from", "-pk")),
    )
    price = next((p for p in prices if p.effective_from <= at), None)
    if price is None and provider.kind == Provider.Kind.LOCAL and VARIANT_SEPARATOR in model:
        return price_in_force(provider, model.rpartition(VARIANT_SEPARATOR)[0], at)
    return price


# --- admission -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fallback:
    """Where the request goes when a cost or provider-spend cap refuses its own feature.

    The caller chooses it (the feature's fallback, when that one could take this request at all) and
    names the model it prices and logs; the guard decides, in the same atomic step, whether it fits.
    """

    feature: Feature
    model: str
    max_tokens: int


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    user: object
    feature: Feature
    model: str
    prompt_tokens: int
    max_tokens: int
    loop: LoopLimits | None = None
    provider: Provider | None = None
    fallback: Fallback | None = None
    retrieval: RetrievalFacts | None = None  # a docs feature's request: what retrieval added to its prompt
    api_key: object | None = None  # accounts.ApiKey the request came with (the /v1 API); its caps apply
    tags: tuple[str, ...] = ()  # validated names (budgets.models.TAG_RE), at most MAX_TAGS
    team: str = ""  # the team the caller asked to pay (X-Ceiling-Team); empty: the key's, else the first joined


@dataclass
class Decision:
    admitted: bool
    request_id: str
    max_tokens: int = 0
    code: str = ""
    message: str = ""
    retry_after_s: int | None = None
    warning: str = ""
    log: TokenLog | None = None
    # Admitted on the fallback: the feature and model that serve, and the sentence that says why.
    fell_back_to: Feature | None = None
    fallback_model: str = ""
    fallback_notice: str = ""


@dataclass(frozen=True)
class Candidate:
    """A feature that could serve the request, with the price and ceilings it would be admitted under."""

    feature: Feature
    provider: Provider
    model: str
    max_tokens: int
    price: ModelPrice | None
    ceilings: list[Ceiling]

    def counter_group(self) -> CounterGroup:
        return CounterGroup(
            [c.spec for c in self.ceilings],
            self.max_tokens,
            self.price.input_per_million_micro_usd if self.price else 0,
            self.price.output_per_million_micro_usd if self.price else 0,
        )


def candidate(request: AdmissionRequest, feature: Feature, provider: Provider | None, model: str, max_tokens: int,
              now: datetime, scopes: Scopes | None = None) -> Candidate:
    provider = provider or feature.provider or refcache.cache.get("default_provider", ("provider",), None, Provider.default)
    if scopes is None:
        scopes = request_scopes(request.user, request.api_key, request.tags, request.team)
    ceilings = admission_ceilings(request.user, feature, provider, now, request.loop, scopes)
    return Candidate(feature, provider, model, max_tokens, price_in_force(provider, model, now), ceilings)


def admit(request: AdmissionRequest, now: datetime | None = None) -> Decision:
    """Check every ceiling and reserve against all of them atomically, or refuse with a sentence.

    With a fallback, a refusal by a cost or provider-spend cap (and by nothing else) admits the
    request on the fallback's ceilings instead, when they have room, in the same Lua call.
    """
    now = now or timezone.now()
    # Every reference row below is this process's copy, read under the versions it last saw; the
    # Lua call checks them (refcache.versions_to_check) and decides only if none moved since.
    versions = refcache.cache.versions_to_check()
    scopes, primary, fallback = _candidates(request, now)
    try:
        row, created = _open_row(request, primary.provider, primary.price, primary.ceilings, now, scopes.team)
    except IntegrityError:
        # The row names a provider, a price or a team this process cached and another deleted since
        # (the Lua call would have said so, but the row comes first): read them again, once.
        refcache.refresh()
        versions = refcache.cache.versions_to_check()
        scopes, primary, fallback = _candidates(request, now)
        row, created = _open_row(request, primary.provider, primary.price, primary.ceilings, now, scopes.team)
    if not created:
        return Decision(False, request.request_id, code="duplicate_request", message="This request was already submitted.")
    try:
        for _ in range(STALE_ATTEMPTS):
            result = _admit_with_rebuild(request, primary, fallback, versions)
            if result.status != "stale":
                break
            # A quota, a price… changed since this process read it: read again, and say so on the row.
            refcache.cache.install(result.versions)
            versions = refcache.cache.versions_to_check()
            scopes, primary, fallback = _candidates(request, now)
            _reopen_row(row, primary, scopes.team)
        else:
            raise GuardUnavailable("the reference rows kept changing during the admission")
        if versions is not None:
            refcache.cache.confirm()
    except (redis.RedisError, GuardUnavailable) as exc:
        log.warning("guard unavailable: %s", exc)
        message = "The budget guard cannot be reached right now, so no request can be admitted. Please try again in a minute."
        return _refuse(row, "guard_unavailable", message, 30)
    if result.status == "duplicate":
        return _refuse(row, "duplicate_request", "This request was already submitted.", None)
    ceilings = primary.ceilings + (fallback.ceilings if fallback else [])  # the script's indexes count both
    if result.status == "refused":
        code, message, retry = refusal_text(ceilings[result.refused_index], result, now)
        if result.fallback_refusal is not None:
            message, retry = _fallback_refused_too(fallback, ceilings, result.fallback_refusal, message, retry, now)
        decision = _refuse(row, code, message, retry)
        _release_claim(row)
        return decision
    served = fallback if result.fell_back else primary
    if result.fell_back or not _granted_as_claimed(row, result):
        _mark_admitted(row, result, served, requested=request.feature if result.fell_back else None)
    warning = ""
    if result.fullest_permille >= WARN_PERMILLE and result.fullest_index is not None:
        warning = nearing_text(ceilings[result.fullest_index], result, now)
    decision = Decision(True, request.request_id, max_tokens=result.granted_tokens, warning=warning, log=row)
    if result.fell_back:
        why = result.primary_refusal
        decision.fell_back_to, decision.fallback_model = served.feature, served.model
        decision.fallback_notice = fell_back_text(ceilings[why.refused_index], why, served, now)
    return decision


STALE_ATTEMPTS = 3


def _candidates(request: AdmissionRequest, now: datetime) -> tuple[Scopes, Candidate, Candidate | None]:
    """Who the request counts against, and the ceilings of its feature and of its fallback."""
    scopes = request_scopes(request.user, request.api_key, request.tags, request.team)
    primary = candidate(request, request.feature, request.provider, request.model, request.max_tokens, now, scopes)
    # Its ceilings are read even when the primary will fit: one Lua call decides both, atomically.
    offered = request.fallback
    fallback = (
        candidate(request, offered.feature, None, offered.model, offered.max_tokens, now, scopes) if offered else None
    )
    return scopes, primary, fallback


def _reopen_row(row: TokenLog, primary: Candidate, team: Team | None) -> None:
    """The running row, after the reference rows changed under its admission: what it records of
    them (its provider, price, team and counters) as they are now, before the Lua call decides."""
    fields = {
        "provider": primary.provider,
        "price": primary.price,
        "team": team,
        "counter_keys": [c.spec.key for c in primary.ceilings],
        "reserved_cost_micro_usd": _full_reservation(row.prompt_tokens, primary.max_tokens, primary.price)[1],
    }
    if all(getattr(row, name) == value for name, value in fields.items()):
        return
    for name, value in fields.items():
        setattr(row, name, value)
    TokenLog.objects.filter(pk=row.pk).update(**fields)


def _mark_admitted(row: TokenLog, result: AdmitResult, served: Candidate, requested: Feature | None) -> None:
    """The row holds what was reserved; after a fallback also who serves it, so that settling releases
    the fallback's counters and a rebuild counts the row under the fallback's feature and provider."""
    fields = {
        "admitted": True,
        "max_tokens": result.granted_tokens,
        "reserved_tokens": result.reserved_tokens,
        "reserved_cost_micro_usd": result.reserved_cost_micro_usd,
    }
    if requested is not None:
        fields |= {
            "requested_feature": requested,
            "feature": served.feature,
            "provider": served.provider,
            "price": served.price,
            "model": served.model,
            "counter_keys": [c.spec.key for c in served.ceilings],
        }
    for name, value in fields.items():
        setattr(row, name, value)
    shared = requested is None and ledger_writer.group_commit_applies()
    with ledger_writer.writer.counted():
        if shared:
            ledger_writer.writer.mark_admitted(row)  # shares its commit with the other admissions'
        elif requested is None:
            ledger_sql.update(fields, {"id": row.pk})
        else:
            TokenLog.objects.filter(pk=row.pk).update(**fields)


def _full_reservation(prompt_tokens: int, max_tokens: int, price: ModelPrice | None) -> tuple[int, int]:
    """(tokens, micro-dollars) the admit script reserves when it grants max_tokens in full: the
    same sums as ADMIT_LUA's (cost rounded up to a whole micro-dollar)."""
    price_in = price.input_per_million_micro_usd if price else 0
    price_out = price.output_per_million_micro_usd if price else 0
    return prompt_tokens + max_tokens, -(-(prompt_tokens * price_in + max_tokens * price_out) // 1_000_000)


def _granted_as_claimed(row: TokenLog, result: AdmitResult) -> bool:
    """Whether the script reserved exactly what the row has claimed since its INSERT."""
    return (result.granted_tokens, result.reserved_tokens, result.reserved_cost_micro_usd) == (
        row.max_tokens, row.reserved_tokens, row.reserved_cost_micro_usd
    )


def _release_claim(row: TokenLog) -> None:
    """After a refusal's UPDATE: a counter rebuilt between the admit call (which took this request
    out) and that UPDATE counted the row's claim; release it there, so counters = ledger. Nothing
    holds it otherwise, and the script's HGETs cost microseconds. If Redis is away the counter
    keeps the claim (it refuses a little early, never admits too much) until it is next rebuilt."""
    try:
        counter_store().release_held(row.request_id, row.counter_keys)
    except redis.RedisError as exc:
        log.warning("could not release the claim of refused request %s: %s", row.request_id, exc)


def _fallback_refused_too(fallback: Candidate, ceilings: list[Ceiling], refusal: AdmitResult, message: str,
                          retry: int | None, now: datetime) -> tuple[str, int | None]:
    """The sentence names both features; retrying helps once either of the two caps resets."""
    _, why_not, fallback_retry = refusal_text(ceilings[refusal.refused_index], refusal, now)
    message = f"{message} Its fallback, the feature {fallback.feature.name!r}, cannot take it either: {why_not}"
    retries = [r for r in (retry, fallback_retry) if r is not None]
    return message, min(retries) if retries else None


def _open_row(request, provider, price, ceilings, now, team=None) -> tuple[TokenLog | None, bool]:
    """(the new running row, True), or (None, False) when this request id is in the ledger already.

    One INSERT, not get_or_create's SELECT + INSERT under a savepoint: a duplicate id is rare and the
    unique index decides it; every admission pays for the round trips and the ORM's query building.
    """
    # Claimed as granted in full (see the module's docstring); _full_reservation is what the script
    # reserves then, so most admissions never write the row again.
    reserved_tokens, reserved_cost = _full_reservation(request.prompt_tokens, request.max_tokens, price)
    row = ledger_sql.new_row({
        "request_id": request.request_id,
        "user": request.user,
        "feature": request.feature,
        "provider": provider,
        "price": price,
        "model": request.model,
        "loop_id": request.loop.loop_id if request.loop else "",
        "team": team,
        "api_key": request.api_key,
        "tags": tags_text(request.tags),
        "status": TokenLog.Status.RUNNING,
        "prompt_tokens": request.prompt_tokens,
        "max_tokens": request.max_tokens,
        "admitted": True,
        "reserved_tokens": reserved_tokens,
        "reserved_cost_micro_usd": reserved_cost,
        "counter_keys": [c.spec.key for c in ceilings],
        "created_at": now,
        **(request.retrieval.ledger_fields() if request.retrieval else {}),
    })
    # In autocommit mode the INSERT is a transaction of its own; inside a caller's transaction a
    # savepoint keeps a duplicate's IntegrityError from breaking it.
    in_transaction = transaction.atomic() if connection.in_atomic_block else nullcontext()
    shared = ledger_writer.group_commit_applies()
    try:
        with ledger_writer.writer.counted():
            if shared:
                ledger_writer.writer.insert(row)  # returns once committed, with the other admissions' rows
            else:
                with in_transaction:
                    ledger_sql.insert(row)
    except IntegrityError:
        if not TokenLog.objects.filter(request_id=request.request_id).exists():
            raise  # another constraint failed: not a duplicate
        return None, False
    return row, True


def _admit_with_rebuild(request: AdmissionRequest, primary: Candidate, fallback: Candidate | None,
                        versions: Versions | None = None) -> AdmitResult:
    store = counter_store()
    ceilings = primary.ceilings + (fallback.ceilings if fallback else [])
    group = primary.counter_group()
    for _ in range(REBUILD_ATTEMPTS):
        result = store.admit(
            request.request_id,
            group.counters,
            prompt_tokens=request.prompt_tokens,
            max_tokens=group.max_tokens,
            price_in_per_million=group.price_in_per_million,
            price_out_per_million=group.price_out_per_million,
            fallback=fallback.counter_group() if fallback else None,
            versions=versions,
        )
        if result.status != "rebuild":
            return result
        # A user's cap on all features is in both groups: rebuild each counter once.
        for ceiling in {ceilings[i].spec.key: ceilings[i] for i in result.rebuild_indexes}.values():
            rebuild_counter(ceiling)
    raise GuardUnavailable("counters could not be rebuilt from the ledger")


def _refuse(row: TokenLog, code: str, message: str, retry_after_s: int | None) -> Decision:
    now = timezone.now()
    refused = TokenLog.objects.filter(pk=row.pk, status=TokenLog.Status.RUNNING).update(
        status=TokenLog.Status.REFUSED,
        refusal_code=code,
        error=message[:500],
        admitted=False,  # its INSERT claimed it
        reserved_tokens=0,
        reserved_cost_micro_usd=0,
        max_tokens=0,
        finished_at=now,
    )
    if refused:  # publish each refusal once, even if this ran twice
        publish_on_commit(row.request_id)
    return Decision(False, row.request_id, code=code, message=message, retry_after_s=retry_after_s)


# --- rebuilding counters from the ledger -----------------------------------------------------------


SETTLED = ~Q(status__in=[TokenLog.Status.RUNNING, TokenLog.Status.REFUSED])
IN_FLIGHT = Q(status=TokenLog.Status.RUNNING, admitted=True)


def ledger_sums(ledger_filter: dict) -> tuple[Usage, Usage]:
    """(used, reserved) for one ceiling, straight from TokenLog."""
    used, reserved, _ = ledger_snapshot(ledger_filter)
    return used, reserved


def ledger_snapshot(ledger_filter: dict) -> tuple[Usage, Usage, dict[str, tuple[int, int]]]:
    """(used, reserved, the in-flight reservations by request id) for one ceiling, from one snapshot.

    Settled rows are one aggregate; in-flight rows (at most the requests running right now) are
    read one by one, because a rebuilt counter must know exactly which reservations it holds.
    Both reads see the same snapshot, so a request settling in between is counted once.
    """
    # Answers served from a cache never went through the guard and used nothing.
    rows = TokenLog.objects.filter(**ledger_filter, cache="")
    with transaction.atomic():
        if connection.vendor == "postgresql" and not _in_outer_transaction():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        sums = rows.filter(SETTLED).aggregate(
            ur=Count("id"), ut=Sum(F("prompt_tokens") + F("completion_tokens")), uc=Sum("cost_micro_usd")
        )
        in_flight = {
            request_id: (tokens, cost)
            for request_id, tokens, cost in rows.filter(IN_FLIGHT).values_list(
                "request_id", "reserved_tokens", "reserved_cost_micro_usd"
            )
        }
    used = Usage(sums["ur"] or 0, sums["ut"] or 0, sums["uc"] or 0)
    reserved = Usage(
        len(in_flight), sum(t for t, _ in in_flight.values()), sum(c for _, c in in_flight.values())
    )
    return used, reserved, in_flight


def _in_outer_transaction() -> bool:
    # A savepoint means our atomic() is nested in a caller's transaction, which may already have
    # run queries: the isolation level can no longer be set there.
    return bool(connection.savepoint_ids)


def rebuild_counter(ceiling: Ceiling) -> None:
    """Install the counter from the ledger; read again when a request settled between the read and
    the install (its reservation would otherwise be held until the period ends)."""
    for _ in range(REBUILD_READS):
        used, reserved, in_flight = ledger_snapshot(ceiling.ledger_filter)
        try:
            counter_store().install(ceiling.spec.key, used, reserved, ceiling.spec.ttl_s, in_flight)
            return
        except StaleRebuild:
            continue
    raise GuardUnavailable("requests kept settling while a counter was rebuilt from the ledger")


REBUILD_READS = 5


# --- settling ------------------------------------------------------------------------------------


def settle(row: TokenLog) -> bool:
    """Release a finished row's reservation and count what it really used. Idempotent.

    On success the row is marked `counters_settled` (on PostgreSQL within SETTLED_MARKS_EVERY_S,
    together with the process's other marks: see settled_marks); when Redis could not be reached it
    stays unmarked and reconciliation settles it again later (a replay changes nothing).
    """
    return _settle_counters(row, count_as_used=True)


def release(row: TokenLog) -> bool:
    """Free whatever a request that never ran may have reserved (e.g. its admission timed out
    after the script ran); counts nothing as used."""
    return _settle_counters(row, count_as_used=False)


def _settle_counters(row: TokenLog, *, count_as_used: bool) -> bool:
    if not row.counter_keys:
        return False
    try:
        first_time = counter_store().settle(
            row.request_id,
            row.counter_keys,
            used_tokens=row.prompt_tokens + row.completion_tokens,
            used_cost_micro_usd=row.cost_micro_usd,
            count_as_used=count_as_used,
        )
    except redis.RedisError as exc:
        log.warning("could not settle %s in Redis (reconciliation will retry): %s", row.request_id, exc)
        return False
    if ledger_writer.group_commit_applies():
        ledger_writer.writer.mark_settled_later(row.pk)  # if lost, reconciliation settles again: a no-op
    elif _marks_can_wait():
        settled_marks.add(row.pk)
    else:
        ledger_sql.update({"counters_settled": True}, {"id": row.pk, "counters_settled": False})
    row.counters_settled = True
    return first_time


# The `counters_settled` marks of a process, written together: one UPDATE every
# SETTLED_MARKS_EVERY_S for every request settled meanwhile, where one each was a statement and a
# commit of every request's cycle. A mark only tells reconciliation not to settle the row again;
# one lost with its process (or a failed UPDATE) makes reconciliation settle again, which changes
# nothing in the counters (the settled marker) and writes the mark.
SETTLED_MARKS_EVERY_S = 0.05
SETTLED_MARKS_MAX = 1000


def _marks_can_wait() -> bool:
    """PostgreSQL, outside a caller's transaction (whose rollback could drop the row, and which may
    read its own mark); SQLite takes one writer at a time, so a thread of its own gains nothing."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def _write_settled_marks(row_ids: list[int]) -> None:
    try:
        ledger_sql.mark_settled(row_ids)
    except DatabaseError:
        connection.close()  # the next batch connects again (the database restarted, say)
        raise


def flush_settled_marks() -> None:
    """Write this process's waiting `counters_settled` marks now (reconciliation, before it counts)."""
    settled_marks.flush()


settled_marks: Batch[int] = Batch(
    "settled-marks", _write_settled_marks, SETTLED_MARKS_EVERY_S, SETTLED_MARKS_MAX,
    # A connection of its own, outside the pool and closed after a second without marks, as the
    # ledger writer's (budgets/ledger_writer.py): an idle process holds none.
    on_thread_start=ledger_writer.use_own_connection, on_idle=lambda: connection.close(), idle_s=ledger_writer.IDLE_CLOSE_S,
)


# --- sentences -----------------------------------------------------------------------------------


def refusal_text(ceiling: Ceiling, result: AdmitResult, now: datetime) -> tuple[str, str, int | None]:
    metric = result.refused_metric
    if metric == "in_flight":
        return _in_flight_refusal(ceiling, result)
    spent = result.refused_used + result.refused_reserved
    code = _code(ceiling, metric)
    amount = _amount(metric, spent, result.refused_limit)
    when = {"minute": "this minute", "hour": "this hour", "day": "for today", "month": "for this month"}.get(ceiling.period or "", "")
    if ceiling.scope == "provider":
        message = (
            f"{ceiling.subject.capitalize()} has reached its monthly spend limit: {amount}. "
            f"Requests resume {describe_reset(ceiling.period, now)}."
        )
    elif ceiling.scope in GROUP_SCOPES:
        message = _group_refusal(ceiling, result, metric, spent, when, now)
    elif ceiling.scope == "loop":
        if metric == "requests":
            message = f"This loop has made {spent:,} of its {result.refused_limit:,} allowed model calls; it stops here."
        else:
            message = f"This loop has spent {amount} allowed, and the next call could cost more; it stops here."
    else:
        verb = {"requests": "made", "tokens": "used", "cost": "spent"}[metric]
        message = f"You have {verb} {amount} {when}"
        if ceiling.scope == "feature":
            message += f" on {ceiling.subject.removeprefix('your ')}"
        if result.refused_reserved:
            message += " (counting answers still in progress)"
        if metric == "tokens" and spent < result.refused_limit:
            message += f", and this conversation alone needs more than the {result.refused_limit - spent:,} left"
        message += f". Your allowance resets {describe_reset(ceiling.period, now)}."
    retry = seconds_until_reset(ceiling.period, now) if ceiling.period else None
    return code, message, retry


GROUP_SCOPES = ("team", "team_feature", "key", "tag")


def _in_flight_refusal(ceiling: Ceiling, result: AdmitResult) -> tuple[str, str, int]:
    """Too many answers in progress at once: how many, the cap, and that one finishing frees a place."""
    running, limit = result.refused_reserved, result.refused_limit
    answers = "answer" if running == 1 else "answers"
    if ceiling.scope == "key_in_flight":
        code = "key_in_flight"
        who = f"{ceiling.subject[0].upper()}{ceiling.subject[1:]} has {running:,} {answers} in progress"
    else:
        code = "user_in_flight"
        who = f"You have {running:,} {answers} in progress"
    message = (f"{who}, the most allowed at once ({limit:,}). "
               "Send this request again when one of them has finished.")
    return code, message, IN_FLIGHT_RETRY_AFTER_S


def _group_refusal(ceiling: Ceiling, result: AdmitResult, metric: str, spent: int, when: str, now: datetime) -> str:
    """A team's, a key's or a tag's cap: who it belongs to, with numbers ("Your team 'Support' has used
    $48.20 of its $50.00 for this month …")."""
    limit = result.refused_limit
    if metric == "cost":
        amount = f"used {format_usd(spent)} of its {format_usd(limit)}"
    else:
        verb = "made" if metric == "requests" else "used"
        amount = f"{verb} {spent:,} of its {limit:,} {metric}"
    message = f"{ceiling.subject[0].upper()}{ceiling.subject[1:]} has {amount} {when}"
    if ceiling.feature_name:
        message += f" on {ceiling.feature_name!r}"
    if result.refused_reserved:
        message += " (counting answers still in progress)"
    if metric == "tokens" and spent < limit:
        message += f", and this conversation alone needs more than the {limit - spent:,} left"
    whose = {"key": "This key's", "tag": "The tag's"}.get(ceiling.scope, "The team's")
    return f"{message}. {whose} allowance resets {describe_reset(ceiling.period, now)}."


def fell_back_text(ceiling: Ceiling, why: AdmitResult, served: Candidate, now: datetime) -> str:
    """What a client is told when the fallback serves: which cap said no, and who answers instead."""
    _, message, _ = refusal_text(ceiling, why, now)
    return f"{message} This answer comes from the feature {served.feature.name!r} ({served.model}) instead."


def nearing_text(ceiling: Ceiling, result: AdmitResult, now: datetime) -> str:
    percent = result.fullest_permille // 10
    what = {"requests": "requests", "tokens": "tokens", "cost": "spending allowance"}[result.fullest_metric]
    when = {"minute": "this minute's", "hour": "this hour's", "day": "today's", "month": "this month's"}.get(
        ceiling.period or "", "this loop's")
    where = f" for {ceiling.subject.removeprefix('your ')}" if ceiling.scope == "feature" else ""
    if ceiling.feature_name:
        where = f" for {ceiling.feature_name!r}"
    who = "You have" if ceiling.scope in ("user", "feature", "loop", "provider") else f"{ceiling.subject[0].upper()}{ceiling.subject[1:]} has"
    text = f"{who} used {percent}% of {when} {what}{where}."
    if ceiling.period and ceiling.scope != "provider":
        text += f" It resets {describe_reset(ceiling.period, now)}."
    return text


def _code(ceiling: Ceiling, metric: str) -> str:
    if ceiling.scope == "provider":
        return "provider_spend"
    if ceiling.scope == "loop":
        return "loop_calls" if metric == "requests" else "loop_spend"
    noun = {"requests": "requests", "tokens": "tokens", "cost": "cost"}[metric]
    prefix = {"user": "user", "team": "team", "team_feature": "team_feature", "key": "key", "tag": "tag"}.get(
        ceiling.scope, "feature"
    )
    return f"{prefix}_{noun}_per_{ceiling.period}"


def _amount(metric: str, spent: int, limit: int) -> str:
    if metric == "cost":
        return f"{format_usd(spent)} of {format_usd(limit)}"
    return f"{spent:,} of your {limit:,} {metric}"
