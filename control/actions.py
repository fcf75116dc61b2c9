"""Writes of the management API that the staff pages have no audited action for: staff tokens, and
staff creating or revoking another person's API key.

Everything else the API changes goes through the very functions the staff pages call (budgets.actions,
inference.actions), so the audit trail reads the same whichever way a change came. Here, the rows are
written as those functions write theirs (one AuditEntry per field, in the change's transaction).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from accounts.actions import do_create_api_key, do_revoke_api_key
from accounts.models import SHOWN_CHARS, ApiKey, hash_key
from budgets.actions import api_key_target, audit_text
from budgets.models import AuditEntry

from .models import TOKEN_PREFIX, StaffToken

LAST_USED_RESOLUTION = timedelta(minutes=1)


def _audit(actor: AbstractBaseUser | None, action: str, target: str, changes: dict[str, tuple[str, str]]) -> list[AuditEntry]:
    return AuditEntry.objects.bulk_create(
        AuditEntry(actor=actor, action=action, target=target, field=name, before=before, after=after)
        for name, (before, after) in changes.items()
    )


# --- staff tokens --------------------------------------------------------------------------------


def do_create_staff_token(actor: AbstractBaseUser | None, user: AbstractBaseUser, name: str) -> tuple[StaffToken, str]:
    """A new token for the staff user `user`: (the row, the plaintext, never stored or shown again). Audited."""
    plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        token = StaffToken.objects.create(user=user, name=name, prefix=plaintext[:SHOWN_CHARS],
                                          hashed_key=hash_key(plaintext), created_at=timezone.now())
        _audit(actor, "create", token.audit_target, {"name": ("", name), "prefix": ("", f"{token.prefix}…")})
    return token, plaintext


def do_revoke_staff_token(actor: AbstractBaseUser | None, token: StaffToken) -> bool:
    """Revoke a token at once; False when it was revoked already (a claim: two revocations write one row)."""
    now = timezone.now()
    with transaction.atomic():
        if not StaffToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
            return False
        token.revoked_at = now
        _audit(actor, "update", token.audit_target, {"revoked_at": ("", audit_text("revoked_at", now))})
    return True


def do_touch_staff_token(token: StaffToken) -> None:
    """Record a token's use, at most once a minute (a busy script does not make its row hot)."""
    now = timezone.now()
    if token.last_used_at is not None and token.last_used_at >= now - LAST_USED_RESOLUTION:
        return
    StaffToken.objects.filter(pk=token.pk).update(last_used_at=now)


# --- API keys, for any user ----------------------------------------------------------------------


def do_create_api_key_for(actor: AbstractBaseUser, user: AbstractBaseUser, name: str,
                          expires_at: datetime | None) -> tuple[ApiKey, str]:
    """A key for `user` made by staff (accounts' own create, as the keys page and create_api_key), audited:
    a key made on someone's behalf is a change to what they can spend."""
    with transaction.atomic():
        key, plaintext = do_create_api_key(user, name, expires_at=expires_at)
        _audit(actor, "create", api_key_target(key), {
            "prefix": ("", f"{key.prefix}…"), "expires_at": ("", audit_text("expires_at", expires_at)),
        })
    return key, plaintext


def do_revoke_api_key_for(actor: AbstractBaseUser, key: ApiKey) -> bool:
    """Revoke anyone's key (accounts' own claim, as the keys page), audited; False when revoked already."""
    with transaction.atomic():
        if not do_revoke_api_key(key):
            return False
        _audit(actor, "update", api_key_target(key), {"revoked_at": ("", audit_text("revoked_at", key.revoked_at))})
    return True
