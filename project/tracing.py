"""OpenTelemetry traces: one trace per chat, from the web process through the Celery task to the settle.

Off unless configured (project/settings.py, docs/observability.md). Off, this module imports nothing
of OpenTelemetry, installs no instrumentation, and every helper returns at its first line: a chat
costs a few `if` checks, never a span object.

On, each chat is one trace:

    chat                                web: the consumer's or the API's request (ceiling.request_id)
      guard                             web: the budget guard's one admission call
      apply_async/inference.generate    web: Celery's publish (opentelemetry-instrumentation-celery puts
        run/inference.generate          the trace context in the task's headers; the worker continues it)
          queue                         enqueued (web) → picked up by a worker thread
          prefill                       handed to the engine (or remote) → its first token
          decode                        first token → last token (one span, never one per step)
          settle                        ledger row, metrics, the guard's reservation released
    and, around an API chat, Django's own server span; Redis commands (the guard's script, the
    broker's publish) as children of whichever of these issued them.

Every Ceiling span carries `ceiling.request_id`, the ledger's id (the API's x-request-id, the
`accepted` frame's request_id, the log lines' request_id).

Redis commands issued outside any request (the broker's polling, the workers' heartbeats, the
token frames' sender loop) would each be a trace of its own: the sampler drops a CLIENT span that
has no parent, which is exactly those.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

REQUEST_ID = "ceiling.request_id"
# The Celery header that carries when the web process published the task (wall-clock ns), so the
# worker can draw the queue wait; absent when tracing is off.
ENQUEUED_HEADER = "ceiling_enqueued_ns"

_tracer: Tracer | None = None  # set while tracing is on; None is "off" for every helper below
_NOTHING = nullcontext()


def enabled() -> bool:
    return _tracer is not None


# --- starting ---------------------------------------------------------------------------------------


def configure() -> bool:
    """Start tracing in this process if the settings ask for it (every process: daphne, workers, commands).

    Called from InferenceConfig.ready(), before Django loads its middleware (the Django
    instrumentation adds its own) and before a Celery worker takes a task. True when it started.
    """
    from django.conf import settings

    if settings.CEILING_TRACES_EXPORTER == "none" or enabled():
        return enabled()
    from opentelemetry import trace

    provider = build_provider(settings.CEILING_TRACES_EXPORTER, settings.CEILING_TRACES_RATIO)
    trace.set_tracer_provider(provider)  # the instrumentations' (OpenTelemetry takes one per process)
    start(provider)
    instrument_libraries()
    log.info("tracing on: spans go to %s", _destination(settings.CEILING_TRACES_EXPORTER))
    return True


def build_provider(exporter_name: str, ratio: float = 1.0, exporter=None) -> TracerProvider:
    """A tracer provider that batches spans to the named exporter (or to `exporter`, when given)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "ceiling"}))
    provider = TracerProvider(resource=resource, sampler=request_sampler(ratio))
    if exporter is None:
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_*
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def request_sampler(ratio: float = 1.0):
    """parentbased: a child follows its parent; a new trace is kept at `ratio`, unless it is a lone
    client call (a Redis command nobody's request issued), which is dropped."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_ON,
        Decision,
        ParentBased,
        Sampler,
        SamplingResult,
        TraceIdRatioBased,
    )
    from opentelemetry.trace import SpanKind

    class NoLoneClientCalls(Sampler):
        def __init__(self, new_traces: Sampler) -> None:
            self.new_traces = new_traces

        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
            if kind == SpanKind.CLIENT:
                return SamplingResult(Decision.DROP)
            return self.new_traces.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"NoLoneClientCalls{{{self.new_traces.get_description()}}}"

    return ParentBased(root=NoLoneClientCalls(ALWAYS_ON if ratio >= 1 else TraceIdRatioBased(ratio)))


def start(provider: TracerProvider) -> None:
    """From now on the helpers below record spans to `provider` (a test gives one with an in-memory exporter)."""
    global _tracer
    _tracer = provider.get_tracer("ceiling")


def stop() -> None:
    """The helpers go back to recording nothing (the instrumentations stay)."""
    global _tracer
    _tracer = None


def instrument_libraries() -> None:
    """Django's requests, Celery's publish and run (the trace context travels in the task headers), Redis' commands."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    DjangoInstrumentor().instrument()  # OTEL_PYTHON_DJANGO_EXCLUDED_URLS leaves paths out (/metrics, say)
    CeleryInstrumentor().instrument()
    RedisInstrumentor().instrument()


