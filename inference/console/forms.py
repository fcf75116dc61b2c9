"""Forms of the staff pages that manage inference things."""

from __future__ import annotations

import re

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model

from budgets.models import Feature
from inference.models import Document, ModelAlias
from inference.retrieval import MAX_DOCUMENT_BYTES, DocumentRejected, document_text

MAX_ITEMS = 1000
MAX_ALIASES = 20
ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}$")  # what OpenAI model ids look like
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


class ModelAliasesForm(forms.Form):
    """The model names that route an API request to one feature: `"model": "<alias>"` selects it."""

    aliases = forms.CharField(
        label="Model aliases", required=False, max_length=2000,
        help_text="Model names API clients may send as \"model\" to reach this feature, separated by commas or "
                  "spaces (e.g. support-bot, gpt-4o-mini). Each name belongs to one feature; empty removes them all.",
    )

    def __init__(self, *args, feature: Feature, **kwargs) -> None:
        self.feature = feature
        kwargs.setdefault("initial", {"aliases": ", ".join(feature.model_aliases.values_list("name", flat=True))})
        super().__init__(*args, **kwargs)

    def clean_aliases(self) -> list[str]:
        # In the order given, each once.
        names = list(dict.fromkeys(n for n in re.split(r"[,\s]+", self.cleaned_data["aliases"]) if n))
        if len(names) > MAX_ALIASES:
            raise forms.ValidationError(f"{len(names)} aliases is too many for one feature; the limit is {MAX_ALIASES}.")
        for name in names:
            if not ALIAS_PATTERN.match(name):
                raise forms.ValidationError(
                    f"{name!r} is not a model name: use letters, digits and . _ : / - (at most 100 characters).")
            if name == settings.CEILING_MODEL_NAME:
                raise forms.ValidationError(
                    f"{name!r} is the served model's own name; it always selects the default feature, \"chat\".")
        taken = ModelAlias.objects.filter(name__in=names).exclude(feature=self.feature).select_related("feature")
        for alias in taken:
            raise forms.ValidationError(f"{alias.name!r} already routes to the feature {alias.feature.name!r}; an alias belongs to one feature.")
        return names


class DocumentUploadForm(forms.Form):
    """One Markdown or text file for a docs feature, and who may read it."""

    file = forms.FileField(
        label="Markdown or text file",
        help_text=f"A .md, .markdown or .txt file in UTF-8, at most {MAX_DOCUMENT_BYTES // 1024:,} KiB. "
                  "A file with the name of an existing document replaces it.",
        error_messages={"required": "Choose a file to upload.", "empty": "The file is empty: there is nothing to answer from."},
    )
    audience = forms.ChoiceField(
        choices=Document.Audience.choices, initial=Document.Audience.EVERYONE,
        help_text="Staff-only documents never reach an end user's prompt; a team's reach only its members' (and staff's).",
    )

    def __init__(self, *args, **kwargs) -> None:
        from budgets.models import Team

        super().__init__(*args, **kwargs)
        teams = [(Document.team_audience(pk), f"the team {name!r} only") for pk, name in Team.objects.values_list("pk", "name")]
        self.fields["audience"].choices = [*Document.Audience.choices, *teams]

    def clean_file(self):
        upload = self.cleaned_data["file"]
        name = upload.name or ""
        if upload.size > MAX_DOCUMENT_BYTES:  # refused before it is read
            raise forms.ValidationError(
                f"{name!r} is {upload.size / 1024:,.0f} KiB; a document may be at most {MAX_DOCUMENT_BYTES // 1024:,} KiB. "
                "Split it into several files."
            )
        try:
            self.cleaned_data["text"] = document_text(name, upload.read(), upload.content_type or "")
        except DocumentRejected as exc:
            raise forms.ValidationError(str(exc)) from exc
        return upload
