"""The Django admin for inference: where staff set the thresholds quantized weights must meet."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from .models import QuantizationEvaluation, QuantizationPolicy


@admin.register(QuantizationPolicy)
class QuantizationPolicyAdmin(admin.ModelAdmin):
    list_display = ["__str__", "max_accuracy_drop_points", "min_throughput_gain_pct", "updated_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not QuantizationPolicy.objects.exists()  # one policy for the whole stack


@admin.register(QuantizationEvaluation)
class QuantizationEvaluationAdmin(admin.ModelAdmin):
    """Read-only: an evaluation is a measurement, changed by nobody."""

    list_display = ["feature", "mode", "created_at", "passed", "checkable", "baseline_correct", "candidate_correct",
                    "agreement", "baseline_tokens_per_s", "candidate_tokens_per_s", "machine"]
    list_filter = ["feature", "mode", "passed", "machine"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
