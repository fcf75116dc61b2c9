"""The Django admin for budgets: a fallback for staff; the dashboard is the everyday tool."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from .models import Alert, Feature, ModelPrice, Provider, Quota, TokenLog


@admin.register(Provider)
class ProviderAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "monthly_limit_micro_usd", "alert_thresholds", "alert_recipients"]
    search_fields = ["name"]


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = [
        "provider",
        "model",
        "input_per_million_micro_usd",
        "output_per_million_micro_usd",
        "cached_input_per_million_micro_usd",
        "effective_from",
    ]
    list_filter = ["provider"]
    search_fields = ["model"]


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["__str__", "period", "max_requests", "max_tokens", "max_cost_micro_usd"]
    list_filter = ["period", "feature"]
    list_select_related = ["user", "feature"]


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = [
        "kind", "scope", "threshold", "period_key", "spent_micro_usd", "limit_micro_usd", "created_at", "sent_at", "error"
    ]
    list_filter = ["kind", "period_key", "threshold"]
    search_fields = ["scope"]
    # The outbox's bookkeeping belongs to the email task; staff may read it, or clear an error.
    readonly_fields = [
        "kind", "scope", "threshold", "period_key", "spent_micro_usd", "limit_micro_usd", "projected_at", "period_end",
        "created_at", "claimed_at", "sent_at",
    ]


@admin.register(Feature)
class FeatureAdmin(admin.ModelAdmin):
    list_display = ["name", "enabled", "provider", "max_input_tokens", "max_output_tokens", "created_at"]
    list_filter = ["enabled"]
    search_fields = ["name"]
    # Switched on the feature's dashboard page only, where a passing evaluation is required.
    readonly_fields = ["quantization"]


@admin.register(TokenLog)
class TokenLogAdmin(admin.ModelAdmin):
    """The ledger is written by the guard and the workers only: here it can be read, not changed."""

    list_display = [
        "request_id",
        "created_at",
        "user",
        "feature",
        "provider",
        "model",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "cost_micro_usd",
    ]
    list_filter = ["status", "feature"]
    list_select_related = ["user", "feature", "provider"]
    search_fields = ["request_id", "user__username", "loop_id"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: TokenLog | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TokenLog | None = None) -> bool:
        return False
