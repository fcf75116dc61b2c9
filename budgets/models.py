"""The ledger: features and one TokenLog row for every request, whatever its end."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models.functions import Coalesce

from .tags import TAG_RE, TAG_RULE


def unique_row(queryset: models.QuerySet) -> models.Model | None:
    """The row a filter on a unique key matches, or None.

    `.first()` would order by the primary key, and building and running that ORDER BY is a third of
    such a read's cost on the hot paths (every admission and every task).
    """
    return next(iter(queryset[:1]), None)


class ReferenceQuerySet(models.QuerySet):
    """The bulk writes of a table admissions cache (budgets/refcache.py) tell every process.

    save() and delete() send post_save / post_delete, which refcache listens to; update(),
    bulk_create() and bulk_update() send nothing, so they bump the table's version here.
    """

    def update(self, **kwargs) -> int:
        rows = super().update(**kwargs)
        _reference_changed(self.model)
        return rows

    def bulk_create(self, objs, *args, **kwargs):
        created = super().bulk_create(objs, *args, **kwargs)
        _reference_changed(self.model)
        return created

    def bulk_update(self, objs, fields, *args, **kwargs) -> int:
        rows = super().bulk_update(objs, fields, *args, **kwargs)
        _reference_changed(self.model)
        return rows

    def delete(self):
        deleted = super().delete()
        _reference_changed(self.model)
        return deleted


def _reference_changed(model: type[models.Model]) -> None:
    from .refcache import changed  # refcache reads these models' names only; imported late to stay light

    changed(model._meta.model_name)


class Period(models.TextChoices):
    MINUTE = "minute"  # a window: the calendar minute, for bursts (requests/tokens per minute)
    HOUR = "hour"
    DAY = "day"
    MONTH = "month"


# The calendar periods the staff grids, forecasts and alerts are built on; minute and hour are
# windows against bursts, set beside them (a cap per minute has no month to forecast).
CALENDAR_PERIODS = (Period.DAY, Period.MONTH)
WINDOW_PERIODS = (Period.MINUTE, Period.HOUR)


# The only environment variables a provider may name for its key: a staff form must not be able to
# make a worker send the server's own secrets (SECRET_KEY, DATABASE_URL) to a URL staff chose.
API_KEY_ENV_PREFIX = "CEILING_PROVIDER_KEY_"


def allowed_key_env(name: str) -> bool:
    """Whether a provider may name this environment variable for its key (the form and the worker ask)."""
    return name.startswith(API_KEY_ENV_PREFIX) and len(name) > len(API_KEY_ENV_PREFIX)


def default_thresholds() -> list[int]:
    return [50, 80, 100]


class Provider(models.Model):
    """Where a model runs: the local engine, or a remote OpenAI-compatible server. Has a monthly spend limit."""

    objects = ReferenceQuerySet.as_manager()

    class Kind(models.TextChoices):
        LOCAL = "local"
        OPENAI_COMPATIBLE = "openai-compatible"

    name = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=32, choices=Kind.choices, default=Kind.LOCAL)
    monthly_limit_micro_usd = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Monthly spend limit in micro-dollars; empty means no limit."
    )
    alert_thresholds = models.JSONField(default=default_thresholds, help_text="Percentages of the monthly limit.")
    alert_recipients = models.TextField(blank=True, help_text="Comma-separated email addresses.")
    # For kind openai-compatible: where the workers stream from (vLLM, TGI, a hosted API, another Ceiling).
    base_url = models.URLField(blank=True, help_text="e.g. http://vllm.internal:8000/v1")
    remote_model = models.CharField(max_length=200, blank=True, help_text="the model name the server expects")
    api_key_env = models.CharField(
        max_length=100, blank=True,
        help_text=f"name of the environment variable holding the server's API key (starting {API_KEY_ENV_PREFIX})",
    )
    # The key staff typed on the provider's page, Fernet-encrypted (budgets/vault.py); never shown again.
    # Not editable: no form or admin page renders it; ProviderForm's api_key field writes it.
    api_key_encrypted = models.TextField(blank=True, editable=False)
    # For kind local: what the machine costs, so that its tokens are priced like a hosted model's
    # (budgets/selfhosted.py). Empty: staff price the local model by hand, or it costs $0.
    hourly_cost_micro_usd = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="What one worker machine costs per hour, in micro-dollars."
    )
    utilisation_percent = models.PositiveSmallIntegerField(
        default=70, validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="The share of each hour the machine is expected to be serving.",
    )
    # The engine's measured throughput (the highest 10-second rates a worker has reported); set by
    # the workers, or by seed_demo as an assumption (throughput_measured_at empty) until one does.
    decode_tokens_per_s = models.FloatField(null=True, blank=True)
    prefill_tokens_per_s = models.FloatField(null=True, blank=True)
    throughput_measured_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name

    def recipients(self) -> list[str]:
        return [address.strip() for address in self.alert_recipients.split(",") if address.strip()]

    @property
    def has_api_key(self) -> bool:
        return bool(self.api_key_encrypted)

    @classmethod
    def default(cls) -> Provider:
        provider, _ = cls.objects.get_or_create(name="local", defaults={"kind": cls.Kind.LOCAL})
        return provider


class ModelPrice(models.Model):
    """Prices per million tokens, in micro-dollars, from a moment on. Old rows stay: history is kept."""

    objects = ReferenceQuerySet.as_manager()

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="prices")
    model = models.CharField(max_length=200)
    input_per_million_micro_usd = models.PositiveBigIntegerField(default=0)
    output_per_million_micro_usd = models.PositiveBigIntegerField(default=0)
    cached_input_per_million_micro_usd = models.PositiveBigIntegerField(default=0)
    context_window = models.PositiveIntegerField(null=True, blank=True)
    effective_from = models.DateTimeField()

    class Source(models.TextChoices):
        CATALOG = "catalog"  # imported from tokencost's model_prices.json
        STAFF = "staff"  # typed by staff: an override the catalog import never replaces
        MEASURED = "measured"  # self-hosted: the hourly cost ÷ the tokens per hour the engine serves

    source = models.CharField(max_length=16, choices=Source.choices, default=Source.STAFF)
    # How a derived price came about, for the price history ("$3.60/h at 70%, 2,400 decode tok/s …").
    basis = models.CharField(max_length=300, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["provider", "model", "effective_from"], name="one_price_per_moment")
        ]
        indexes = [models.Index(fields=["provider", "model", "-effective_from"])]

    def __str__(self) -> str:
        return f"{self.provider}/{self.model} from {self.effective_from:%Y-%m-%d}"

    def cost_micro_usd(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> int:
        """Cost rounded up to a whole micro-dollar (a ceiling never under-counts)."""
        uncached = max(0, prompt_tokens - cached_tokens)
        numerator = (
            uncached * self.input_per_million_micro_usd
            + cached_tokens * self.cached_input_per_million_micro_usd
            + completion_tokens * self.output_per_million_micro_usd
        )
        return -(-numerator // 1_000_000)


class Feature(models.Model):
    """A product feature that calls the model ("chat", "summary"…); limits and logs hang off it."""

    objects = ReferenceQuerySet.as_manager()

    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(r"^[a-z0-9][a-z0-9_-]*$", "Use lowercase letters, digits, - and _.")],
    )
    description = models.CharField(max_length=200, blank=True)
    class Mode(models.TextChoices):
        CHAT = "chat"  # streams tokens (websocket or SSE)
        EXTRACT = "extract"  # answers once, with a complete JSON object
        BATCH = "batch"  # many items as a Celery batch job, progress shown to staff
        DOCS = "docs"  # answers from the feature's documents: retrieved passages go into the prompt

    enabled = models.BooleanField(default=True)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.CHAT)
    max_input_tokens = models.PositiveIntegerField(default=2048, validators=[MinValueValidator(1)])
    max_output_tokens = models.PositiveIntegerField(default=512, validators=[MinValueValidator(1)])
    provider = models.ForeignKey(Provider, null=True, blank=True, on_delete=models.PROTECT, related_name="features")
    # Response caches: off while cache_ttl_s is 0. Answers are reused only for the same user unless
    # staff mark the feature shareable (it must carry no personal data).
    cache_ttl_s = models.PositiveIntegerField(default=0, help_text="0 switches the answer caches off")
    semantic_threshold = models.FloatField(
        null=True, blank=True, help_text="cosine similarity for a semantic hit (e.g. 0.95); empty = exact only"
    )
    cache_shared = models.BooleanField(default=False, help_text="reuse answers across users (no personal data)")

    class Quantization(models.TextChoices):
        NONE = "none", "full precision"
        INT8 = "int8", "int8 weights"
        Q4 = "q4", "4-bit weights (decode steps)"
        BF16 = "bf16", "bf16 weights"

    # Which weights of the local model serve this feature. Not in the feature form: staff switch it
    # on the feature page, only after an evaluation passed (inference.actions.do_switch_quantization).
    quantization = models.CharField(max_length=8, choices=Quantization.choices, default=Quantization.NONE)
    # Staff chose these weights: the start-up's adoption of the shipped verdict (inference/shipped.py)
    # never switches a pinned feature. A switch on the feature page pins it.
    quantization_pinned = models.BooleanField(
        default=False, help_text="keep these weights: `make run` never switches them to the shipped verdict's",
    )
    # The simpler path: when the guard would refuse this feature for a cost or provider-spend cap, it
    # serves the request with the fallback instead, if that fits (budgets/guard.py). One hop only: a
    # fallback's own fallback is never followed, so no configuration can make an admission loop.
    fallback = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="fallback_for",
        help_text="served instead when a cost or provider-spend cap refuses this feature (a cheaper provider or a smaller model)",
    )
    # Failover (docs/budgets.md, "Failover"): provider ids, tried in this order when the feature's remote
    # provider answers 429 or 5xx, cannot be reached or sends no first token, before any text reached
    # the client. Only a remote no dearer than the feature's own provider (price in and out) and with
    # no monthly spend limit of its own serves, so the reservation made at admission stays an upper
    # bound of the bill; a list of ids keeps the order and is audited as one field.
    backup_providers = models.JSONField(
        default=list, blank=True,
        help_text="remote providers tried in order when the feature's own fails before the first token",
    )
    # Generation defaults: what a request gets for each value it does not give itself (the chat page
    # gives none). Plain greedy decoding unless staff set them; the demo's features use a frequency
    # penalty on greedy decoding (seed_demo, docs/configuration.md): SmolLM2 loops greedily, and a
    # penalty keeps the answer deterministic, so the answer caches still hold it.
    temperature = models.FloatField(
        default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(2.0)],
        help_text="0 decodes greedily (deterministic, cacheable); above 0 samples",
    )
    top_p = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="nucleus sampling: the smallest set of likely tokens whose probability reaches this (1 = all)",
    )
    frequency_penalty = models.FloatField(
        default=0.0, validators=[MinValueValidator(-2.0), MaxValueValidator(2.0)],
        help_text="lowers a token by this much for each time the answer already used it (0.5 stops the demo model looping)",
    )
    presence_penalty = models.FloatField(
        default=0.0, validators=[MinValueValidator(-2.0), MaxValueValidator(2.0)],
        help_text="lowers a token by this much once the answer has used it",
    )
    # The feature the chat page opens on (at most one; none marked: `chat`). Never the alphabetically
    # first: a `bench` feature the benchmark made sorted first and refused alice's next chat.
    is_default = models.BooleanField(default=False, help_text="the chat page opens on this feature")
    created_at = models.DateTimeField(auto_now_add=True)

    PLAIN_GENERATION = {"temperature": 0.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["is_default"], condition=models.Q(is_default=True), name="one_default_feature"),
        ]

    def __str__(self) -> str:
        return self.name

    def generation_defaults(self) -> dict:
        """The feature's generation values that differ from plain greedy decoding, as a request's stored
        params name them (inference/web/params.py): a request's own values win over these."""
        return {name: getattr(self, name) for name, plain in self.PLAIN_GENERATION.items() if getattr(self, name) != plain}

    def fallback_loop(self, candidate: Feature | None) -> list[Feature]:
        """The chain candidate → its fallback → … when it comes back to this feature ([] when it does not).

        Reads the chain as saved; the guard follows one hop only, so a loop saved by two staff at
        once cannot make anything loop, it is only refused here.
        """
        chain: list[Feature] = []
        seen: set[int] = set()
        current = candidate
        while current is not None and current.pk not in seen:
            chain.append(current)
            if current.pk == self.pk:
                return chain
            seen.add(current.pk)
            current = current.fallback
        return []


