"""Writes on accounts: creating, rotating and revoking API keys, and recording their use."""

from __future__ import annotations

import ipaddress
import secrets
from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q
from django.utils import timezone

from .models import KEY_CAP_FIELDS, KEY_PREFIX, SHOWN_CHARS, ApiKey, hash_key

LAST_USED_RESOLUTION = timedelta(minutes=1)
MAX_LIFETIME_DAYS = 3650  # a form's or a command's "expires in N days"; beyond that, leave it empty


def do_create_api_key(user: AbstractBaseUser, name: str, *, expires_at: datetime | None = None,
                      **inherited) -> tuple[ApiKey, str]:
    """A new key for `user`: (the stored row, the plaintext, which is never stored or shown again).

    `inherited` are the fields a rotated key carries over (its caps, scope and predecessor).
    """
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        user=user,
        name=name,
        prefix=plaintext[:SHOWN_CHARS],
        hashed_key=hash_key(plaintext),
        created_at=timezone.now(),
        expires_at=expires_at,
        **inherited,
    )
    return key, plaintext


def create_successor(key: ApiKey, now: datetime) -> tuple[ApiKey, str]:
    """A new key in `key`'s place: same user, name, caps and features, and the same lifetime length
    from now if the old one had one (a key under a 90-day policy stays under it). Call inside the
    rotation's transaction (budgets.actions.do_rotate_api_key, which audits it)."""
    lifetime = key.expires_at - key.created_at if key.expires_at is not None else None
    inherited = {name: getattr(key, name) for name in KEY_CAP_FIELDS}
    return do_create_api_key(key.user, key.name, expires_at=now + lifetime if lifetime else None,
                             allowed_features=list(key.allowed_features), team_name=key.team_name, rotated_from=key,
                             **inherited)


def do_revoke_api_key(key: ApiKey) -> bool:
    """Revoke a key at once; False if it was already revoked (a claim, not read-modify-write)."""
    now = timezone.now()
    revoked = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now)
    if revoked:
        key.revoked_at = now
    return bool(revoked)


def do_touch_api_key(key: ApiKey, address: str | None = None) -> None:
    """Record that a key was used, and from where; at most once a minute per key, so busy keys are
    not a hot row (the address is written with the time, never on its own)."""
    now = timezone.now()
    if key.last_used_at is not None and key.last_used_at >= now - LAST_USED_RESOLUTION:
        return  # recorded within the minute, as the row read to authenticate says: no UPDATE
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    ApiKey.objects.filter(stale, pk=key.pk).update(last_used_at=now, last_used_ip=_ip_or_none(address))


def _ip_or_none(address: str | None) -> str | None:
    # REMOTE_ADDR is whatever the server put there (empty, or a unix socket's path): keep only an IP.
    try:
        return str(ipaddress.ip_address(address)) if address else None
    except ValueError:
        return None
