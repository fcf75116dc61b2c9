"""What was asked and answered, kept apart from the ledger (which holds only numbers)."""

from django.db import models

from budgets.models import TokenLog


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