def _destination(exporter_name: str) -> str:
    import os

    if exporter_name == "console":
        return "the console"
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or f"{os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT')}/v1/traces"


# --- spans of a chat --------------------------------------------------------------------------------


def start_chat(request_id: str, feature: str) -> Span | None:
    """The chat's own span (None when off), a child of the current one (Django's, for an API call).

    Not entered as a `with` block: the chat is an async generator, resumed by whoever iterates it,
    and a context token cannot be reset from another context. The caller makes it current with
    enter() and ends it with end_chat().
    """
    if _tracer is None:
        return None
    return _tracer.start_span("chat", attributes={REQUEST_ID: request_id, "ceiling.feature": feature})


def enter(span: Span | None) -> None:
    """Make `span` the current one in this context, as run_chat sets its request id: the guard's
    and the dispatch's threads (sync_to_async copies the context) then make their spans its children."""
    if span is None:
        return
    from opentelemetry import context, trace

    context.attach(trace.set_span_in_context(span))  # never detached: see start_chat


def end_chat(span: Span | None, last_event: dict | None) -> None:
    """End the chat's span with how it ended: done, refused (with its code), error, or closed (the
    caller went away before the end)."""
    if span is None:
        return
    outcome = (last_event or {}).get("type")
    if outcome not in ("done", "refused", "error"):
        outcome = "closed"
    span.set_attribute("ceiling.outcome", outcome)
    if last_event and last_event.get("code"):
        span.set_attribute("ceiling.code", str(last_event["code"]))
    if outcome == "error":
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(last_event.get("code", ""))))
    span.end()


def span(name: str, request_id: str, **attributes: Any) -> AbstractContextManager:
    """A span around a block, a child of the current one; the block gets the span (None when off)."""
    if _tracer is None:
        return _NOTHING
    return _tracer.start_as_current_span(name, attributes={REQUEST_ID: request_id, **_ceiling(attributes)})


def annotate(span: Span | None, **attributes: Any) -> None:
    if span is not None:
        span.set_attributes(_ceiling(attributes))


def record(name: str, request_id: str, start_ns: int, end_ns: int, *, error: str = "", **attributes: Any) -> None:
    """A finished span with the times it had (wall-clock ns), a child of the current one: a stage
    that was measured, not wrapped (the engine's prefill and decode happen on its own thread)."""
    if _tracer is None:
        return
    stage = _tracer.start_span(name, start_time=start_ns, attributes={REQUEST_ID: request_id, **_ceiling(attributes)})
    if error:
        from opentelemetry.trace import Status, StatusCode

        stage.set_status(Status(StatusCode.ERROR, error))
    stage.end(end_time=max(start_ns, end_ns))


def _ceiling(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"ceiling.{name}": value for name, value in attributes.items() if value is not None}


# --- the queue: from the web process's publish to the worker's pick-up ---------------------------------


def enqueue_headers() -> dict | None:
    """The Celery headers a dispatch adds: when it was published (None when off: the message is unchanged)."""
    if _tracer is None:
        return None
    return {ENQUEUED_HEADER: time.time_ns()}


def record_queue_wait(request_id: str, task_request) -> None:
    """The queue span, drawn in the worker from the publish time its task's headers carry.

    Wall-clock times of two machines: a clock skew between them moves its start.
    """
    if _tracer is None:
        return
    enqueued = getattr(task_request, ENQUEUED_HEADER, None)
    if isinstance(enqueued, int):
        record("queue", request_id, enqueued, time.time_ns())
