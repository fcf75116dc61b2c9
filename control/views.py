"""The management API (/manage/v1/): what staff do on the staff pages, for scripts and infrastructure tools.

Thin views in the house style: the body is checked by the staff pages' own forms (the same limits and
sentences), changes go through the pages' own action functions (the same audit rows), usage is read
with budgets.usage (the same numbers). Each view returns (status, payload) or raises ApiError;
control/http.py turns both into JSON.
"""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from accounts.actions import MAX_LIFETIME_DAYS
from accounts.models import KEY_CAP_FIELDS, ApiKey
from budgets.actions import (
    MAX_GRACE_HOURS,
    KeyNotRotatable,
    do_rotate_api_key,
    do_save_with_audit,
    do_set_in_flight_cap,
    do_set_key_caps,
    do_set_quota,
    do_set_tag_quota,
    do_set_team_quota,
    snapshot,
)
from budgets.forms import CapsForm, FeatureForm, InFlightForm, KeyCapsForm, TagField
from budgets.models import (
    Feature,
    InFlightCap,
    Period,
    Provider,
    Quota,
    TagQuota,
    Team,
    TeamQuota,
    TokenLog,
    tag_validator,
)
from budgets.usage import NO_USAGE, caps_of, effective_caps, tag_month_spend, total_usage, usage_by
from budgets.views.config import FEATURE_FIELDS
from inference.actions import do_set_model_aliases, do_switch_quantization, switch_refusal
from inference.console.forms import ModelAliasesForm
from inference.models import ModelAlias

from .actions import do_create_api_key_for, do_revoke_api_key_for
from .http import ApiError, bad_field, error_response, not_found, staff_api
from .openapi import openapi_document
from .payloads import (
    caps_payload,
    feature_payload,
    in_flight_payload,
    key_payload,
    provider_payload,
    quota_payload,
    usage_payload,
)

CAP_FIELDS = ("max_requests", "max_tokens", "max_cost_usd")
SCOPES = ("user", "default", "team", "api_key", "tag")
MAX_LISTED = 1000


def openapi_json(request: HttpRequest) -> JsonResponse:
    """The API's OpenAPI document; no token needed (it holds no secrets), as /v1/openapi.json."""
    return JsonResponse(openapi_document())


# --- looking things up by what staff type ----------------------------------------------------------


def _text(body: dict, field: str, *, required: bool = True) -> str | None:
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise bad_field(field, f"'{field}' must be a non-empty string.")
    return value.strip()


def _user(username: str, field: str = "user"):
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise ApiError(404, "not_found", f"There is no user named {username!r}.", field)
    return user


def _feature(name: str | None, field: str = "feature") -> Feature | None:
    if name is None:
        return None
    feature = Feature.objects.filter(name=name).first()
    if feature is None:
        raise ApiError(404, "not_found", f"There is no feature named {name!r}.", field)
    return feature


def _team(name: str) -> Team:
    team = Team.objects.filter(name=name).first()
    if team is None:
        raise ApiError(404, "not_found", f"There is no team named {name!r}.", "team")
    return team


def _key(key_id) -> ApiKey:
    if isinstance(key_id, str) and key_id.isdigit():
        key_id = int(key_id)
    valid = isinstance(key_id, int) and not isinstance(key_id, bool)
    key = ApiKey.objects.select_related("user").filter(pk=key_id).first() if valid else None
    if key is None:
        raise ApiError(404, "not_found", f"There is no API key with id {key_id}.", "key")
    return key


def _form_errors(form: forms.Form, names: dict[str, str] | None = None) -> ApiError:
    """The form's first error as a 400 naming the API's field (`names` maps form fields to API fields)."""
    field, errors = next(iter(form.errors.items()))
    api_field = (names or {}).get(field, field)
    return bad_field(None if field == "__all__" else api_field, f"{api_field}: {errors[0]}" if field != "__all__" else errors[0])


