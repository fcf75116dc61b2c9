"""Staff API tokens: what a script or an infrastructure tool sends to the management API (/manage/v1/).

Like a user's API key (accounts/models.py), a token is shown once and only its SHA-256 is stored:
it has 192 bits of randomness, so a plain hash is enough and a request finds its token with one
indexed lookup. A token carries no rights of its own: it acts as its owner, and only while the owner
is an active staff user, checked at every request (a deactivated or de-staffed owner's token stops
working at once, with no revocation to remember).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from accounts.models import SHOWN_CHARS, hash_key

TOKEN_PREFIX = "cst_"  # not "ck_": a /v1 key sent here (or a token sent to /v1) is told apart at once
MAX_TOKEN_CHARS = 200


class StaffTokenQuerySet(models.QuerySet):
    def for_plaintext(self, plaintext: str) -> StaffToken | None:
        """The unrevoked token with this text (its owner selected, whatever their state), or None."""
        if not plaintext.startswith(TOKEN_PREFIX) or len(plaintext) > MAX_TOKEN_CHARS:
            return None
        return self.filter(revoked_at__isnull=True, hashed_key=hash_key(plaintext)).select_related("user").first()


class StaffToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="staff_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=SHOWN_CHARS)  # kept in the clear so a person can tell tokens apart
    hashed_key = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = StaffTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def audit_target(self) -> str:
        return f"staff token {self.pk} ({self.user.get_username()}/{self.name})"
