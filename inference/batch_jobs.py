"""Starting a batch job: its rows, and the task that runs it once they are committed.

Above the Celery tasks (inference/tasks.py), which call down into the worker that answers the job
(inference/worker/batch.py): so neither of those imports the other.
"""

from __future__ import annotations

from functools import partial

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from budgets.models import Feature
from inference.models import BatchItem, BatchJob
from inference.tasks import run_batch
from inference.variants import variant_of, variant_queue


def do_start_batch(*, feature: Feature, user: AbstractBaseUser, max_tokens: int, prompts: list[str]) -> BatchJob:
    """Create the job and its items, and queue it once they are committed."""
    with transaction.atomic():
        job = BatchJob.objects.create(feature=feature, user=user, max_tokens=max_tokens, total=len(prompts))
        BatchItem.objects.bulk_create(BatchItem(job=job, index=i, prompt=p) for i, p in enumerate(prompts))
        # On the queue of the feature's weight variant, whose worker serves it (inference/variants.py).
        transaction.on_commit(partial(run_batch.apply_async, args=[job.pk], queue=variant_queue(variant_of(feature))))
    return job
