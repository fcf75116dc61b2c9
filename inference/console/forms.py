"""Forms of the staff pages that manage inference things."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model

from budgets.models import Feature

MAX_ITEMS = 1000
MAX_INPUT_CHARS = 20_000


class BatchForm(forms.Form):
    feature = forms.ModelChoiceField(
        queryset=Feature.objects.filter(mode=Feature.Mode.BATCH, enabled=True).order_by("name"),
        empty_label=None,
        help_text="Enabled features whose mode is batch.",
        error_messages={
            "required": "Choose a feature.",
            "invalid_choice": "Choose one of the listed features: only enabled features in batch mode run jobs.",
        },
    )
    username = forms.CharField(label="Run as (username)", max_length=150, help_text="The job counts against this user's caps.")
    max_tokens = forms.IntegerField(
        label="Max tokens per answer", min_value=1, max_value=settings.CEILING_MAX_TOKENS_LIMIT, initial=128
    )
    inputs = forms.CharField(
        label="Inputs, one per line",
        widget=forms.Textarea(attrs={"rows": 8}),
        error_messages={"required": "Give at least one input, one per line."},
    )

    def clean_username(self):
        name = self.cleaned_data["username"].strip()
        user = get_user_model().objects.filter(username=name, is_active=True).first()
        if user is None:
            raise forms.ValidationError(f"There is no active user named {name!r}.")
        return user

    def clean_inputs(self) -> list[str]:
        lines = [line.strip() for line in self.cleaned_data["inputs"].splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise forms.ValidationError("Give at least one input, one per line (blank lines are skipped).")
        if len(lines) > MAX_ITEMS:
            raise forms.ValidationError(f"{len(lines):,} inputs is too many for one job; the limit is {MAX_ITEMS:,}.")
        for number, line in enumerate(lines, start=1):
            if len(line) > MAX_INPUT_CHARS:
                raise forms.ValidationError(f"Input {number} is longer than {MAX_INPUT_CHARS:,} characters.")
        return lines
