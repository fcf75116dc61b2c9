"""Stage 6, dispatch: the Celery task `generate` on the queue of the weights that serve the request
(the fallback's, when the guard chose it). A broker that is away fails the request at once, so it
never holds its reservation."""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async

from inference import variants
from inference.bus.trace import mark
from project import tracing

from .settle import fail_undispatched


@sync_to_async(thread_sensitive=False)
def dispatch_generation(request_id: str, reply_to: str, variant: str | None = None) -> None:
    from inference.tasks import generate

    queue = variants.variant_queue(variant or variants.default_variant())
    # Stamped before the publish: a free worker can start the task before apply_async returns here.
    publishing_at = time.time()
    try:
        # The trace context goes in the task's headers (Celery's instrumentation), with the publish time.
        generate.apply_async(args=[request_id, reply_to], queue=queue, retry=False, headers=tracing.enqueue_headers())
    except Exception as exc:
        # Never leave an admitted request holding its reservation because the broker was away.
        fail_undispatched(request_id, str(exc))
        raise
    mark(request_id, "dispatched", at=publishing_at)
