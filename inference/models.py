"""What was asked and answered, kept apart from the ledger (which holds only numbers)."""

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

    def __str__(self) -> str:
        return f"transcript of {self.log.request_id}"


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