tag_validator = RegexValidator(TAG_RE, f"A tag is {TAG_RULE}.")


class Team(models.Model):
    """People who share caps: every member's requests also count against the team's (TeamQuota).

    Its alert thresholds are percents of its monthly cost cap (the all-features month TeamQuota);
    alerts of its scope go to its recipients and to its own webhooks (AlertWebhook.team).
    """

    objects = ReferenceQuerySet.as_manager()

    name = models.CharField(max_length=64, unique=True)
    alert_thresholds = models.JSONField(default=default_thresholds, help_text="Percentages of the monthly cost cap.")
    alert_recipients = models.TextField(blank=True, help_text="Comma-separated email addresses.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name

    def recipients(self) -> list[str]:
        return [address.strip() for address in self.alert_recipients.split(",") if address.strip()]


class TeamMembership(models.Model):
    """A user in a team. A user may be in several: each request is paid by one of them (the team its
    API key or the X-Ceiling-Team header names, else the one the user joined first) and counts
    against that team's caps only (budgets/guard.py request_scopes)."""

    objects = ReferenceQuerySet.as_manager()

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="team_memberships")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    joined_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="one_membership_per_user_and_team")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team}"


def memberships_of(user_id: int) -> models.QuerySet[TeamMembership]:
    """A user's memberships, the team joined first first: the one that pays unless a request names another."""
    return TeamMembership.objects.filter(user_id=user_id).order_by("joined_at", "pk")


