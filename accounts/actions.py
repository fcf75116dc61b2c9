"""Writes on accounts: creating and revoking API keys."""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q
from django.utils import timezone

from .models import KEY_PREFIX, SHOWN_CHARS, ApiKey, hash_key

LAST_USED_RESOLUTION = timedelta(minutes=1)


def do_create_api_key(user: AbstractBaseUser, name: str) -> tuple[ApiKey, str]:
    """A new key for `user`: (the stored row, the plaintext, which is never stored or shown again)."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        user=user,
        name=name,
        prefix=plaintext[:SHOWN_CHARS],
        hashed_key=hash_key(plaintext),
        created_at=timezone.now(),
    )
    return key, plaintext


def do_revoke_api_key(key: ApiKey) -> bool:
    """Revoke a key at once; False if it was already revoked (a claim, not read-modify-write)."""
    now = timezone.now()
    revoked = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now)
    if revoked:
        key.revoked_at = now
    return bool(revoked)


def do_touch_api_key(key: ApiKey) -> None:
    """Record that a key was used; at most once a minute per key, so busy keys are not a hot row."""
    now = timezone.now()
    if key.last_used_at is not None and key.last_used_at >= now - LAST_USED_RESOLUTION:
        return  # recorded within the minute, as the row read to authenticate says: no UPDATE
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    ApiKey.objects.filter(stale, pk=key.pk).update(last_used_at=now)
