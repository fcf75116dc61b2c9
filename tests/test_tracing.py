"""OpenTelemetry traces: one trace per chat, from daphne through the Celery task to the worker's settle.

The stack's daphne and worker are processes of their own, so their spans are gathered the way an
operator's collector gathers them: both export OTLP over HTTP (the production exporter, configured
only by OTEL_EXPORTER_OTLP_ENDPOINT) to a small OTLP receiver in the test process (tests/otlp.py),
which decodes each export with OpenTelemetry's own protobuf classes. In-process behaviour (the
sampler, the helpers, spans drawn from measured times) is checked with OpenTelemetry's
InMemorySpanExporter.
"""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys

import pytest
from django.conf import settings
from openai import OpenAI
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from accounts.actions import do_create_api_key
from budgets.models import Quota, TokenLog
from project import stack as processes
from project import tracing
from tests.conftest import session_cookie, wait_for
from tests.otlp import ReceivedSpan, Receiver
from tests.wsclient import chat, chat_frame, chat_socket, next_frame, send

STAGES = {"chat", "guard", "queue", "prefill", "decode", "settle"}


@pytest.fixture(scope="module")
def traced_stack(shared_stack):
    """daphne and a worker with tracing switched on the way an operator does: an OTLP endpoint, the
    session's receiver (tests/otlp.py). The shared stack has it from its start (tests/conftest.py)."""
    return shared_stack


def spans_of(request_id: str) -> list[ReceivedSpan]:
    with Receiver.lock:
        return [s for s in Receiver.spans if s.attributes.get(tracing.REQUEST_ID) == request_id]


def trace_of(request_id: str, stages: set[str]) -> list[ReceivedSpan]:
    """Every span of the one trace that holds this request's stages, once they have all been exported
    and every span's parent with them (each process exports in its own batches, a parent after its children)."""

    def exported() -> list[ReceivedSpan] | None:
        own = spans_of(request_id)
        if not stages <= {s.name for s in own}:
            return None
        trace_ids = {s.trace_id for s in own}
        assert len(trace_ids) == 1, f"the request's spans are in {len(trace_ids)} traces"
        with Receiver.lock:
            spans = [s for s in Receiver.spans if s.trace_id in trace_ids]
        return spans if not orphans(spans) else None

    try:
        return wait_for(exported, timeout=20)
    except pytest.fail.Exception:
        trace_ids = {s.trace_id for s in spans_of(request_id)}
        with Receiver.lock:
            found = [(s.name, s.parent_id in {o.span_id for o in Receiver.spans}) for s in Receiver.spans if s.trace_id in trace_ids]
        pytest.fail(f"the trace of {request_id} stayed incomplete: (span, parent found) {found}")


def orphans(spans: list[ReceivedSpan]) -> list[str]:
    ids = {s.span_id for s in spans}
    return [s.name for s in spans if s.parent_id and s.parent_id not in ids]


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return {name: found[0] for name, found in named.items() if len(found) == 1}


def assert_one_connected_tree(spans: list[ReceivedSpan]) -> ReceivedSpan:
    """One root, and every other span's parent is in the trace; returns the root."""
    roots = [s for s in spans if not s.parent_id]
    assert len(roots) == 1, [s.name for s in roots]
    assert not orphans(spans), f"spans whose parent is not in the trace: {orphans(spans)}"
    return roots[0]


# --- a real chat through the real stack --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_websocket_chat_is_one_trace_from_the_guard_to_the_settle(traced_stack, alice, chat_feature):
    frames = asyncio.run(chat(traced_stack, session_cookie(alice), chat_frame("Say hello.", 12)))
    request_id = frames[0]["request_id"]
    assert frames[-1]["type"] == "done", frames

    spans = trace_of(request_id, STAGES)

    root = assert_one_connected_tree(spans)
    assert root.name == "chat" and root.attributes["ceiling.outcome"] == "done"
    named = by_name(spans)
    for stage in STAGES:  # each stage once: prefill and decode are one span each, never one per step
        assert stage in named, f"{stage} is missing or repeated: {sorted(s.name for s in spans)}"
        assert named[stage].attributes[tracing.REQUEST_ID] == request_id
    # The worker continued the web process's trace through the Celery task's headers.
    run = named["run/inference.generate"]
    assert named["apply_async/inference.generate"].parent_id == root.span_id
    assert run.parent_id == named["apply_async/inference.generate"].span_id
    assert {named[stage].parent_id for stage in ("queue", "prefill", "decode", "settle")} == {run.span_id}
    assert named["guard"].parent_id == root.span_id and named["guard"].attributes["ceiling.admitted"] is True
    # The stages follow one another (one machine, one clock).
    assert named["guard"].end_ns <= named["queue"].start_ns <= named["queue"].end_ns <= named["prefill"].start_ns
    assert named["prefill"].end_ns == named["decode"].start_ns <= named["decode"].end_ns <= named["settle"].start_ns
    assert named["decode"].attributes["ceiling.completion_tokens"] == frames[-1]["usage"]["completion_tokens"]
    assert {s.service for s in spans} == {"ceiling-test"}