def team_names_of(user_id: int) -> list[str]:
    return list(memberships_of(user_id).values_list("team__name", flat=True))


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
    # Every row is written at gateway rates and each index is written with it (migration 0019): a
    # foreign key that leads a (column, created_at) index below has no index of its own, and the
    # keys most rows leave empty (team, API key, fallback) are indexed only where they are set.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="token_logs",
                             db_index=False)
    # The feature that served the request (its caps, provider and price counted it) …
    feature = models.ForeignKey(Feature, null=True, on_delete=models.PROTECT, related_name="token_logs", db_index=False)
    # … and, when the guard fell back to it, the feature the client asked for; empty when they are the same.
    requested_feature = models.ForeignKey(
        Feature, null=True, blank=True, on_delete=models.PROTECT, related_name="fallback_token_logs", db_index=False
    )
    provider = models.ForeignKey(Provider, null=True, on_delete=models.PROTECT, related_name="token_logs", db_index=False)
    price = models.ForeignKey(ModelPrice, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    model = models.CharField(max_length=200)
    loop_id = models.CharField(max_length=64, blank=True)
    # The scopes beyond the user that counted this request when it was admitted, so that a counter
    # rebuilt from the ledger counts exactly what the guard counted: the user's team then, the API
    # key it came with, and its tags (stored as ",a,b,": tags_text()).
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="token_logs",
                             db_index=False)
    api_key = models.ForeignKey("accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="token_logs", db_index=False)
    tags = models.CharField(max_length=300, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices)
    finish_reason = models.CharField(max_length=16, blank=True)
    refusal_code = models.CharField(max_length=64, blank=True)
    error = models.CharField(max_length=500, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    # A docs feature's request: the tokens of the passages retrieved into the prompt (a part of
    # prompt_tokens, counted by the guard like the rest of it) and how long finding them took.
    retrieved_tokens = models.PositiveIntegerField(default=0)
    retrieval_ms = models.PositiveIntegerField(null=True, blank=True)
    # "hit" / "miss" when the retrieval cache was asked, and on a hit the milliseconds it saved
    # (what the search it replays took, less what the hit took).
    retrieval_cache = models.CharField(max_length=8, blank=True)
    retrieval_saved_ms = models.PositiveIntegerField(default=0)
    max_tokens = models.PositiveIntegerField(default=0)
    cost_micro_usd = models.BigIntegerField(default=0)
    # Served from an answer cache ("exact" / "semantic", cost 0) and what the original answer cost.
    cache = models.CharField(max_length=16, blank=True)
    saved_micro_usd = models.BigIntegerField(default=0)
    admitted = models.BooleanField(default=False)  # the guard reserved for it in Redis
    # Its reservation was released in Redis; false on a finished row means a settle to retry.
    counters_settled = models.BooleanField(default=False)
    reserved_tokens = models.PositiveIntegerField(default=0)
    reserved_cost_micro_usd = models.BigIntegerField(default=0)
    # What a remote billed beyond the reservation (tokens and money its estimate could not know):
    # billed all the same, recorded here, counted in /metrics and alerted once per provider and day.
    # Always 0 on the local engine, whose prompt count is exact and whose output stops at max_tokens.
    overshoot_tokens = models.PositiveIntegerField(default=0)
    overshoot_micro_usd = models.BigIntegerField(default=0)
    # The providers that failed this request before one served it (or before all failed), in order,
    # each as "name: why" (a failure, or why a backup was passed over); provider and price above
    # name the one that served. Empty when the feature's own provider answered.
    failed_over = models.JSONField(default=list, blank=True)
    # The guard's Redis counters this request was reserved against, so settling releases exactly them
    # even if quotas changed in between.
    counter_keys = models.JSONField(default=list, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["feature", "created_at"]),
            models.Index(fields=["user", "created_at"]),
            models.Index(fields=["status", "created_at"]),
            models.Index(fields=["provider", "created_at"]),
            models.Index(fields=["loop_id"], condition=~models.Q(loop_id=""), name="tokenlog_loop_idx"),
            models.Index(fields=["team", "created_at"], condition=models.Q(team__isnull=False), name="tokenlog_team_set_idx"),
            models.Index(
                fields=["api_key", "created_at"], condition=models.Q(api_key__isnull=False), name="tokenlog_api_key_set_idx"
            ),
            # Deleting a feature checks that no row fell back from it (PROTECT): those rows are few.
            models.Index(
                fields=["requested_feature"], condition=models.Q(requested_feature__isnull=False),
                name="tokenlog_requested_feature_idx",
            ),
            models.Index(
                fields=["refusal_code", "created_at"], condition=~models.Q(refusal_code=""), name="tokenlog_refusal_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"

    @property
    def tag_list(self) -> list[str]:
        return [tag for tag in self.tags.split(",") if tag]

    @property
    def cost_usd(self) -> str:
        return f"{self.cost_micro_usd / 1_000_000:.6f}"

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True)
class RetrievalFacts:
    """What retrieval added to one request, written on its ledger row whatever becomes of it."""

    retrieved_tokens: int = 0
    retrieval_ms: int | None = None
    retrieval_cache: str = ""  # hit | miss
    retrieval_saved_ms: int = 0

    def ledger_fields(self) -> dict:
        return asdict(self)


class Quota(models.Model):
    """A cap for one period: for one user or (user empty) everyone, on one feature or (empty) all."""

    objects = ReferenceQuerySet.as_manager()

    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="quotas")
    feature = models.ForeignKey(Feature, null=True, blank=True, on_delete=models.CASCADE, related_name="quotas")
    period = models.CharField(max_length=8, choices=Period.choices)
    max_requests = models.PositiveIntegerField(null=True, blank=True)
    max_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    max_cost_micro_usd = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        # One constraint per scope shape, each on its non-null columns only: NULLs are distinct in
        # a plain unique index, and SQLite (the default database) has no NULLS NOT DISTINCT.
        constraints = [
            models.UniqueConstraint(
                fields=["user", "feature", "period"],
                condition=models.Q(user__isnull=False, feature__isnull=False),
                name="one_quota_per_user_feature",
            ),
            models.UniqueConstraint(
                fields=["user", "period"],
                condition=models.Q(user__isnull=False, feature__isnull=True),
                name="one_quota_per_user",
            ),
            models.UniqueConstraint(
                fields=["feature", "period"],
                condition=models.Q(user__isnull=True, feature__isnull=False),
                name="one_default_quota_per_feature",
            ),
            models.UniqueConstraint(
                fields=["period"],
                condition=models.Q(user__isnull=True, feature__isnull=True),
                name="one_default_quota",
            ),
        ]

    def __str__(self) -> str:
        who = self.user.username if self.user_id else "everyone"
        what = self.feature.name if self.feature_id else "all features"
        return f"{who} / {what} / {self.period}"


class TeamQuota(models.Model):
    """A team's cap for one period, on all features (feature empty) or one; like a user's Quota."""

    objects = ReferenceQuerySet.as_manager()

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quotas")
    feature = models.ForeignKey(Feature, null=True, blank=True, on_delete=models.CASCADE, related_name="team_quotas")
    period = models.CharField(max_length=8, choices=Period.choices)
    max_requests = models.PositiveIntegerField(null=True, blank=True)
    max_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    max_cost_micro_usd = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "feature", "period"], condition=models.Q(feature__isnull=False),
                name="one_team_quota_per_feature",
            ),
            models.UniqueConstraint(
                fields=["team", "period"], condition=models.Q(feature__isnull=True), name="one_team_quota",
            ),
        ]

    def __str__(self) -> str:
        return f"team {self.team.name} / {self.feature.name if self.feature_id else 'all features'} / {self.period}"


