"""The staff dashboard's forms: caps, features, providers and prices, typed in people's units;
and the query forms of the cost model and the token log browser.

Money is typed in dollars (at most six decimals, so the conversion is exact) and kept as integer
micro-dollars; alert thresholds are typed as "50, 80, 100". A form that is not valid changes nothing.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator, validate_email
from django.db.models import QuerySet
from django.utils import timezone

from . import costmodel, outbound, vault
from .actions import QUOTA_FIELDS
from .models import (
    API_KEY_ENV_PREFIX,
    AlertWebhook,
    Feature,
    ModelPrice,
    Period,
    Provider,
    Quota,
    Team,
    TokenLog,
    allowed_key_env,
    tag_validator,
    team_names_of,
)
from .money import format_usd, parse_usd
from .periods import local_zone
from .tags import normalise_tag, tag_filter
from .usage import caps_of

MAX_USD = Decimal("1000000000")  # far beyond any real cap, far below the bigint column
MAX_REQUESTS = 2_147_483_647  # Quota.max_requests is a PositiveIntegerField
MAX_TOKENS = 10**15  # counters are Lua numbers (doubles): stay well inside 2**53
NOT_NEGATIVE = {"min_value": "A cap cannot be negative."}
KNOWN_MODELS_SHOWN = 8  # in the "unknown model" error; a catalog provider can price hundreds


def to_micro_usd(dollars: Decimal | None) -> int | None:
    # DollarsField has already refused what parse_usd refuses (negative, over six decimals) with
    # the form's own messages, so this only converts; it is still the one parser of dollars.
    return None if dollars is None else parse_usd(dollars)


def dollars_text(micro_usd: int | None) -> str | None:
    """"1.5", "10", "0.000123": what a dollar box shows for a stored amount."""
    if micro_usd is None:
        return None
    return f"{Decimal(micro_usd) / 1_000_000:.6f}".rstrip("0").rstrip(".")


class DollarsField(forms.DecimalField):
    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("max_digits", 16)
        kwargs.setdefault("decimal_places", 6)
        kwargs.setdefault("min_value", Decimal(0))
        kwargs.setdefault("max_value", MAX_USD)
        kwargs.setdefault("error_messages", {"min_value": "An amount in dollars cannot be negative."})
        super().__init__(**kwargs)


# --- caps ----------------------------------------------------------------------------------------


def describe_caps(caps: dict[str, int | None]) -> str:
    """'100 requests · no token cap · $1.00' — for the Default column."""
    requests, tokens, cost = (caps[name] for name in QUOTA_FIELDS)
    if requests is None and tokens is None and cost is None:
        return "no caps"
    parts = [
        f"{requests:,} requests" if requests is not None else "no request cap",
        f"{tokens:,} tokens" if tokens is not None else "no token cap",
        format_usd(cost) if cost is not None else "no cost cap",
    ]
    return " · ".join(parts)


class CapsForm(forms.Form):
    """The caps of one scope (a feature or all features) for one period; an empty box means no cap."""

    max_requests = forms.IntegerField(
        label="Requests", required=False, min_value=0, max_value=MAX_REQUESTS, error_messages=NOT_NEGATIVE
    )
    max_tokens = forms.IntegerField(
        label="Tokens", required=False, min_value=0, max_value=MAX_TOKENS, error_messages=NOT_NEGATIVE
    )
    max_cost_usd = DollarsField(label="Cost ($)", required=False, error_messages=NOT_NEGATIVE)

    number_fields = ("max_requests", "max_tokens", "max_cost_usd")

    def __init__(self, *args, feature: Feature | None, period: str, current: Quota | None, **kwargs) -> None:
        kwargs.setdefault("initial", self.initial_from(current))
        super().__init__(*args, **kwargs)
        self.feature, self.period = feature, period
        scope = feature.name if feature else "all features"
        for name in self.number_fields:
            label = f"{self.fields[name].label} per {period}, {scope}"  # the table has no <label>s
            self.fields[name].widget.attrs.update({"class": "cap-input", "placeholder": "no cap", "aria-label": label})
        self.fields["max_cost_usd"].widget.attrs["step"] = "any"

    @staticmethod
    def initial_from(quota: Quota | None) -> dict:
        caps = caps_of(quota)
        return {
            "max_requests": caps["max_requests"],
            "max_tokens": caps["max_tokens"],
            "max_cost_usd": dollars_text(caps["max_cost_micro_usd"]),
        }

    def entered_caps(self) -> dict[str, int | None]:
        return {
            "max_requests": self.cleaned_data.get("max_requests"),
            "max_tokens": self.cleaned_data.get("max_tokens"),
            "max_cost_micro_usd": to_micro_usd(self.cleaned_data.get("max_cost_usd")),
        }

    def caps(self) -> dict[str, int | None] | None:
        """What to store for this scope; None: remove its row."""
        return self.entered_caps()


class UserCapsForm(CapsForm):
    """A user's caps for one scope: follow the default, or their own caps, which replace it."""

    source = forms.ChoiceField(
        label="Caps", choices=[("default", "Default"), ("own", "Own")], widget=forms.Select(attrs={"class": "source"})
    )

    def __init__(self, *args, current: Quota | None, default: Quota | None, **kwargs) -> None:
        # With no row of their own, the boxes show the default: switching to "Own" starts from it.
        initial = {**self.initial_from(current or default), "source": "own" if current else "default"}
        super().__init__(*args, current=current, initial=initial, **kwargs)
        scope = self.feature.name if self.feature else "all features"
        self.fields["source"].widget.attrs["aria-label"] = f"Caps per {self.period}, {scope}"
        self.default_caps = caps_of(default)
        self.is_own = current is not None

    def clean(self) -> dict:
        cleaned = super().clean()
        typed = any(name in self.changed_data for name in self.number_fields)
        complete = all(name in cleaned for name in self.number_fields)  # else a field error says it already
        if cleaned.get("source") == "default" and typed and complete and self.entered_caps() != self.default_caps:
            # Saving would silently drop what was typed: say so instead.
            raise ValidationError("These numbers are not the default's: choose “Own” to keep them, or put the default back.")
        return cleaned

    def caps(self) -> dict[str, int | None] | None:
        return None if self.cleaned_data["source"] == "default" else self.entered_caps()