@pytest.mark.django_db(transaction=True)
def test_an_api_chat_is_one_trace_under_djangos_request_span(traced_stack, alice, chat_feature):
    client = OpenAI(base_url=f"{traced_stack.http_url}/v1", api_key=do_create_api_key(alice, "tracing")[1], max_retries=0)
    first = client.chat.completions.with_raw_response.create(
        model=settings.CEILING_MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    second = client.chat.completions.with_raw_response.create(
        model=settings.CEILING_MODEL_NAME, messages=[{"role": "user", "content": "Say bye."}], max_tokens=4, stream=True)
    list(second.parse())  # the streamed answer, read to its end
    request_ids = [first.headers["x-request-id"], second.headers["x-request-id"]]

    traces = [trace_of(request_id, STAGES) for request_id in request_ids]

    assert traces[0][0].trace_id != traces[1][0].trace_id, "two chats, two traces"
    for request_id, spans in zip(request_ids, traces, strict=True):
        root = assert_one_connected_tree(spans)
        assert root.kind == ProtoSpan.SPAN_KIND_SERVER and root.attributes.get("http.route") == "v1/chat/completions"
        assert by_name(spans)["chat"].parent_id == root.span_id
        assert TokenLog.objects.get(request_id=request_id).status == TokenLog.Status.OK


@pytest.mark.django_db(transaction=True)
def test_a_refused_chat_is_a_trace_of_its_guard_alone(traced_stack, bob, chat_feature):
    Quota.objects.create(user=bob, period="day", max_requests=0)

    frames = asyncio.run(chat(traced_stack, session_cookie(bob), chat_frame("Say hello.", 8)))
    refused = frames[-1]
    assert refused["type"] == "refused", frames
    request_id = TokenLog.objects.get(user=bob, status=TokenLog.Status.REFUSED).request_id

    spans = trace_of(request_id, {"chat", "guard"})

    named = by_name(spans)
    assert named["guard"].attributes["ceiling.admitted"] is False
    assert named["guard"].attributes["ceiling.code"] == refused["code"] == named["chat"].attributes["ceiling.code"]
    assert named["chat"].attributes["ceiling.outcome"] == "refused"
    assert not {"queue", "prefill", "decode", "settle"} & set(named), "a refused chat never reached a worker"


@pytest.mark.django_db(transaction=True)
def test_a_chat_closed_mid_answer_is_one_trace_with_its_decode_cancelled(traced_stack, alice, chat_feature):
    cookie = session_cookie(alice)

    async def scenario():
        async with chat_socket(traced_stack, cookie) as ws:
            await send(ws, chat_frame("Write a very long story about a lighthouse keeper.", 400))
            accepted = await next_frame(ws)
            await next_frame(ws)  # its first token; then the socket closes
        return accepted["request_id"]

    request_id = asyncio.run(scenario())

    spans = trace_of(request_id, STAGES)

    assert_one_connected_tree(spans)
    named = by_name(spans)
    assert named["chat"].attributes["ceiling.outcome"] == "closed"
    assert named["decode"].attributes["ceiling.finish_reason"] == "cancelled"
    assert 1 <= named["decode"].attributes["ceiling.completion_tokens"] < 400
    assert named["settle"].attributes["ceiling.status"] == TokenLog.Status.CANCELLED


# --- in this process, with an in-memory exporter -------------------------------------------------------


@pytest.fixture
def memory():
    exporter = InMemorySpanExporter()
    provider = tracing.build_provider("otlp", exporter=exporter)
    tracing.start(provider)
    try:
        yield lambda: (provider.force_flush(), exporter.get_finished_spans())[1]
    finally:
        tracing.stop()
        provider.shutdown()


def test_tracing_is_off_in_a_process_that_was_not_told_otherwise():
    assert not tracing.enabled()
    assert tracing.start_chat("r-1", "chat") is None
    with tracing.span("guard", "r-1") as span:
        assert span is None
    assert tracing.enqueue_headers() is None  # a dispatch's message is unchanged


def test_lone_redis_calls_are_dropped_and_those_of_a_request_kept(memory):
    tracer = tracing._tracer

    def a_chat() -> None:  # in a context of its own, as a chat's task has: enter() never detaches
        chat_span = tracing.start_chat("r-2", "chat")
        tracing.enter(chat_span)
        with tracing.span("guard", "r-2"), tracer.start_as_current_span("EVALSHA", kind=SpanKind.CLIENT):
            pass
        tracing.end_chat(chat_span, {"type": "done"})

    with tracer.start_as_current_span("BLPOP", kind=SpanKind.CLIENT):  # a broker poll, a heartbeat
        pass
    contextvars.copy_context().run(a_chat)

    spans = memory()

    assert sorted(s.name for s in spans) == ["EVALSHA", "chat", "guard"]
    assert len({s.context.trace_id for s in spans}) == 1


def test_measured_stages_keep_their_times_and_an_error(memory):
    tracing.record("prefill", "r-3", 1_000, 5_000)
    tracing.record("decode", "r-3", 5_000, 9_000, error="the GPU fell over", finish_reason="error")

    prefill, decode = sorted(memory(), key=lambda s: s.start_time)

    assert (prefill.start_time, prefill.end_time, decode.start_time, decode.end_time) == (1_000, 5_000, 5_000, 9_000)
    assert decode.attributes == {tracing.REQUEST_ID: "r-3", "ceiling.finish_reason": "error"}
    assert decode.status.status_code.name == "ERROR" and decode.status.description == "the GPU fell over"


def test_the_queue_wait_runs_from_the_publish_time_in_the_task_headers(memory):
    headers = tracing.enqueue_headers()

    class TaskRequest:  # what Celery's task.request holds: the message's headers as attributes
        pass

    task_request = TaskRequest()
    setattr(task_request, tracing.ENQUEUED_HEADER, headers[tracing.ENQUEUED_HEADER])
    tracing.record_queue_wait("r-4", task_request)
    tracing.record_queue_wait("r-5", TaskRequest())  # queued by a web process that was not tracing

    (queue,) = memory()
    assert queue.name == "queue" and queue.start_time == headers[tracing.ENQUEUED_HEADER] <= queue.end_time


# --- configuration ------------------------------------------------------------------------------------


def run_manage(*argv: str, **env: str) -> subprocess.CompletedProcess:
    # OTEL_* of this shell must not change what the test expects.
    clean = {name: value for name, value in processes.child_env().items() if not name.startswith("OTEL_")}
    return subprocess.run([sys.executable, "manage.py", *argv], env={**clean, **env},
                          capture_output=True, text=True, timeout=120, cwd=settings.BASE_DIR)


ASK = ("shell", "-c", "import sys; from project import tracing; print(tracing.enabled(), 'opentelemetry.sdk.trace' in sys.modules)")


def test_off_by_default_loads_no_opentelemetry_at_all():
    done = run_manage(*ASK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_an_otlp_endpoint_switches_tracing_on_and_otel_sdk_disabled_off():
    on = run_manage(*ASK, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    off = run_manage(*ASK, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_SDK_DISABLED="true")
    assert on.stdout.split()[-2:] == ["True", "True"], on.stderr
    assert "tracing on: spans go to http://127.0.0.1:9/v1/traces" in on.stderr
    assert off.stdout.split()[-2:] == ["False", "False"], off.stderr


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' must be one of otlp, console, none"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='grpc': Ceiling exports traces over OTLP http/protobuf only"),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, "OTEL_TRACES_SAMPLER='always_off' must be parentbased_always_on or"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG=2.0 must be between 0 and 1"),
])
def test_a_tracing_setting_that_cannot_work_is_refused_at_start(env, message):
    done = run_manage("check", **env)
    assert done.returncode != 0 and message in done.stderr


@pytest.mark.parametrize(("last_event", "outcome", "status"), [
    ({"type": "done"}, "done", "UNSET"),
    ({"type": "refused", "code": "user_tokens_per_day"}, "refused", "UNSET"),
    ({"type": "error", "code": "internal"}, "error", "ERROR"),
    ({"type": "token", "text": "Hel"}, "closed", "UNSET"),  # the socket closed mid-answer
    (None, "closed", "UNSET"),  # closed before the first event
])
def test_a_chat_span_says_how_the_chat_ended(memory, last_event, outcome, status):
    contextvars.copy_context().run(lambda: tracing.end_chat(tracing.start_chat("r-6", "chat"), last_event))

    (chat_span,) = memory()
    assert chat_span.attributes["ceiling.outcome"] == outcome
    assert chat_span.attributes.get("ceiling.code") == (last_event or {}).get("code")
    assert chat_span.status.status_code.name == status