class InFlightCap(models.Model):
    """How many requests one user may have admitted and unanswered at once (user empty: everyone's
    default). Not a period's cap: a request holds its place from admission to settle, so one caller
    sending as fast as they can is held to this many streams, however much of the day is left."""

    objects = ReferenceQuerySet.as_manager()

    user = models.OneToOneField(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="in_flight_cap")
    max_in_flight = models.PositiveIntegerField()

    class Meta:
        constraints = [
            # NULLs are distinct in the user column's unique index: one default row needs its own.
            models.UniqueConstraint(Coalesce("user", models.Value(0)), name="one_in_flight_cap_per_user_or_default"),
        ]

    def __str__(self) -> str:
        who = self.user.username if self.user_id else "everyone"
        return f"{who} / at most {self.max_in_flight} in flight"


class TagQuota(models.Model):
    """A monthly spend cap on every request that carries a tag, whoever sends it."""

    objects = ReferenceQuerySet.as_manager()

    tag = models.CharField(max_length=32, unique=True, validators=[tag_validator])
    max_cost_micro_usd = models.PositiveBigIntegerField()

    def __str__(self) -> str:
        return f"tag {self.tag} / month"


class Alert(models.Model):
    """The outbox of spend alerts: one row per (kind, scope, threshold, period), claimed once, sent once.

    The row's own claim (claimed_at, sent_at, error) is the email channel's; each webhook has a
    WebhookDelivery row of its own, created with the alert, so one channel failing never holds
    back another.
    """

    class Kind(models.TextChoices):
        THRESHOLD = "threshold"  # spend crossed a percent of the limit
        PROJECTED = "projected"  # at the current rate the cap runs out before its period ends
        SPIKE = "spike"  # a day's spend above 3x the trailing median
        OVERSHOOT = "overshoot"  # a remote billed more than a request's reservation (once per provider and day)

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.THRESHOLD)
    # "provider:local", "user:alice", "user:alice/feature:chat", "team:Support/feature:chat", "tag:beta":
    # long enough for the longest names (a 150-character username and a 64-character feature).
    scope = models.CharField(max_length=300)
    threshold = models.PositiveSmallIntegerField()  # percent for THRESHOLD; 0 for the others
    period_key = models.CharField(max_length=16)  # "2026-12" or "2026-12-03": the period is in the key
    spent_micro_usd = models.BigIntegerField()
    # THRESHOLD and PROJECTED: the cap; SPIKE: the trailing median the day's spend is compared with.
    limit_micro_usd = models.BigIntegerField()
    projected_at = models.DateTimeField(null=True, blank=True)  # PROJECTED: when the cap runs out
    period_end = models.DateTimeField(null=True, blank=True)  # PROJECTED: when the cap resets
    recipients = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "scope", "threshold", "period_key"], name="one_alert_per_kind_threshold_and_period"
            )
        ]

    def __str__(self) -> str:
        if self.kind == self.Kind.THRESHOLD:
            return f"{self.scope} {self.threshold}% {self.period_key}"
        return f"{self.scope} {self.kind} {self.period_key}"


