"""What was asked and answered, kept apart from the ledger (which holds only numbers)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from budgets.models import Feature, TokenLog


class Transcript(models.Model):
    """The prompt of one request and the answer the engine produced, token ids included.

    The worker reads the prompt from here (tasks take ids, not payloads), and a client that lost
    frames can recover the whole answer from it.
    """

    log = models.OneToOneField(TokenLog, on_delete=models.CASCADE, related_name="transcript")
    messages = models.JSONField()
    prompt_ids = models.JSONField(default=list)
    completion_ids = models.JSONField(default=list)
    response_text = models.TextField(blank=True)
    # What an API client asked for beyond the prompt (temperature, stop, tools, …; inference/web/params.py),
    # only the values it gave: the worker hands them to the engine or the remote server. {} is greedy.
    params = models.JSONField(default=dict, blank=True)
    # OpenAI's `user` field: the caller's own id for the person behind the request, kept beside
    # the ledger row (whose `user` is the API key's owner) so staff can trace abuse to it.
    end_user = models.CharField(max_length=256, blank=True)

    def __str__(self) -> str:
        return f"transcript of {self.log.request_id}"


class ModelAlias(models.Model):
    """A model name that routes an API request to a feature (`"model": "support-bot"` → feature support).

    Staff set them on the feature page; a name belongs to one feature only (the unique index), and
    the served model's own name (CEILING_MODEL_NAME) is never an alias: it selects the default feature.
    """

    name = models.CharField(max_length=100, unique=True)
    feature = models.ForeignKey(Feature, on_delete=models.CASCADE, related_name="model_aliases")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} → {self.feature.name}"


class BatchJob(models.Model):
    """Many inputs answered by one feature in the background (e.g. a nightly summary of many items)."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    feature = models.ForeignKey(Feature, on_delete=models.PROTECT, related_name="batch_jobs")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batch_jobs")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    max_tokens = models.PositiveIntegerField(default=128)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"batch {self.pk} ({self.feature}, {self.done + self.failed}/{self.total})"


class BatchItem(models.Model):
    job = models.ForeignKey(BatchJob, on_delete=models.CASCADE, related_name="items")
    index = models.PositiveIntegerField()
    prompt = models.TextField()
    request_id = models.CharField(max_length=64, blank=True)
    output = models.TextField(blank=True)
    status = models.CharField(max_length=16, blank=True)  # a TokenLog status, or refused
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="one_item_per_index")]
        ordering = ["index"]


