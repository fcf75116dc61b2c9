"""The OpenAPI 3.1 description of the management API, served at GET /manage/v1/openapi.json.

Kept beside control/views.py, which it describes; tests/test_manage_api.py checks that every path the
URLconf serves is in it and that it names every operation's refusals.
"""

from __future__ import annotations

from budgets.models import Period

JSON = "application/json"
NULLABLE_INT = {"type": ["integer", "null"], "minimum": 0}
DOLLARS = {"type": ["string", "number", "null"], "description": "dollars, at most six decimals (e.g. \"1.50\"); null: no cap"}
ERRORS = {"400": "BadRequest", "401": "Unauthorized", "403": "NotStaff", "404": "NotFound", "405": "MethodNotAllowed",
          "409": "Conflict", "413": "TooLarge"}


def openapi_document() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Ceiling management API",
            "version": "1",
            "description": "What staff do on the staff pages, for scripts: API keys, quotas and windows, features' "
            "routing, usage and spend. Authenticated with a staff token (cst_…); every change is audited "
            "as on the pages (/staff/audit/).",
        },
        "servers": [{"url": "/"}],
        "security": [{"staffToken": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {"staffToken": {"type": "http", "scheme": "bearer",
                                               "description": "a staff token from /staff/tokens/ or `manage.py create_staff_token`"}},
            "schemas": _schemas(),
            "responses": {name: _error(name) for name in ERRORS.values()},
        },
    }


def _op(operation_id: str, summary: str, ok: str, *, status: str = "200", body: str | None = None,
        refusals: tuple[str, ...] = ("400", "404", "409"), parameters: list | None = None) -> dict:
    operation = {
        "operationId": operation_id,
        "summary": summary,
        "responses": {status: {"description": "done", "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{ok}"}}}},
                      **{code: {"$ref": f"#/components/responses/{ERRORS[code]}"} for code in ("401", "403", "405", *refusals)}},
    }
    if body:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{body}"}}}}
        operation["responses"]["413"] = {"$ref": "#/components/responses/TooLarge"}
    if parameters:
        operation["parameters"] = parameters
    return operation


def _path_param(name: str, kind: str = "integer") -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": kind}}


def _query(name: str, description: str, kind: str = "string") -> dict:
    return {"name": name, "in": "query", "required": False, "schema": {"type": kind}, "description": description}


def _paths() -> dict:
    key_id = [_path_param("key_id")]
    return {
        "/manage/v1/keys": {
            "get": _op("listKeys", "every API key, newest first (at most 1,000)", "KeyList", refusals=("404",),
                       parameters=[_query("user", "only this user's keys"), _query("active", "true: only working keys")]),
            "post": _op("createKey", "a key for any active user; the key is in the answer this once", "NewKey",
                        status="201", body="KeyCreate"),
        },
        "/manage/v1/keys/{key_id}": {"get": _op("getKey", "one key", "Key", refusals=("404",), parameters=key_id)},
        "/manage/v1/keys/{key_id}/revoke": {
            "post": _op("revokeKey", "revoke at once (409 when revoked already)", "Key", parameters=key_id)},
        "/manage/v1/keys/{key_id}/rotate": {
            "post": _op("rotateKey", "a successor with the same name, caps and features; the old key works grace_hours more",
                        "RotatedKey", status="201", body="KeyRotate", parameters=key_id)},
        "/manage/v1/keys/{key_id}/caps": {
            "patch": _op("setKeyCaps", "the key's own caps and features (fields left out are kept)", "KeyChange",
                         body="KeyCaps", parameters=key_id)},
        "/manage/v1/quotas": {
            "get": _op("listQuotas", "every cap row: users, the default, teams, tags, capped keys", "QuotaList", refusals=()),
            "put": _op("setQuota", "replace one scope's caps for one period (a cap left out or null: none)", "Changes",
                       body="QuotaSet"),
            "delete": _op("deleteQuota", "remove one scope's row (a user then follows the default)", "Changes",
                          body="QuotaScope"),
        },
        "/manage/v1/in-flight": {
            "get": _op("listInFlightCaps", "the caps on requests in flight at once: users' and the default", "InFlightList",
                       refusals=()),
            "put": _op("setInFlightCap", "a user's (or, with no user, everyone's default) cap on requests in flight at once; "
                       "null removes it", "Changes", body="InFlightSet"),
        },
        "/manage/v1/features": {"get": _op("listFeatures", "every feature and how it is served", "FeatureList", refusals=())},
        "/manage/v1/features/{name}": {
            "get": _op("getFeature", "one feature", "Feature", refusals=("404",), parameters=[_path_param("name", "string")]),
            "patch": _op("routeFeature", "change how a feature is served, all or nothing", "FeatureChange", body="Routing",
                         parameters=[_path_param("name", "string")]),
        },
        "/manage/v1/providers": {"get": _op("listProviders", "every provider", "ProviderList", refusals=())},
        "/manage/v1/usage": {
            "get": _op("getUsage", "settled usage of one scope this minute, hour, day and month, against its caps",
                       "Usage", refusals=("400", "404"), parameters=[
                           {"name": "scope", "in": "query", "required": True,
                            "schema": {"enum": ["everyone", "user", "team", "feature", "api_key", "provider", "tag"]}},
                           *(_query(name, f"the {name} (with scope={name})") for name in
                             ("user", "team", "feature", "api_key", "provider", "tag")),
                       ])},
    }


