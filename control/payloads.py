"""How the management API shows things: plain JSON, money as integer micro-dollars beside exact dollars,
times as ISO 8601 in UTC. Read-only; the numbers come from budgets.usage, as on the staff pages."""

from __future__ import annotations

from datetime import UTC, datetime

from django.conf import settings

from accounts.models import KEY_CAP_FIELDS, ApiKey
from budgets.actions import QUOTA_FIELDS
from budgets.counters import Usage
from budgets.forms import dollars_text
from budgets.models import Feature, InFlightCap, Provider, Quota, TagQuota, TeamQuota


def when(moment: datetime | None) -> str | None:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z") if moment else None


def caps_payload(caps: dict[str, int | None]) -> dict:
    """{max_requests, max_tokens, max_cost_micro_usd, max_cost_usd}: None is no cap."""
    return {**caps, "max_cost_usd": dollars_text(caps.get("max_cost_micro_usd"))}


def usage_payload(usage: Usage) -> dict:
    return {"requests": usage.requests, "tokens": usage.tokens, "cost_micro_usd": usage.cost_micro_usd,
            "cost_usd": dollars_text(usage.cost_micro_usd)}


def key_payload(key: ApiKey) -> dict:
    caps = {name: getattr(key, name) for name in KEY_CAP_FIELDS}
    return {
        "id": key.pk, "user": key.user.get_username(), "name": key.name, "prefix": key.prefix,
        "created_at": when(key.created_at), "expires_at": when(key.expires_at), "revoked_at": when(key.revoked_at),
        "last_used_at": when(key.last_used_at), "last_used_ip": key.last_used_ip,
        "active": key.is_active and key.user.is_active, "rotated_from": key.rotated_from_id,
        "allowed_features": list(key.allowed_features), "team": getattr(key, "team_name", "") or None, "caps": caps,
    }


def quota_payload(row: Quota | TeamQuota | TagQuota) -> dict:
    if isinstance(row, TagQuota):
        scope = {"scope": "tag", "tag": row.tag, "feature": None, "period": "month"}
        caps = {"max_requests": None, "max_tokens": None, "max_cost_micro_usd": row.max_cost_micro_usd}
    else:
        if isinstance(row, TeamQuota):
            scope = {"scope": "team", "team": row.team.name}
        else:
            scope = {"scope": "user", "user": row.user.get_username()} if row.user_id else {"scope": "default"}
        scope |= {"feature": row.feature.name if row.feature_id else None, "period": row.period}
        caps = {name: getattr(row, name) for name in QUOTA_FIELDS}
    return scope | caps_payload(caps)


def feature_payload(feature: Feature, aliases: list[str], providers: dict[int, Provider]) -> dict:
    provider = feature.provider
    served_model = provider.remote_model if provider and provider.remote_model else settings.CEILING_MODEL_NAME
    return {
        "id": feature.pk, "name": feature.name, "description": feature.description, "enabled": feature.enabled,
        "mode": feature.mode, "provider": provider.name if provider else None, "model": served_model,
        "model_aliases": aliases,
        "backup_providers": [providers[pk].name for pk in feature.backup_providers if pk in providers],
        "fallback": feature.fallback.name if feature.fallback_id else None,
        "variant": feature.quantization, "variant_pinned": feature.quantization_pinned,
        "max_input_tokens": feature.max_input_tokens, "max_output_tokens": feature.max_output_tokens,
        "is_default": feature.is_default,
    }


def provider_payload(provider: Provider) -> dict:
    return {"id": provider.pk, "name": provider.name, "kind": provider.kind, "base_url": provider.base_url,
            "remote_model": provider.remote_model, "monthly_limit_micro_usd": provider.monthly_limit_micro_usd}


def in_flight_payload(row: InFlightCap) -> dict:
    who = {"scope": "user", "user": row.user.get_username()} if row.user_id else {"scope": "default"}
    return who | {"period": "in_flight", "max_in_flight": row.max_in_flight}
