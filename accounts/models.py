"""Per-user API keys for the OpenAI-compatible HTTP API.

The key itself is shown once, when it is created; only its SHA-256 is stored. A key has 192 bits
of randomness, so a plain hash (no salt, no stretching) is enough, and it lets a request find its
key with one indexed lookup instead of comparing secrets.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

KEY_PREFIX = "ck_"
SHOWN_CHARS = 8  # of the key, kept in the clear so a person can tell their keys apart


KEY_CAP_FIELDS = ("max_requests_per_day", "max_cost_per_day_micro_usd", "max_cost_per_month_micro_usd", "max_in_flight")


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet):
    def unrevoked(self) -> ApiKeyQuerySet:
        return self.filter(revoked_at__isnull=True, user__is_active=True)

    def active(self) -> ApiKeyQuerySet:
        """Keys that work now: not revoked, their user active, not expired."""
        return self.unrevoked().filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))

    def for_plaintext(self, plaintext: str) -> ApiKey | None:
        """The unrevoked key with this text, or None (unknown, revoked, or its user deactivated).

        An expired key is returned: the caller refuses it with a sentence saying when it expired,
        which helps the one person who holds the key and tells nobody else anything.
        """
        # Found by hash: the database never compares the secret itself, so timing tells nothing.
        if not plaintext.startswith(KEY_PREFIX) or len(plaintext) > 200:
            return None
        return self.unrevoked().select_related("user").filter(hashed_key=hash_key(plaintext)).first()


class ApiKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=SHOWN_CHARS)
    hashed_key = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The client's address at last_used_at (behind trusted proxies, the forwarded one): written with
    # it, so at most once a minute, and a use from a second address within that minute is not shown.
    last_used_ip = models.GenericIPAddressField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # None: never
    # The key this one replaced (rotation): the old key then expires after a grace period.
    rotated_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="successors")
    # The features this key may use, by name; empty means all of them. Names, not a relation:
    # accounts sits below budgets, where features live. A renamed feature drops out of the scope, so a
    # narrowed key fails closed until its owner or staff add the new name.
    allowed_features = models.JSONField(default=list, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The key's own caps, below its user's (budgets/guard.py checks both in the same admission). Set by
    # the key's owner, who may only lower them, or by staff (budgets.actions.do_set_key_caps).
    max_requests_per_day = models.PositiveIntegerField(null=True, blank=True)
    max_cost_per_day_micro_usd = models.PositiveBigIntegerField(null=True, blank=True)
    max_cost_per_month_micro_usd = models.PositiveBigIntegerField(null=True, blank=True)
    # Requests sent with this key that may be unanswered at once (admitted, not yet settled).
    max_in_flight = models.PositiveIntegerField(null=True, blank=True)
    # The team that pays for this key's requests, by name (accounts sits below budgets, where teams
    # live): one of its user's teams; empty means the team the user joined first.
    team_name = models.CharField(max_length=64, blank=True, default="")

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["user", "created_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def max_cost_per_day_text(self) -> str:
        return _dollars(self.max_cost_per_day_micro_usd)

    @property
    def max_cost_per_month_text(self) -> str:
        return _dollars(self.max_cost_per_month_micro_usd)

    @property
    def has_caps(self) -> bool:
        return any(getattr(self, name) is not None for name in KEY_CAP_FIELDS)

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired()

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    def allows(self, feature: str) -> bool:
        """Whether this key may use `feature` (an empty scope allows every feature)."""
        return not self.allowed_features or feature in self.allowed_features

    @property
    def scope_text(self) -> str:
        return ", ".join(self.allowed_features) if self.allowed_features else "all features"


def _dollars(micro_usd: int | None) -> str:
    # accounts imports no other app (budgets.money has the full formatter): exact, no trailing zeros.
    if micro_usd is None:
        return ""
    whole, fraction = divmod(micro_usd, 1_000_000)
    return f"${whole:,}.{f'{fraction:06d}'.rstrip('0').ljust(2, '0')}"