def _obj(properties: dict, required: tuple[str, ...] = (), extra: bool = True) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": extra}
    if required:
        schema["required"] = list(required)
    return schema


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _schemas() -> dict:
    periods = {"enum": list(Period.values)}
    caps = {"max_requests": NULLABLE_INT, "max_tokens": NULLABLE_INT, "max_cost_usd": DOLLARS}
    key = _obj({
        "id": {"type": "integer"}, "user": {"type": "string"}, "name": {"type": "string"}, "prefix": {"type": "string"},
        "created_at": {"type": "string"}, "expires_at": {"type": ["string", "null"]}, "revoked_at": {"type": ["string", "null"]},
        "last_used_at": {"type": ["string", "null"]}, "last_used_ip": {"type": ["string", "null"]},
        "active": {"type": "boolean"}, "rotated_from": {"type": ["integer", "null"]},
        "allowed_features": {"type": "array", "items": {"type": "string"}}, "caps": {"type": "object"},
    }, ("id", "user", "name", "prefix", "active"))
    usage = _obj({"requests": {"type": "integer"}, "tokens": {"type": "integer"}, "cost_micro_usd": {"type": "integer"},
                  "cost_usd": {"type": ["string", "null"]}, "caps": {"type": "object"}})
    return {
        "Key": key,
        "KeyList": _obj({"keys": {"type": "array", "items": _ref("Key")}}, ("keys",)),
        "NewKey": {"allOf": [key, _obj({"key": {"type": "string", "description": "ck_…, shown only this once"}}, ("key",))]},
        "RotatedKey": _obj({"new": _ref("NewKey"), "old": _ref("Key")}, ("new", "old")),
        "KeyCreate": _obj({"user": {"type": "string"}, "name": {"type": "string", "maxLength": 100},
                           "expires_in_days": {"type": ["integer", "null"], "minimum": 1}}, ("user", "name"), extra=False),
        "KeyRotate": _obj({"grace_hours": {"type": "integer", "minimum": 0, "default": 24}}, extra=False),
        "KeyCaps": _obj({"max_requests_per_day": NULLABLE_INT, "max_cost_per_day_usd": DOLLARS,
                         "max_cost_per_month_usd": DOLLARS,
                         "allowed_features": {"type": "array", "items": {"type": "string"}}}),
        "KeyChange": _obj({"changes": {"type": "integer"}, "key": _ref("Key")}, ("changes", "key")),
        "QuotaScope": _obj({
            "scope": {"enum": ["user", "default", "team", "api_key", "tag"]}, "period": periods,
            "user": {"type": "string"}, "team": {"type": "string"}, "key": {"type": "integer"}, "tag": {"type": "string"},
            "feature": {"type": ["string", "null"], "description": "one feature's cap; null or left out: all features"},
        }, ("scope", "period")),
        "QuotaSet": {"allOf": [_ref("QuotaScope"), _obj(caps)]},
        "Quota": _obj({"scope": {"type": "string"}, "period": {"type": "string"}, **caps,
                       "max_cost_micro_usd": NULLABLE_INT}),
        "QuotaList": _obj({"quotas": {"type": "array", "items": _ref("Quota")}}, ("quotas",)),
        "InFlightSet": _obj({"user": {"type": ["string", "null"], "description": "null or left out: the default"},
                             "max_in_flight": {"type": ["integer", "null"], "minimum": 1}}, extra=False),
        "InFlightList": _obj({"in_flight": {"type": "array", "items": {"type": "object"}}}, ("in_flight",)),
        "Changes": _obj({"changes": {"type": "integer", "description": "audit rows written (0: nothing changed)"}}, ("changes",)),
        "Feature": _obj({
            "name": {"type": "string"}, "enabled": {"type": "boolean"}, "provider": {"type": ["string", "null"]},
            "model": {"type": "string"}, "model_aliases": {"type": "array", "items": {"type": "string"}},
            "backup_providers": {"type": "array", "items": {"type": "string"}}, "fallback": {"type": ["string", "null"]},
            "variant": {"enum": ["none", "int8", "q4", "bf16"]},
        }, ("name", "enabled")),
        "FeatureList": _obj({"features": {"type": "array", "items": _ref("Feature")}}, ("features",)),
        "FeatureChange": _obj({"changes": {"type": "integer"}, "feature": _ref("Feature")}, ("changes", "feature")),
        "Routing": _obj({
            "enabled": {"type": "boolean"},
            "provider": {"type": ["string", "null"], "description": "a provider's name; null: the default (local)"},
            "backup_providers": {"type": "array", "items": {"type": "string"}},
            "fallback": {"type": ["string", "null"]},
            "variant": {"enum": ["none", "int8", "q4", "bf16"], "description": "refused (409) unless its evaluation passed"},
            "model_aliases": {"type": "array", "items": {"type": "string"}},
        }, extra=False),
        "ProviderList": _obj({"providers": {"type": "array", "items": {"type": "object"}}}, ("providers",)),
        "Usage": _obj({"scope": {"type": "string"}, "name": {"type": ["string", "null"]},
                       "periods": _obj({period: usage for period in Period.values}),
                       "features": {"type": "object"}}, ("scope",)),
        "Error": _obj({"error": _obj({"code": {"type": "string"}, "message": {"type": "string"},
                                      "field": {"type": ["string", "null"]}}, ("code", "message", "field"))}, ("error",)),
    }


def _error(name: str) -> dict:
    descriptions = {
        "BadRequest": "a body or parameter that is not valid; `field` names it",
        "Unauthorized": "no staff token, or one that is unknown, revoked, or whose owner is deactivated",
        "NotStaff": "the token's owner is no longer staff",
        "NotFound": "no such key, user, team, feature or provider",
        "MethodNotAllowed": "the path does not take this method (see Allow)",
        "Conflict": "the change conflicts with the current state (revoked already, not rotatable, a variant not evaluated)",
        "TooLarge": "the body is over CEILING_MAX_FRAME_BYTES",
    }
    return {"description": descriptions[name], "content": {JSON: {"schema": _ref("Error")}}}