def caps_forms(
    data, *, user, features: list[Feature], quotas: list[Quota]
) -> list[CapsForm]:
    """One form per scope: all features, then each feature; each per day and per month.

    `quotas` are the default rows and (when `user` is given) that user's rows; no queries here.
    """
    rows = {(q.user_id is not None, q.feature_id, q.period): q for q in quotas}
    forms_ = []
    for feature in [None, *features]:
        for period in Period.values:
            feature_id = feature.pk if feature else None
            prefix = f"{feature_id or 'all'}-{period}"
            default = rows.get((False, feature_id, period))
            if user is None:
                form = CapsForm(data, prefix=prefix, feature=feature, period=period, current=default)
            else:
                own = rows.get((True, feature_id, period))
                form = UserCapsForm(data, prefix=prefix, feature=feature, period=period, current=own, default=default)
            forms_.append(form)
    return forms_


# --- features ------------------------------------------------------------------------------------


class InFlightForm(forms.Form):
    """How many requests a user (or everyone, on the defaults page) may have in flight at once."""

    max_in_flight = forms.IntegerField(
        label="Requests in flight at once", required=False, min_value=1, max_value=MAX_REQUESTS,
        error_messages={"min_value": "At least 1 (to stop someone, deactivate them or cap their requests at 0)."},
    )

    def __init__(self, *args, current: int | None, default: int | None = None, for_user: bool, **kwargs) -> None:
        kwargs.setdefault("initial", {"max_in_flight": current})
        super().__init__(*args, prefix="inflight", **kwargs)
        field = self.fields["max_in_flight"]
        if for_user:
            field.widget.attrs["placeholder"] = f"default ({default})" if default is not None else "default (no cap)"
            field.help_text = ("Answers in progress at the same time, whatever the period's caps; "
                               "the next one is refused with Retry-After: 1. Empty: the default.")
        else:
            field.widget.attrs["placeholder"] = "no cap"
            field.help_text = "For everyone without their own. Empty: no cap."

    def value(self) -> int | None:
        return self.cleaned_data.get("max_in_flight")


