"""Celery tasks of the "inference" queue, and the hooks that give each worker process its engine."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_init, worker_shutdown
from django.conf import settings

from budgets.reconcile import reconcile_forever
from project import tracing
from project.logs import request_context

from .bus.cancel import listen_for_cancellations
from .bus.ownership import reassert_claims
from .bus.stats import publish_stats_forever
from .engines import get_engine, process_stats, shutdown_engine
from .variants import VARIANTS, mark_served, variant_queue, worker_variants
from .worker import handles
from .worker.generation import run_generation
from .worker.lost import settle_lost_requests_forever
from .worker.throughput import report_throughput_forever

log = logging.getLogger(__name__)

_stop_services = threading.Event()


@shared_task(
    name="inference.generate",
    queue="inference",
    ignore_result=True,
    # Celery enforces these only in the prefork pool; run_generation keeps its own, shorter deadline
    # (CEILING_ENGINE_DEADLINE_S) so the thread pool we use is bounded too.
    time_limit=settings.CEILING_TASK_TIME_LIMIT_S,
    soft_time_limit=settings.CEILING_TASK_SOFT_TIME_LIMIT_S,
    # Acked on receipt, never redelivered: a generation is not idempotent once it has streamed. A
    # rerun after a worker died would charge the prompt again and stream a second, different answer
    # to a user who has already been told it failed (the web side notices the dead worker, settles
    # the row failed with the tokens streamed, and releases the reservation). So no acks_late and
    # no reject_on_worker_lost here; a lost task costs one retry by the user, never a double charge.
    acks_late=False,
    reject_on_worker_lost=False,
)
def generate(request_id: str, reply_to: str = "") -> None:
    # reply_to: the waiting web process's stream inbox; a task queued by an older web process
    # carries none, and its user's page then ends from the ledger (inference/chat/relay.py).
    # Every line logged while it runs (the generation, its settle) names the request, as the web
    # process's lines about it do (project/logs.py).
    with request_context(request_id):
        tracing.record_queue_wait(request_id, generate.request)
        log.info("generation picked up")
        run_generation(request_id, reply_to)
        log.info("generation settled")


# Each item keeps the engine's own deadline; the job as a whole gets a day (enforced by prefork only).
@shared_task(name="inference.run_batch", queue="inference", ignore_result=True, acks_late=False,
             soft_time_limit=23 * 3600, time_limit=24 * 3600)
def run_batch(job_id: int) -> None:
    """Every item of a batch job, a few at a time on this worker's engine; progress is saved per item.

    No time limit: a job is as long as its items, and each generation keeps its own deadline.
    Not retried: the job is claimed once (queued → running), and a rerun would answer items twice.
    """
    from .worker.batch import run_batch_job

    run_batch_job(job_id)


@celeryd_after_setup.connect
def consume_the_queues_of_its_variants(sender: str, instance, **_: object) -> None:
    """A worker always reads its own variants' queues, whatever --queues says, and says so loudly when
    --queues names another variant's: those chats would be refused here (inference/variants.py)."""
    if not settings.CEILING_ENGINE_AUTOSTART:
        return
    queues = instance.app.amqp.queues
    served = worker_variants()
    for variant in served:
        queues.select_add(variant_queue(variant))
    consumed = set(queues.consume_from or ())
    for variant in set(VARIANTS) - set(served):
        if variant_queue(variant) in consumed:
            log.error("this worker serves %s weights but reads the queue %s of %s requests, which it will refuse; "
                      "start it with --queues %s", ", ".join(served), variant_queue(variant), variant,
                      ",".join(variant_queue(v) for v in served))


@worker_init.connect
def start_engine_with_worker(**_: object) -> None:
    """One engine per worker process, loaded before the worker takes its first task."""
    if not settings.CEILING_ENGINE_AUTOSTART:
        return
    start_worker_services()


def on_heartbeat(client, worker: str, variants) -> None:
    mark_served(client, worker, variants)
    reassert_claims(client)


def start_worker_services() -> None:
    engine = get_engine()
    _compile_before_serving(engine)
    _stop_services.clear()
    threading.Thread(
        target=listen_for_cancellations, args=(handles.cancel, _stop_services), name="cancel-listener", daemon=True
    ).start()
    threading.Thread(
        target=publish_stats_forever,
        args=(process_stats, _stop_services),  # every weight variant this worker hosts
        # With each beat: its queues are served, and the claims of the requests it runs are in Redis.
        kwargs={"with_beat": partial(on_heartbeat, variants=worker_variants())},
        name="stats-publisher",
        daemon=True,
    ).start()
    if settings.CEILING_RECONCILE_EVERY_S > 0:
        threading.Thread(
            target=reconcile_forever, args=(_stop_services, settings.CEILING_RECONCILE_EVERY_S), name="reconciliation", daemon=True
        ).start()
    if settings.CEILING_LOST_SWEEP_EVERY_S > 0:
        threading.Thread(
            target=settle_lost_requests_forever, args=(_stop_services, settings.CEILING_LOST_SWEEP_EVERY_S),
            name="lost-request-sweep", daemon=True,
        ).start()
    if settings.CEILING_THROUGHPUT_EVERY_S > 0:
        threading.Thread(
            target=report_throughput_forever, args=(_stop_services, settings.CEILING_THROUGHPUT_EVERY_S),
            name="throughput-reporter", daemon=True,
        ).start()
    log.info("engine ready: %s", engine.stats().as_dict())


def _compile_before_serving(engine) -> None:
    """Wait for the decode steps' compile (a minute a bucket on 2 cores, seconds from var/inductor) before
    this worker takes requests and says its queues are served: compiling beside a chat made both slow."""
    if settings.CEILING_COMPILE_WAIT_S <= 0:
        return
    started = time.monotonic()
    if engine.wait_for_compile(timeout=settings.CEILING_COMPILE_WAIT_S):
        report = engine.compile_report()
        if report is not None:
            log.info("decode steps compiled before taking requests, in %.1f s: %s", time.monotonic() - started,
                     report.describe())
    else:
        log.warning("the decode steps were still compiling after CEILING_COMPILE_WAIT_S=%.0f s; taking requests "
                    "now, eagerly, while the compile goes on", settings.CEILING_COMPILE_WAIT_S)


@worker_shutdown.connect
def stop_engine_with_worker(**_: object) -> None:
    _stop_services.set()
    shutdown_engine()