class AlertWebhook(models.Model):
    """A URL that receives alerts as a signed POST: one provider's, one team's, or (both empty) every alert.

    The scope is a nullable foreign key per kind of scope (at most one of them set), so a rename or
    a deletion follows the provider or team.
    """

    class BodyFormat(models.TextChoices):
        JSON = "json", "Ceiling JSON"
        SLACK = "slack", "Slack-compatible ({\"text\": …})"

    provider = models.ForeignKey(
        Provider, null=True, blank=True, on_delete=models.CASCADE, related_name="webhooks",
        help_text="empty: every alert, whatever its scope",
    )
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.CASCADE, related_name="webhooks",
        help_text="the team's alerts: its caps' thresholds, projections and spikes",
    )
    url = models.URLField(max_length=500)
    # Kept as is: signing needs the secret itself. Shown to staff once, when the webhook is created.
    secret = models.CharField(max_length=64)
    body_format = models.CharField(max_length=8, choices=BodyFormat.choices, default=BodyFormat.JSON)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(provider__isnull=True) | models.Q(team__isnull=True), name="webhook_one_scope"
            )
        ]

    def __str__(self) -> str:
        return f"webhook {self.pk} ({self.scope_text}) {self.url}"

    @property
    def scope_text(self) -> str:
        if self.provider_id:
            return f"provider {self.provider.name}"
        if self.team_id:
            return f"team {self.team.name}"
        return "every alert"

    def receives(self, scope: str) -> bool:
        """Does an alert of this scope go to this webhook? (scope as Alert.scope spells it)

        A team's webhook takes every alert of the team: "team:Support" and its per-feature caps'
        "team:Support/feature:chat".
        """
        if self.provider_id:
            return scope == f"provider:{self.provider.name}"
        if self.team_id:
            return scope.split("/", 1)[0] == f"team:{self.team.name}"
        return True