class FeatureForm(forms.ModelForm):
    class Meta:
        model = Feature
        fields = [
            "name", "description", "enabled", "mode", "max_input_tokens", "max_output_tokens", "provider",
            "backup_providers", "fallback", "cache_ttl_s", "semantic_threshold", "cache_shared", "quantization_pinned",
            "temperature", "top_p", "frequency_penalty", "presence_penalty", "is_default",
        ]
        labels = {"cache_ttl_s": "Answer cache TTL (seconds)", "semantic_threshold": "Semantic cache threshold",
                  "cache_shared": "Share cached answers across users",
                  "quantization_pinned": "Pin its model weights", "is_default": "Default on the chat page"}
        help_texts = {
            "name": "What clients send as \"feature\": lowercase letters, digits, - and _. Renaming breaks clients that use the old name.",
            "max_input_tokens": "Longer prompts are refused.",
            "max_output_tokens": "The most tokens one answer may have.",
            "cache_ttl_s": "0 turns the answer caches off. Only complete, greedy answers are reused, and a hit counts against no cap.",
            "semantic_threshold": "Empty: exact matches only. Otherwise a similar last question in exactly the same "
                                  "conversation (system prompt, earlier turns, passages, parameters) reuses an answer.",
            "cache_shared": "Off (the default): a user only ever gets their own cached answers. On: anyone who sends the "
                            "same conversation (or, with a threshold, a similar last question after it) gets the answer "
                            "someone else got. Only for features whose prompts hold no personal data.",
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["provider"].queryset = Provider.objects.order_by("name")
        self.fields["provider"].empty_label = "the default provider (local)"
        # Provider names in order, as staff type them; stored as ids (a rename keeps the list).
        self.fields["backup_providers"] = forms.CharField(
            required=False, label="Backup providers",
            help_text="Remote providers' names, comma-separated, tried in this order when the feature's own provider "
                      "answers 429 or 5xx, cannot be reached or sends no first token, before any text reached the user. "
                      "A backup dearer than the feature's provider (in or out), or with a monthly spend limit, is passed over.",
        )
        names = Provider.objects.in_bulk([pk for pk in self.instance.backup_providers or [] if isinstance(pk, int)])
        self.initial["backup_providers"] = ", ".join(names[pk].name for pk in self.instance.backup_providers or [] if pk in names)
        fallback = self.fields["fallback"]
        fallback.queryset = Feature.objects.exclude(pk=self.instance.pk).order_by("name")
        fallback.empty_label = "none: refuse when a cost cap is reached"
        fallback.error_messages["invalid_choice"] = "Choose one of the listed features; a feature is never its own fallback."
        for name in Feature.PLAIN_GENERATION:  # left empty (or by an older client): plain greedy decoding
            self.fields[name].required = False

    def clean(self) -> dict:
        cleaned = super().clean()
        for name, plain in Feature.PLAIN_GENERATION.items():
            if name in cleaned and cleaned[name] is None:
                cleaned[name] = plain
        return cleaned

    def clean_backup_providers(self) -> list[int]:
        names = [name.strip() for name in (self.cleaned_data.get("backup_providers") or "").split(",") if name.strip()]
        found = {provider.name: provider for provider in Provider.objects.filter(name__in=names)}
        own = self.cleaned_data.get("provider")
        ids: list[int] = []
        for name in names:
            provider = found.get(name)
            if provider is None:
                raise forms.ValidationError(f"There is no provider named {name!r}.")
            if provider.kind != Provider.Kind.OPENAI_COMPATIBLE:
                raise forms.ValidationError(f"{name!r} is not a remote provider; only remote providers can be backups.")
            if own is not None and provider.pk == own.pk:
                raise forms.ValidationError(f"{name!r} is the feature's own provider; a backup is another one.")
            if provider.pk in ids:
                raise forms.ValidationError(f"{name!r} is listed twice.")
            ids.append(provider.pk)
        return ids

    def clean_is_default(self) -> bool:
        """One default at a time: staff untick the current one first, so no change happens unseen."""
        marked = self.cleaned_data.get("is_default")
        if marked:
            other = Feature.objects.filter(is_default=True).exclude(pk=self.instance.pk).first()
            if other is not None:
                raise forms.ValidationError(f"{other.name} is the chat page's default feature; untick it there first.")
        return marked

    def clean_fallback(self) -> Feature | None:
        fallback = self.cleaned_data.get("fallback")
        if fallback is None or self.instance.pk is None:
            return fallback  # nothing falls back to a feature not saved yet, so it closes no loop
        loop = self.instance.fallback_loop(fallback)
        if loop:
            names = " → ".join(feature.name for feature in [self.instance, *loop])
            raise forms.ValidationError(
                f"{fallback.name!r} cannot be the fallback of {self.instance.name!r}: that makes a loop ({names}). "
                "A fallback's chain must never come back to the feature."
            )
        return fallback

    def clean_semantic_threshold(self) -> float | None:
        value = self.cleaned_data.get("semantic_threshold")
        if value is not None and not 0 < value <= 1:
            raise forms.ValidationError("A cosine similarity threshold is above 0 and at most 1 (0.95 is a careful start).")
        return value


# --- providers and prices ------------------------------------------------------------------------


def parse_thresholds(text: str) -> list[int]:
    """'50, 80, 100' → [50, 80, 100]: whole percents of the monthly limit, 1 to 100."""
    values = []
    for item in (part.strip().rstrip("%").strip() for part in re.split(r"[,;\s]+", text)):
        if not item:
            continue
        if not item.isdigit():
            raise ValidationError(f"“{item}” is not a whole percent; write thresholds like 50, 80, 100.")
        value = int(item)
        if value > 100:
            raise ValidationError(f"A threshold above 100% is not allowed ({value}%): alerts are percents of the limit.")
        if value < 1:
            raise ValidationError("Thresholds are percents from 1 to 100.")
        values.append(value)
    return sorted(set(values))


def parse_recipients(text: str) -> list[str]:
    addresses = [part.strip() for part in re.split(r"[,;\s]+", text) if part.strip()]
    for address in addresses:
        try:
            validate_email(address)
        except ValidationError:
            raise ValidationError(f"“{address}” is not an email address.") from None
    return list(dict.fromkeys(addresses))


class TagField(forms.CharField):
    """A tag name as people type it, normalised (budgets.tags.normalise_tag) before it is validated."""

    def to_python(self, value) -> str:
        return normalise_tag(super().to_python(value))


class ProviderForm(forms.ModelForm):
    monthly_limit_usd = DollarsField(label="Monthly limit ($)", required=False, help_text="Empty: no limit.")
    thresholds = forms.CharField(
        label="Alert thresholds (%)", required=False, help_text="Percents of the monthly limit, e.g. 50, 80, 100."
    )
    recipients = forms.CharField(
        label="Alert recipients", required=False, help_text="Email addresses, separated by commas."
    )
    hourly_cost_usd = DollarsField(
        label="Machine cost per hour ($)", required=False,
        help_text="Local only: prices its tokens from the workers' measured throughput. Empty: priced by hand.",
    )

    # Write-only: never rendered back (render_value=False), kept encrypted (budgets/vault.py).
    api_key = forms.CharField(
        label="API key", required=False, strip=True, max_length=4000,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
    )
    clear_api_key = forms.BooleanField(label="Remove the stored API key", required=False)

    class Meta:
        model = Provider
        fields = ["name", "kind", "base_url", "remote_model", "api_key_env", "utilisation_percent"]
        labels = {"base_url": "Server URL", "api_key_env": "API key environment variable",
                  "utilisation_percent": "Expected utilisation (%)"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        provider = self.instance
        if provider.pk:
            self.initial.setdefault("monthly_limit_usd", dollars_text(provider.monthly_limit_micro_usd))
            self.initial.setdefault("thresholds", ", ".join(str(t) for t in provider.alert_thresholds))
            self.initial.setdefault("recipients", ", ".join(provider.recipients()))
            self.initial.setdefault("hourly_cost_usd", dollars_text(provider.hourly_cost_micro_usd))
        else:
            self.initial.setdefault("thresholds", "50, 80, 100")
        state = "set (stored encrypted; type a new one to replace it)" if provider.has_api_key else "not set"
        self.fields["api_key"].help_text = f"Currently {state}. It is never shown again once saved."
        if not provider.has_api_key:
            del self.fields["clear_api_key"]
        # Not required: a form posted without it (a script, a remote provider) keeps the current value.
        self.fields["utilisation_percent"].required = False

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        # Provider.default() finds the local engine by this name; renaming it would make a new one.
        if self.instance.pk and self.instance.name == "local" and name != "local":
            raise ValidationError("The provider “local” is the default one; its name cannot change.")
        return name

    def clean_utilisation_percent(self) -> int:
        value = self.cleaned_data.get("utilisation_percent")
        return self.instance.utilisation_percent if value is None else value

    def clean_thresholds(self) -> list[int]:
        return parse_thresholds(self.cleaned_data["thresholds"])

    def clean_base_url(self) -> str:
        url = self.cleaned_data.get("base_url", "").strip()
        if url:
            try:
                outbound.check_url(url, outbound.PROVIDER)
            except outbound.OutboundRefused as exc:
                raise ValidationError(f"This URL is not allowed: {exc}.") from None
        return url

    def clean_api_key_env(self) -> str:
        name = self.cleaned_data.get("api_key_env", "").strip()
        if name and not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise ValidationError("The name of an environment variable: capital letters, digits and _ (the key itself never goes here).")
        if name and not allowed_key_env(name):
            raise ValidationError(
                f"Only variables whose names start with {API_KEY_ENV_PREFIX} can hold a provider's key "
                f"(e.g. {API_KEY_ENV_PREFIX}VLLM), so that no server secret is sent to a provider; "
                "or type the key itself in the API key field."
            )
        return name

    def clean_recipients(self) -> str:
        return ", ".join(parse_recipients(self.cleaned_data["recipients"]))

    def clean(self) -> dict:
        cleaned = super().clean()
        # The model keeps micro-dollars and a list; set them here so model validation sees them too.
        if "monthly_limit_usd" in cleaned:
            self.instance.monthly_limit_micro_usd = to_micro_usd(cleaned["monthly_limit_usd"])
        if "thresholds" in cleaned:
            self.instance.alert_thresholds = cleaned["thresholds"]
        if "recipients" in cleaned:
            self.instance.alert_recipients = cleaned["recipients"]
        if "hourly_cost_usd" in cleaned:
            self.instance.hourly_cost_micro_usd = to_micro_usd(cleaned["hourly_cost_usd"])
            if self.instance.hourly_cost_micro_usd is not None and cleaned.get("kind") != Provider.Kind.LOCAL:
                self.add_error("hourly_cost_usd", "Only a local provider runs on a machine of ours; "
                               "a remote server is priced per token (add a price below).")
        self._set_api_key(cleaned)
        if cleaned.get("kind") == Provider.Kind.OPENAI_COMPATIBLE and not cleaned.get("base_url"):
            self.add_error("base_url", "An OpenAI-compatible provider needs the URL of its server (…/v1).")
        return cleaned


    def _set_api_key(self, cleaned: dict) -> None:
        """Encrypt a typed key onto the instance (the plain text goes no further than this form)."""
        if cleaned.get("api_key"):
            try:
                self.instance.api_key_encrypted = vault.seal(cleaned["api_key"])
            except vault.SecretsUnavailable as exc:
                self.add_error("api_key", f"The key was not stored: {exc}")
        elif cleaned.get("clear_api_key"):
            self.instance.api_key_encrypted = ""


class PriceForm(forms.Form):
    """A new price from a moment on; old prices are never edited, so past costs stay right."""

    model = forms.CharField(max_length=200, widget=forms.TextInput(attrs={"list": "known-models"}))
    input_usd = DollarsField(label="Input ($ per million tokens)")
    output_usd = DollarsField(label="Output ($ per million tokens)")
    cached_input_usd = DollarsField(label="Cached input ($ per million tokens)", required=False, help_text="Empty: 0.")
    effective_from = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        help_text=f"In {settings.TIME_ZONE}. Empty: from now on.",
    )
    new_model = forms.BooleanField(
        label="This is a new model for this provider", required=False,
        help_text="Needed for a model name this provider has no price for yet (a typo guard).",
    )

    def __init__(self, *args, provider: Provider, known_models: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.provider, self.known_models = provider, known_models

    def clean_model(self) -> str:
        return self.cleaned_data["model"].strip()

    def clean(self) -> dict:
        cleaned = super().clean()
        model = cleaned.get("model")
        if model and model not in self.known_models and not cleaned.get("new_model"):
            shown = self.known_models[:KNOWN_MODELS_SHOWN]
            known = ", ".join(shown) + (f" and {len(self.known_models) - len(shown)} more" if len(self.known_models) > len(shown) else "")
            self.add_error(
                "model",
                f"Unknown model “{model}” for the provider {self.provider.name}; known: {known}. "
                "Tick “new model” if this is a model it has not priced before.",
            )
        cleaned["effective_from"] = cleaned.get("effective_from") or timezone.now()
        if model and ModelPrice.objects.filter(
            provider=self.provider, model=model, effective_from=cleaned["effective_from"]
        ).exists():
            self.add_error("effective_from", "This model already has a price from that moment.")
        return cleaned

    def build(self) -> ModelPrice:
        data = self.cleaned_data
        return ModelPrice(
            provider=self.provider,
            model=data["model"],
            input_per_million_micro_usd=to_micro_usd(data["input_usd"]),
            output_per_million_micro_usd=to_micro_usd(data["output_usd"]),
            cached_input_per_million_micro_usd=to_micro_usd(data["cached_input_usd"] or Decimal(0)),
            effective_from=data["effective_from"],
        )


def known_models(provider: Provider) -> list[str]:
    """The models this provider has prices for, and the model the local engine serves (a local
    provider: with each weight variant's name too, "<model>@int8", which staff may price apart)."""
    names = set(provider.prices.order_by().values_list("model", flat=True).distinct()) | {settings.CEILING_MODEL_NAME}
    if provider.kind == Provider.Kind.LOCAL:
        from .guard import VARIANT_SEPARATOR

        names |= {f"{settings.CEILING_MODEL_NAME}{VARIANT_SEPARATOR}{variant}"
                  for variant in Feature.Quantization.values if variant != Feature.Quantization.NONE}
    return sorted(names)


# --- lists ---------------------------------------------------------------------------------------


class SearchForm(forms.Form):
    q = forms.CharField(label="Search", required=False, max_length=150)


class AuditFilterForm(forms.Form):
    target = forms.CharField(label="Target", required=False, max_length=200)


# --- the cost model ------------------------------------------------------------------------------

PRICING = [("hosted", "a hosted model's published price"), ("custom", "a price I type"), ("self", "my own machine")]
REQUEST_LAWS = [("lognormal", "lognormal (median, sigma)"), ("pareto", "power law (minimum, alpha)")]


class CostModelForm(forms.Form):
    feature = forms.ModelChoiceField(Feature.objects.order_by("name"), required=False, help_text="prefill from its logs")
    users = forms.IntegerField(min_value=1, max_value=100_000_000)
    system_prompt_tokens = forms.IntegerField(min_value=0, max_value=1_000_000)
    retrieved_tokens = forms.IntegerField(min_value=0, max_value=1_000_000)
    prompt_median = forms.FloatField(min_value=0.001, label="user prompt tokens, median")
    prompt_sigma = forms.FloatField(min_value=0, max_value=5, label="user prompt tokens, sigma")
    output_median = forms.FloatField(min_value=0.001, label="output tokens, median")
    output_sigma = forms.FloatField(min_value=0, max_value=5, label="output tokens, sigma")
    requests_law = forms.ChoiceField(choices=REQUEST_LAWS, label="requests per user per day")
    requests_a = forms.FloatField(min_value=0.0001, label="median (lognormal) or minimum (power law)")
    requests_b = forms.FloatField(min_value=0, max_value=10, label="sigma (lognormal) or alpha (power law)")
    pricing = forms.ChoiceField(choices=PRICING)
    price = forms.ModelChoiceField(ModelPrice.objects.select_related("provider").order_by("provider__name", "model", "-effective_from"), required=False)
    input_usd_per_million = forms.FloatField(min_value=0, required=False)
    output_usd_per_million = forms.FloatField(min_value=0, required=False)
    hourly_usd = forms.FloatField(min_value=0, required=False)
    utilisation_percent = forms.FloatField(min_value=0.1, max_value=100, required=False)
    machine_decode_tokens_per_s = forms.FloatField(min_value=0.001, required=False)
    overhead_ms = forms.FloatField(min_value=0)
    prefill_tokens_per_s = forms.FloatField(min_value=0.001)
    decode_tokens_per_s = forms.FloatField(min_value=0.001)
    retrieval_ms = forms.FloatField(min_value=0)
    target_usd = forms.FloatField(min_value=0.0001, label="target price per user per month ($)")

    def clean(self):
        data = super().clean()
        pricing = data.get("pricing")
        if pricing == "hosted" and not data.get("price"):
            self.add_error("price", "Pick the hosted model whose price to use.")
        if pricing == "custom":
            for name in ("input_usd_per_million", "output_usd_per_million"):
                if data.get(name) is None:
                    self.add_error(name, "Give the price per million tokens.")
        if pricing == "self":
            for name in ("hourly_usd", "utilisation_percent", "machine_decode_tokens_per_s"):
                if data.get(name) is None:
                    self.add_error(name, "Needed to price your own machine.")
        if data.get("requests_law") == "pareto" and data.get("requests_b") is not None and data["requests_b"] <= 1:
            self.add_error("requests_b", "A power law needs alpha above 1, or the mean is infinite.")
        return data

    def to_inputs(self) -> tuple[costmodel.Inputs, costmodel.SelfHosted | None]:
        d = self.cleaned_data
        machine = None
        if d["pricing"] == "hosted":
            row = d["price"]
            price = costmodel.Price(row.input_per_million_micro_usd / 1e6, row.output_per_million_micro_usd / 1e6, f"{row.provider}/{row.model}")
        elif d["pricing"] == "custom":
            price = costmodel.Price(d["input_usd_per_million"], d["output_usd_per_million"], "custom")
        else:
            machine = costmodel.SelfHosted(d["hourly_usd"], d["utilisation_percent"] / 100, d["machine_decode_tokens_per_s"])
            machine.validate()
            price = machine.as_price()
        law = (costmodel.Distribution.lognormal(d["requests_a"], d["requests_b"]) if d["requests_law"] == "lognormal"
               else costmodel.Distribution.pareto(d["requests_a"], d["requests_b"]))
        inputs = costmodel.Inputs(
            system_prompt_tokens=costmodel.Distribution.fixed(d["system_prompt_tokens"]),
            retrieved_tokens=costmodel.Distribution.fixed(d["retrieved_tokens"]),
            user_prompt_tokens=costmodel.Distribution.lognormal(d["prompt_median"], d["prompt_sigma"]),
            output_tokens=costmodel.Distribution.lognormal(d["output_median"], d["output_sigma"]),
            requests_per_user_per_day=law,
            users=d["users"],
            price=price,
            latency=costmodel.LatencyModel(d["overhead_ms"], d["prefill_tokens_per_s"], d["decode_tokens_per_s"], d["retrieval_ms"]),
            target_usd_per_user_month=d["target_usd"],
        )
        return inputs, machine


# --- the token log browser -----------------------------------------------------------------------

Position = tuple[datetime, int]  # a keyset cursor: (created_at, id)


class PeriodForm(forms.Form):
    period = forms.ChoiceField(choices=[(Period.MONTH, "This month"), (Period.DAY, "Today")], required=False)

    def period_or_default(self) -> str:
        return (self.is_valid() and self.cleaned_data["period"]) or Period.MONTH


class Cursor:
    """A keyset position (created_at, id) as it travels in the URL: '<epoch microseconds>_<id>'."""

    EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

    @classmethod
    def encode(cls, row: TokenLog) -> str:
        delta = row.created_at - cls.EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return f"{micros}_{row.pk}"

    @classmethod
    def decode(cls, raw: str) -> Position:
        micros, _, pk = raw.partition("_")
        try:
            # timedelta, not fromtimestamp(): a float would lose the microseconds the keyset needs.
            return cls.EPOCH + timedelta(microseconds=int(micros)), int(pk)
        except (ValueError, OverflowError):
            raise forms.ValidationError("This page link is damaged; start again from the newest rows.") from None


class LogFilterForm(forms.Form):
    user = forms.CharField(required=False, max_length=150, label="User")
    feature = forms.ModelChoiceField(
        Feature.objects.order_by("name"), required=False, to_field_name="name", empty_label="any"
    )
    status = forms.ChoiceField(choices=[("", "any"), *TokenLog.Status.choices], required=False)
    refusal_code = forms.CharField(
        required=False, max_length=64, label="Refusal code",
        validators=[RegexValidator(r"^[a-z0-9_]+$", "Refusal codes are lowercase letters, digits and _.")],
    )
    team = forms.CharField(required=False, max_length=64, label="Team")
    tag = TagField(required=False, max_length=32, label="Tag", validators=[tag_validator])
    date_from = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    date_to = forms.DateField(required=False, label="To (inclusive)", widget=forms.DateInput(attrs={"type": "date"}))
    before = forms.CharField(required=False, widget=forms.HiddenInput)
    after = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_user(self):
        username = self.cleaned_data["user"].strip()
        if not username:
            return None
        # Resolved to an id here, so the query uses the (user, created_at) index without a join.
        user = get_user_model().objects.filter(username=username).only("id", "username").first()
        if user is None:
            raise forms.ValidationError(f"There is no user named {username!r}.")
        return user

    def clean_team(self) -> Team | None:
        # A text box, not a select: the page renders no query for it, and a name is resolved only when given.
        name = self.cleaned_data["team"].strip()
        if not name:
            return None
        team = Team.objects.filter(name=name).first()
        if team is None:
            raise forms.ValidationError(f"There is no team named {name!r}.")
        return team

    def clean_before(self) -> Position | None:
        raw = self.cleaned_data["before"]
        return Cursor.decode(raw) if raw else None

    def clean_after(self) -> Position | None:
        raw = self.cleaned_data["after"]
        return Cursor.decode(raw) if raw else None

    def clean(self):
        data = super().clean()
        start, end = data.get("date_from"), data.get("date_to")
        if start and end and start > end:
            self.add_error("date_to", "The end date is before the start date.")
        return data

    def filtered(self) -> QuerySet[TokenLog]:
        """The rows these filters select, in no particular order (only call when valid)."""
        data = self.cleaned_data
        rows = TokenLog.objects.all()
        if data["user"]:
            rows = rows.filter(user=data["user"])
        if data["feature"]:
            rows = rows.filter(feature=data["feature"])
        if data["status"]:
            rows = rows.filter(status=data["status"])
        if data["refusal_code"]:
            rows = rows.filter(refusal_code=data["refusal_code"])
        if data["team"]:
            rows = rows.filter(team=data["team"])
        if data["tag"]:
            rows = rows.filter(**tag_filter(data["tag"]))
        # Dates are calendar days in settings.TIME_ZONE, like every period in Ceiling.
        if data["date_from"]:
            rows = rows.filter(created_at__gte=datetime.combine(data["date_from"], time(), tzinfo=local_zone()))
        if data["date_to"]:
            day_after = data["date_to"] + timedelta(days=1)
            rows = rows.filter(created_at__lt=datetime.combine(day_after, time(), tzinfo=local_zone()))
        return rows


class WebhookForm(forms.Form):
    """A new alert webhook: where alerts of which scope are POSTed, and in which body."""

    provider = forms.ModelChoiceField(
        queryset=Provider.objects.order_by("name"), required=False, empty_label="every alert",
        label="Alerts of", help_text="A provider's alerts, or every alert (users' caps, spikes, all providers).",
    )
    team = forms.ModelChoiceField(
        queryset=Team.objects.order_by("name"), required=False, empty_label="—",
        label="or a team's", help_text="A team's alerts: its thresholds, projections and spikes.",
    )
    url = forms.URLField(label="URL", max_length=500, assume_scheme="https")
    body_format = forms.ChoiceField(label="Body", choices=AlertWebhook.BodyFormat.choices, initial=AlertWebhook.BodyFormat.JSON)

    def clean_url(self) -> str:
        url = self.cleaned_data["url"]
        if not url.startswith(("http://", "https://")):
            raise ValidationError("A webhook URL starts with http:// or https://.")
        try:
            outbound.check_url(url, outbound.WEBHOOK)
        except outbound.OutboundRefused as exc:
            raise ValidationError(f"This URL is not allowed: {exc}.") from None
        return url

    def clean(self) -> dict:
        cleaned = super().clean()
        if cleaned.get("provider") and cleaned.get("team"):
            raise ValidationError("A webhook receives one provider's alerts or one team's, not both.")
        return cleaned


class TeamWebhookForm(WebhookForm):
    """A webhook on the team page: the team is the page's, so only where and how."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self.fields["provider"]
        del self.fields["team"]


class TeamAlertsForm(forms.Form):
    """A team's alert thresholds (percents of its monthly cost cap) and its email recipients."""

    thresholds = forms.CharField(
        label="Alert thresholds (%)", required=False,
        help_text="Percents of the team's monthly cost cap, e.g. 50, 80, 100. Empty: no threshold alerts.",
    )
    recipients = forms.CharField(
        label="Alert recipients", required=False,
        help_text="Email addresses, separated by commas. Empty: the fallback recipients of every alert.",
    )

    def __init__(self, *args, team: Team, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("thresholds", ", ".join(str(t) for t in team.alert_thresholds))
        self.initial.setdefault("recipients", ", ".join(team.recipients()))

    def clean_thresholds(self) -> list[int]:
        return parse_thresholds(self.cleaned_data["thresholds"])

    def clean_recipients(self) -> str:
        return ", ".join(parse_recipients(self.cleaned_data["recipients"]))


# --- an API key's own caps -------------------------------------------------------------------------


class KeyCapsForm(forms.Form):
    """An API key's caps, below its user's. The key's owner may only lower them (or set one where
    there was none); staff may set anything. An empty box means no cap of the key's own."""

    max_requests_per_day = forms.IntegerField(
        label="Requests per day", required=False, min_value=0, max_value=MAX_REQUESTS, error_messages=NOT_NEGATIVE
    )
    max_cost_per_day_usd = DollarsField(label="Cost per day ($)", required=False, error_messages=NOT_NEGATIVE)
    max_cost_per_month_usd = DollarsField(label="Cost per month ($)", required=False, error_messages=NOT_NEGATIVE)
    max_in_flight = forms.IntegerField(
        label="Requests in flight at once", required=False, min_value=1, max_value=MAX_REQUESTS,
        help_text="Answers in progress at the same time; the next one waits (429, Retry-After: 1).",
    )
    team_name = forms.ChoiceField(
        label="Team that pays", required=False,
        help_text="Whose team caps this key's requests count against; X-Ceiling-Team on a request overrides it.",
    )

    allowed_features = forms.MultipleChoiceField(
        label="Features it may use", required=False, widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every feature. A request for another feature is refused (403 feature_not_allowed).",
    )

    def __init__(self, *args, key, lower_only: bool, **kwargs) -> None:
        kwargs.setdefault("initial", {
            "max_requests_per_day": key.max_requests_per_day,
            "max_cost_per_day_usd": dollars_text(key.max_cost_per_day_micro_usd),
            "max_cost_per_month_usd": dollars_text(key.max_cost_per_month_micro_usd),
            "max_in_flight": key.max_in_flight,
            "team_name": key.team_name,
            "allowed_features": list(key.allowed_features),
        })
        super().__init__(*args, **kwargs)
        self.key, self.lower_only = key, lower_only
        for name in ("max_requests_per_day", "max_cost_per_day_usd", "max_cost_per_month_usd", "max_in_flight"):
            self.fields[name].widget.attrs.update({"placeholder": "no cap"})
        # The features an API caller can reach, and whatever the key names already (a renamed or
        # switched-off one stays visible, so unticking it is possible).
        names = set(Feature.objects.exclude(mode=Feature.Mode.BATCH).values_list("name", flat=True))
        self.fields["allowed_features"].choices = [(name, name) for name in sorted(names | set(key.allowed_features))]
        teams = team_names_of(key.user_id)
        first = f"the team joined first ({teams[0]})" if teams else "no team (the user is in none)"
        self.fields["team_name"].choices = [("", first), *((name, name) for name in teams)]
        if key.team_name and key.team_name not in teams:  # left the team since: shown, so it can be changed
            self.fields["team_name"].choices.append((key.team_name, f"{key.team_name} (no longer a member)"))

    def caps(self) -> dict[str, int | list[str] | None]:
        return {
            "max_requests_per_day": self.cleaned_data.get("max_requests_per_day"),
            "max_cost_per_day_micro_usd": to_micro_usd(self.cleaned_data.get("max_cost_per_day_usd")),
            "max_cost_per_month_micro_usd": to_micro_usd(self.cleaned_data.get("max_cost_per_month_usd")),
            "max_in_flight": self.cleaned_data.get("max_in_flight"),
            "team_name": self.cleaned_data.get("team_name") or "",
            "allowed_features": sorted(self.cleaned_data.get("allowed_features") or []),
        }

    def clean(self) -> dict:
        cleaned = super().clean()
        if self.lower_only and not self.errors:
            boxes = {"max_requests_per_day": "max_requests_per_day", "max_cost_per_day_micro_usd": "max_cost_per_day_usd",
                     "max_cost_per_month_micro_usd": "max_cost_per_month_usd", "max_in_flight": "max_in_flight"}
            caps = self.caps()
            for name, box in boxes.items():
                current = getattr(self.key, name)
                if current is not None and (caps[name] is None or caps[name] > current):
                    self.add_error(box, "You can only lower this cap; ask staff to raise or remove it.")
            if not _narrows(self.key.allowed_features, caps["allowed_features"]):
                self.add_error("allowed_features", "You can only narrow the key's features; ask staff to widen them.")
        return cleaned


def _narrows(current: list[str], wanted: list[str]) -> bool:
    """Whether `wanted` allows nothing that `current` does not (an empty list allows everything)."""
    if not current:
        return True
    return bool(wanted) and set(wanted) <= set(current)
