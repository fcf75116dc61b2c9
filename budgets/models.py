"""The ledger: features and one TokenLog row for every request, whatever its end."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models


class Feature(models.Model):
    """A product feature that calls the model ("chat", "summary"…); limits and logs hang off it."""

    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(r"^[a-z0-9][a-z0-9_-]*$", "Use lowercase letters, digits, - and _.")],
    )
    description = models.CharField(max_length=200, blank=True)
    enabled = models.BooleanField(default=True)
    max_input_tokens = models.PositiveIntegerField(default=2048, validators=[MinValueValidator(1)])
    max_output_tokens = models.PositiveIntegerField(default=512, validators=[MinValueValidator(1)])
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class TokenLog(models.Model):
    """One row per request: admitted or refused, finished, cancelled or failed.

    Created when the request is admitted (status running) and settled exactly once by the worker;
    settling is a conditional UPDATE on status=running, so a replay changes nothing.
    """

    class Status(models.TextChoices):
        RUNNING = "running"
        OK = "ok"
        CANCELLED = "cancelled"
        FAILED = "failed"
        REFUSED = "refused"

    request_id = models.CharField(max_length=64, unique=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="token_logs")
    feature = models.ForeignKey(Feature, null=True, on_delete=models.PROTECT, related_name="token_logs")
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices)
    finish_reason = models.CharField(max_length=16, blank=True)
    refusal_code = models.CharField(max_length=64, blank=True)
    error = models.CharField(max_length=500, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    max_tokens = models.PositiveIntegerField(default=0)
    cost_micro_usd = models.BigIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["feature", "created_at"]),
            models.Index(fields=["user", "created_at"]),
            models.Index(fields=["status", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"

    @property
    def cost_usd(self) -> str:
        return f"{self.cost_micro_usd / 1_000_000:.6f}"

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