class QuantizationPolicy(models.Model):
    """What a quantized model must show before staff may switch a feature to it (one row, staff edit it).

    Kept with each evaluation as it was at the time, so an old verdict still reads as it was decided.
    """

    max_accuracy_drop_points = models.FloatField(
        default=2.0, help_text="exact-answer accuracy may fall by at most this many percentage points"
    )
    min_throughput_gain_pct = models.FloatField(
        default=20.0, help_text="output tokens/s on the mixed workload must rise by at least this many percent"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "quantization policy"

    def __str__(self) -> str:
        return f"accuracy −{self.max_accuracy_drop_points} pt at most, throughput +{self.min_throughput_gain_pct}% at least"

    @classmethod
    def current(cls) -> QuantizationPolicy:
        policy, _ = cls.objects.get_or_create(pk=1)
        return policy


class QuantizationEvaluation(models.Model):
    """One run of `evaluate_quantization`: the full-precision and the quantized model on one feature's prompts.

    `answers` keeps every prompt with both answers and their token ids, so accuracy and agreement
    can be recomputed from what is stored (inference/engine/evaluate.py), not only read from the counts.
    """

    feature = models.ForeignKey(Feature, on_delete=models.CASCADE, related_name="quantization_evaluations")
    mode = models.CharField(max_length=8)  # the candidate's quantization, e.g. "int8"
    baseline_mode = models.CharField(max_length=8, default="none")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    prompt_set_size = models.PositiveIntegerField()  # prompts in the shipped set; fewer were answered with --limit
    checkable = models.PositiveIntegerField()  # answered prompts that have accepted answers
    baseline_correct = models.PositiveIntegerField()
    candidate_correct = models.PositiveIntegerField()
    agreement = models.FloatField()  # identical greedy tokens up to the first divergence, 0..1
    baseline_tokens_per_s = models.FloatField()
    candidate_tokens_per_s = models.FloatField()
    workload_requests = models.PositiveIntegerField()
    baseline_weights_bytes = models.PositiveBigIntegerField()
    candidate_weights_bytes = models.PositiveBigIntegerField()
    max_accuracy_drop_points = models.FloatField()
    min_throughput_gain_pct = models.FloatField()
    passed = models.BooleanField()
    verdict = models.TextField()  # sentences: why it passed or failed
    answers = models.JSONField(default=list)
    # Where it was measured (inference/engine/machine.py): CPU model, torch threads, the ISA features
    # the variants' speed depends on. A verdict on throughput holds on that machine only; "" for the
    # rows stored before it was recorded.
    machine = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["feature", "mode", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.feature} {self.mode} {'passed' if self.passed else 'failed'} {self.created_at:%Y-%m-%d %H:%M}"

    @classmethod
    def latest_for(cls, feature: Feature, mode: str, machine: str | None = None) -> QuantizationEvaluation | None:
        """The latest evaluation of `mode` on the feature; with `machine`, the latest measured there."""
        rows = cls.objects.filter(feature=feature, mode=mode)
        if machine is not None:
            rows = rows.filter(machine=machine)
        return rows.order_by("-created_at", "-id").first()

    @property
    def answered(self) -> int:
        return len(self.answers)

    @property
    def complete(self) -> bool:
        """Every prompt of the set was answered (not a --limit run)."""
        return self.answered >= self.prompt_set_size

    @property
    def baseline_accuracy(self) -> float:
        return _percent(self.baseline_correct, self.checkable)

    @property
    def candidate_accuracy(self) -> float:
        return _percent(self.candidate_correct, self.checkable)

    @property
    def accuracy_drop_points(self) -> float:
        return round(self.baseline_accuracy - self.candidate_accuracy, 2)

    @property
    def throughput_gain_pct(self) -> float:
        if not self.baseline_tokens_per_s:
            return 0.0
        return round(100.0 * (self.candidate_tokens_per_s / self.baseline_tokens_per_s - 1.0), 1)

    @property
    def baseline_weights_mib(self) -> float:
        return round(self.baseline_weights_bytes / 2**20, 1)

    @property
    def candidate_weights_mib(self) -> float:
        return round(self.candidate_weights_bytes / 2**20, 1)


def _percent(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


class Document(models.Model):
    """A Markdown or text file a docs feature answers from, cut into chunks with their embeddings.

    `audience` says who may read it: everyone, staff only, or one team's members ("team:<id>", see
    team_audience); a passage never reaches the prompt of a user who may not read it, retrieved
    fresh or from the retrieval cache (inference/retrieval.py). Staff read every document.
    """

    class Audience(models.TextChoices):
        EVERYONE = "everyone", "everyone"
        STAFF = "staff", "staff only"

    TEAM_PREFIX = "team:"  # + a budgets.Team id: the team's members (and staff) only

    @classmethod
    def team_audience(cls, team_id: int) -> str:
        return f"{cls.TEAM_PREFIX}{team_id}"

    @property
    def audience_label(self) -> str:
        if self.audience.startswith(self.TEAM_PREFIX):
            from budgets.models import Team

            team = Team.objects.filter(pk=int(self.audience[len(self.TEAM_PREFIX):])).first()
            return f"the team {team.name!r}" if team else "a team that no longer exists (staff only)"
        return self.get_audience_display()

    feature = models.ForeignKey(Feature, on_delete=models.CASCADE, related_name="documents")
    name = models.CharField(max_length=200)  # the file's name, e.g. "budgets.md"
    audience = models.CharField(max_length=16, choices=Audience.choices, default=Audience.EVERYONE)
    text = models.TextField()
    sha256 = models.CharField(max_length=64)  # of the text: loading the same file again changes nothing
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["feature", "name"], name="one_document_per_name_and_feature")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.feature.name}/{self.name}"


class Chunk(models.Model):
    """One passage of a document: a heading's paragraphs up to a token bound, and its embedding.

    The embedding is the semantic cache's model (all-MiniLM-L6-v2), 384 float32s as bytes, unit length.
    """

    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    heading = models.CharField(max_length=500, blank=True)  # "Budgets › The guard"
    text = models.TextField()
    tokens = models.PositiveIntegerField()  # in the served model's tokenizer, as placed in the prompt
    embedding = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["document", "index"], name="one_chunk_per_index")]
        ordering = ["document_id", "index"]

    def __str__(self) -> str:
        return f"{self.document.name} #{self.index}"