class WebhookDelivery(models.Model):
    """One alert to one webhook: claimed once, POSTed until it succeeds or the attempts run out."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    webhook = models.ForeignKey(AlertWebhook, on_delete=models.CASCADE, related_name="deliveries")
    attempts = models.PositiveSmallIntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    gave_up_at = models.DateTimeField(null=True, blank=True)  # the attempts ran out; staff can see why
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["alert", "webhook"], name="one_delivery_per_alert_and_webhook")]

    def __str__(self) -> str:
        return f"alert {self.alert_id} → webhook {self.webhook_id}: {self.status}"

    @property
    def status(self) -> str:
        if self.sent_at is not None:
            return "sent"
        if self.gave_up_at is not None:
            return "failed"
        return "retrying" if self.attempts else "pending"


class AuditEntry(models.Model):
    """One changed field of one limit or setting: who changed it, from what to what, and when.

    Written in the same transaction as the change (budgets.actions), so the trail never misses one.
    """

    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    action = models.CharField(max_length=16)  # create | update | delete
    target = models.CharField(max_length=200)  # "quota alice/all/day", "feature chat", "provider local"
    field = models.CharField(max_length=64)
    before = models.TextField(blank=True)
    after = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["at"], name="auditentry_at_idx")]

    def __str__(self) -> str:
        return f"{self.target} {self.field}: {self.before} → {self.after}"