def _unknown_fields(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad_field(unknown[0], f"Unknown field {unknown[0]!r}; this request takes {', '.join(allowed)}.")


# --- API keys --------------------------------------------------------------------------------------


@staff_api("GET", "POST")
def keys(request: HttpRequest):
    if request.method == "POST":
        return _create_key(request, request.body_json)
    listed = ApiKey.objects.select_related("user").order_by("-created_at", "-id")
    if username := request.GET.get("user"):
        listed = listed.filter(user=_user(username))
    if request.GET.get("active") in ("1", "true"):
        listed = listed.active()
    return 200, {"keys": [key_payload(key) for key in listed[:MAX_LISTED]]}


def _create_key(request: HttpRequest, body: dict):
    _unknown_fields(body, ("user", "name", "expires_in_days"))
    user = _user(_text(body, "user"))
    name = _text(body, "name")
    if len(name) > 100:
        raise bad_field("name", "'name' must be at most 100 characters.")
    days = body.get("expires_in_days")
    if days is not None and (not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= MAX_LIFETIME_DAYS):
        raise bad_field("expires_in_days", f"'expires_in_days' must be a whole number from 1 to {MAX_LIFETIME_DAYS}, "
                        "or left out for a key that never expires.")
    if not user.is_active:
        raise ApiError(409, "user_inactive", f"The user {user.get_username()!r} is deactivated; a key for them would not work.", "user")
    expires_at = timezone.now() + timedelta(days=days) if days else None
    key, plaintext = do_create_api_key_for(request.actor, user, name, expires_at)
    return 201, key_payload(key) | {"key": plaintext}


@staff_api("GET")
def key_detail(request: HttpRequest, key_id: int):
    return 200, key_payload(_key(key_id))


@staff_api("POST")
def key_revoke(request: HttpRequest, key_id: int):
    key = _key(key_id)
    if not do_revoke_api_key_for(request.actor, key):
        raise ApiError(409, "already_revoked", f"The API key {key.name!r} ({key.prefix}…) was revoked already.")
    return 200, key_payload(key)


@staff_api("POST")
def key_rotate(request: HttpRequest, key_id: int):
    body = request.body_json
    _unknown_fields(body, ("grace_hours",))
    key = _key(key_id)
    grace = body.get("grace_hours", 24)
    if not isinstance(grace, int) or isinstance(grace, bool) or not 0 <= grace <= MAX_GRACE_HOURS:
        raise bad_field("grace_hours", f"'grace_hours' must be a whole number from 0 to {MAX_GRACE_HOURS}.")
    try:
        new, plaintext = do_rotate_api_key(request.actor, key.pk, timedelta(hours=grace))
    except KeyNotRotatable as exc:
        raise ApiError(409, "not_rotatable", str(exc)) from None
    key.refresh_from_db()
    return 201, {"new": key_payload(new) | {"key": plaintext}, "old": key_payload(key)}


@staff_api("PATCH")
def key_caps(request: HttpRequest, key_id: int):
    """A key's own caps and features, as staff set them on its caps page (KeyCapsForm, do_set_key_caps)."""
    key = _key(key_id)
    body = request.body_json
    form = KeyCapsForm(None, key=key, lower_only=False)
    _unknown_fields(body, tuple(form.fields))
    form = KeyCapsForm({**form.initial, **body}, key=key, lower_only=False)
    if not form.is_valid():
        raise _form_errors(form)
    with transaction.atomic():
        changes = len(do_set_key_caps(request.actor, key, form.caps()))
    return 200, {"changes": changes, "key": key_payload(key)}


# --- quotas and windows at every scope ----------------------------------------------------------


@staff_api("GET", "PUT", "DELETE")
def quotas(request: HttpRequest):
    if request.method == "GET":
        return 200, {"quotas": _all_quotas()}
    body = request.body_json
    scope = body.get("scope")
    if scope not in SCOPES:
        raise bad_field("scope", f"'scope' must be one of {', '.join(SCOPES)}.")
    period = body.get("period")
    if period not in Period.values:
        raise bad_field("period", f"'period' must be one of {', '.join(Period.values)}.")
    caps = None if request.method == "DELETE" else _caps(body)
    changes = {"user": _set_user_quota, "default": _set_user_quota, "team": _set_team_quota,
               "api_key": _set_key_quota, "tag": _set_tag_quota}[scope](request, body, period, caps)
    return 200, {"changes": changes}


def _all_quotas() -> list[dict]:
    rows = [quota_payload(q) for q in Quota.objects.select_related("user", "feature").order_by("id")]
    rows += [quota_payload(q) for q in TeamQuota.objects.select_related("team", "feature").order_by("id")]
    rows += [quota_payload(q) for q in TagQuota.objects.order_by("tag")]
    rows += [in_flight_payload(row) for row in InFlightCap.objects.select_related("user")]
    capped = ApiKey.objects.select_related("user").filter(
        Q(*[Q(**{f"{name}__isnull": False}) for name in KEY_CAP_FIELDS], _connector=Q.OR), revoked_at__isnull=True)
    rows += [{"scope": "api_key", "key": key.pk, "caps": key_payload(key)["caps"]} for key in capped]
    return rows


def _caps(body: dict) -> dict[str, int | None]:
    """The body's caps through the staff pages' CapsForm (same bounds, same sentences); a cap left out is none."""
    form = CapsForm({name: body.get(name) for name in CAP_FIELDS}, feature=None, period="day", current=None)
    if not form.is_valid():
        raise _form_errors(form)
    return form.entered_caps()


def _set_user_quota(request, body, period, caps) -> int:
    names = ("user", "feature") if body["scope"] == "user" else ("feature",)  # the default names nobody
    _unknown_fields(body, ("scope", *names, "period", *CAP_FIELDS))
    user = _user(_text(body, "user")) if body["scope"] == "user" else None
    feature = _feature(_text(body, "feature", required=False))
    return len(do_set_quota(request.actor, user=user, feature=feature, period=period, caps=caps))


def _set_team_quota(request, body, period, caps) -> int:
    _unknown_fields(body, ("scope", "team", "feature", "period", *CAP_FIELDS))
    team = _team(_text(body, "team"))
    feature = _feature(_text(body, "feature", required=False))
    return len(do_set_team_quota(request.actor, team=team, feature=feature, period=period, caps=caps))


def _set_key_quota(request, body, period, caps) -> int:
    """A key's caps for one period, named as set_quota --api-key names them; a cap the key cannot hold is a 400."""
    _unknown_fields(body, ("scope", "key", "period", *CAP_FIELDS))
    key = _key(body.get("key"))
    names = {"max_requests": f"max_requests_per_{period}", "max_tokens": f"max_tokens_per_{period}",
             "max_cost_micro_usd": f"max_cost_per_{period}_micro_usd"}
    held = {cap: field for cap, field in names.items() if field in KEY_CAP_FIELDS}
    if not held:
        raise bad_field("period", f"An API key has no caps per {period}; its caps are {', '.join(KEY_CAP_FIELDS)}.")
    for cap, value in (caps or {}).items():
        if value is not None and cap not in held:
            field = "max_cost_usd" if cap == "max_cost_micro_usd" else cap
            raise bad_field(field, f"An API key cannot cap {cap.removeprefix('max_').replace('_micro_usd', '')} per "
                            f"{period}; its caps are {', '.join(KEY_CAP_FIELDS)}.")
    return len(do_set_key_caps(request.actor, key, {field: (caps or {}).get(cap) for cap, field in held.items()}))


class _TagForm(forms.Form):
    tag = TagField(max_length=32, validators=[tag_validator])


def _set_tag_quota(request, body, period, caps) -> int:
    _unknown_fields(body, ("scope", "tag", "period", *CAP_FIELDS))
    if period != Period.MONTH:
        raise bad_field("period", "A tag's cap is per month: use period 'month'.")
    if caps and (caps["max_requests"] is not None or caps["max_tokens"] is not None):
        raise bad_field("max_requests" if caps["max_requests"] is not None else "max_tokens",
                        "A tag caps spend only: give max_cost_usd.")
    form = _TagForm({"tag": body.get("tag")})
    if not form.is_valid():
        raise _form_errors(form)
    return len(do_set_tag_quota(request.actor, form.cleaned_data["tag"], caps["max_cost_micro_usd"] if caps else None))


@staff_api("GET", "PUT")
def in_flight(request: HttpRequest):
    """Requests in flight at once per user, or everyone's default (`user` null or left out), as on the
    user's and the defaults page (InFlightForm, do_set_in_flight_cap); `max_in_flight` null removes the cap."""
    if request.method == "GET":
        rows = InFlightCap.objects.select_related("user").order_by("user__username")
        return 200, {"in_flight": [in_flight_payload(row) for row in rows]}
    body = request.body_json
    _unknown_fields(body, ("user", "max_in_flight"))
    user = _user(_text(body, "user")) if body.get("user") is not None else None
    form = InFlightForm({"inflight-max_in_flight": body.get("max_in_flight")}, current=None, for_user=user is not None)
    if not form.is_valid():
        raise _form_errors(form)
    return 200, {"changes": len(do_set_in_flight_cap(request.actor, user, form.value()))}


# --- features' routing ----------------------------------------------------------------------------

ROUTING_FIELDS = ("enabled", "provider", "backup_providers", "fallback", "variant", "model_aliases")


@staff_api("GET")
def features(request: HttpRequest):
    rows = Feature.objects.select_related("provider", "fallback").order_by("name")
    return 200, {"features": [_feature_payload(feature) for feature in rows]}


@staff_api("GET", "PATCH")
def feature_detail(request: HttpRequest, name: str):
    feature = Feature.objects.select_related("provider", "fallback").filter(name=name).first()
    if feature is None:
        raise not_found(f"There is no feature named {name!r}.")
    if request.method == "PATCH":
        return 200, {"changes": _route(request, feature, request.body_json), "feature": _feature_payload(feature)}
    return 200, _feature_payload(feature)


def _feature_payload(feature: Feature) -> dict:
    aliases = list(ModelAlias.objects.filter(feature=feature).order_by("name").values_list("name", flat=True))
    return feature_payload(feature, aliases, Provider.objects.in_bulk(feature.backup_providers or []))


def _route(request: HttpRequest, feature: Feature, body: dict) -> int:
    """Change how a feature is served: each part through the feature page's form and actions, all or nothing."""
    _unknown_fields(body, ROUTING_FIELDS)
    before = snapshot(feature, FEATURE_FIELDS)
    form = FeatureForm(_feature_form_data(feature, body), instance=feature)
    if not form.is_valid():
        raise _form_errors(form, {"backup_providers": "backup_providers"})
    aliases = _aliases_form(feature, body)
    variant = body.get("variant")
    if variant is not None and (refusal := switch_refusal(feature, variant)):
        raise ApiError(409, "variant_refused", f"Not switched: {refusal}", "variant")
    try:
        with transaction.atomic():
            changes = len(do_save_with_audit(request.actor, feature, FEATURE_FIELDS, before, target=f"feature {before['name']}"))
            if aliases is not None and do_set_model_aliases(request.actor, feature, aliases):
                changes += 1
            if variant is not None:
                changes += len(do_switch_quantization(request.actor, feature, variant))
    except IntegrityError:
        raise ApiError(409, "alias_taken", "Another feature took one of these aliases just now; an alias belongs to "
                       "one feature.", "model_aliases") from None
    feature.refresh_from_db()
    return changes


def _feature_form_data(feature: Feature, body: dict) -> dict:
    """The feature page's form as it stands, with the body's routing fields written over it (by name)."""
    data = dict(FeatureForm(instance=feature).initial)
    data = {name: value for name, value in data.items() if name in FEATURE_FIELDS}
    if "enabled" in body:
        if not isinstance(body["enabled"], bool):
            raise bad_field("enabled", "'enabled' must be true or false.")
        data["enabled"] = body["enabled"]
    if "provider" in body:
        data["provider"] = _provider_id(body["provider"], "provider")
    if "fallback" in body:
        data["fallback"] = _feature(body["fallback"], "fallback").pk if body["fallback"] is not None else None
    if "backup_providers" in body:
        names = body["backup_providers"]
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise bad_field("backup_providers", "'backup_providers' must be a list of provider names, in order.")
        data["backup_providers"] = ", ".join(names)
    return data


def _provider_id(name, field: str) -> int | None:
    if name is None:
        return None  # the default provider (local)
    if not isinstance(name, str):
        raise bad_field(field, f"'{field}' must be a provider's name, or null for the default (local) provider.")
    provider = Provider.objects.filter(name=name).first()
    if provider is None:
        raise ApiError(404, "not_found", f"There is no provider named {name!r}.", field)
    return provider.pk


def _aliases_form(feature: Feature, body: dict) -> list[str] | None:
    if "model_aliases" not in body:
        return None
    names = body["model_aliases"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise bad_field("model_aliases", "'model_aliases' must be a list of model names.")
    form = ModelAliasesForm({"aliases": ", ".join(names)}, feature=feature)
    if not form.is_valid():
        raise _form_errors(form, {"aliases": "model_aliases"})
    return form.cleaned_data["aliases"]


@staff_api("GET")
def providers(request: HttpRequest):
    return 200, {"providers": [provider_payload(p) for p in Provider.objects.order_by("name")]}


# --- usage and spend per scope --------------------------------------------------------------------

USAGE_SCOPES = ("everyone", "user", "team", "feature", "api_key", "provider", "tag")


@staff_api("GET")
def usage(request: HttpRequest):
    """This minute's, hour's, day's and month's settled usage of one scope, against its caps, with the
    same functions (and so the same numbers) as the scope's staff page."""
    scope = request.GET.get("scope", "")
    if scope not in USAGE_SCOPES:
        raise bad_field("scope", f"'scope' must be one of {', '.join(USAGE_SCOPES)}.")
    now = timezone.now()
    name = request.GET.get(scope, "") if scope != "everyone" else ""
    if scope != "everyone" and not name:
        raise bad_field(scope, f"Name the {scope.replace('_', ' ')}: ?scope={scope}&{scope}=…")
    return 200, {"scope": scope, "name": name or None, "at": now.isoformat()} | _USAGE[scope](name, now)


def _periods(usage: dict, caps_for) -> dict:
    return {period: usage_payload(usage[period]) | {"caps": caps_for(period)} for period in Period.values}


def _by_feature(usage: dict) -> dict:
    names = dict(Feature.objects.filter(pk__in=[pk for pk in usage if pk]).values_list("pk", "name"))
    return {names.get(pk, "none"): {period: usage_payload(u) for period, u in per.items()} for pk, per in usage.items()}


def _user_usage(username: str, now) -> dict:
    """As the user's staff page (budgets/views/config.py user_detail): per feature, summed; own caps or the default."""
    person = _user(username)
    per_feature = usage_by(TokenLog.objects.filter(user=person), "feature_id", now)
    quotas = Quota.objects.filter(Q(user=person) | Q(user__isnull=True), feature__isnull=True)
    scoped = {(q.user_id is not None, q.period): q for q in quotas}
    total = total_usage(list(per_feature.values()))

    def caps_in_force(period: str) -> dict:
        caps, own = effective_caps(scoped, period)
        return caps_payload(caps) | {"own": own}

    return {"periods": _periods(total, caps_in_force), "features": _by_feature(per_feature)}


def _everyone_usage(_name: str, now) -> dict:
    per_feature = usage_by(TokenLog.objects.all(), "feature_id", now)
    defaults = {q.period: q for q in Quota.objects.filter(user__isnull=True, feature__isnull=True)}
    return {"periods": _periods(total_usage(list(per_feature.values())), lambda p: caps_payload(caps_of(defaults.get(p)))),
            "features": _by_feature(per_feature)}


def _team_usage(name: str, now) -> dict:
    """As the team's page (budgets/views/teams.py team_detail): the rows admitted under the team."""
    team = _team(name)
    per_feature = usage_by(TokenLog.objects.filter(team=team), "feature_id", now)
    caps = {q.period: q for q in TeamQuota.objects.filter(team=team, feature__isnull=True)}
    return {"periods": _periods(total_usage(list(per_feature.values())), lambda p: caps_payload(caps_of(caps.get(p)))),
            "features": _by_feature(per_feature)}


def _feature_usage(name: str, now) -> dict:
    """As the features page: the feature's own settled rows; caps are everyone's default for it."""
    feature = _feature(name)
    used = usage_by(TokenLog.objects.filter(feature=feature), "feature_id", now).get(feature.pk, NO_USAGE)
    caps = {q.period: q for q in Quota.objects.filter(user__isnull=True, feature=feature)}
    return {"periods": _periods(used, lambda p: caps_payload(caps_of(caps.get(p))))}


def _key_usage(key_id: str, now) -> dict:
    key = _key(key_id)
    used = usage_by(TokenLog.objects.filter(api_key=key), "api_key_id", now).get(key.pk, NO_USAGE)
    return {"periods": _periods(used, lambda p: {}), "caps": key_payload(key)["caps"]}


def _provider_usage(name: str, now) -> dict:
    """As the providers page: the month's spend against the provider's monthly limit."""
    provider = Provider.objects.filter(name=name).first()
    if provider is None:
        raise ApiError(404, "not_found", f"There is no provider named {name!r}.", "provider")
    used = usage_by(TokenLog.objects.filter(provider=provider), "provider_id", now).get(provider.pk, NO_USAGE)
    return {"periods": _periods(used, lambda p: {}), "monthly_limit_micro_usd": provider.monthly_limit_micro_usd}


def _tag_usage(tag: str, now) -> dict:
    """As the tags page: this month's settled spend of the requests carrying the tag, against its cap."""
    quota = TagQuota.objects.filter(tag=tag).first()
    spent = tag_month_spend([tag], now)[tag]
    return {"month_cost_micro_usd": spent, "max_cost_micro_usd": quota.max_cost_micro_usd if quota else None}


_USAGE = {"everyone": _everyone_usage, "user": _user_usage, "team": _team_usage, "feature": _feature_usage,
          "api_key": _key_usage, "provider": _provider_usage, "tag": _tag_usage}


@csrf_exempt
def unknown(request: HttpRequest, rest: str) -> JsonResponse:
    """Any other path under /manage/v1/: a JSON 404 that says where the list is, not Django's HTML page."""
    return error_response(404, "not_found", f"There is no {request.path} in the management API; "
                          "GET /manage/v1/openapi.json lists its paths.")
