from datetime import datetime, timedelta

from django import forms
from django.utils import timezone

from .actions import MAX_LIFETIME_DAYS


class ApiKeyForm(forms.Form):
    name = forms.CharField(
        max_length=100,
        help_text="What the key is for, e.g. “notebook” or “nightly job”.",
    )
    expires_in_days = forms.IntegerField(
        label="Expires in (days)", required=False, min_value=1, max_value=MAX_LIFETIME_DAYS,
        help_text="Empty: the key works until you revoke it.",
    )

    def expires_at(self) -> datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + timedelta(days=days) if days else None
