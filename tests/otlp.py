"""A small OTLP/HTTP receiver: the spans a stack's daphne and worker export, decoded with OpenTelemetry's
own protobuf classes, as an operator's collector would receive them.

One receiver serves the whole run (tests/conftest.py's shared stack exports to it from its start);
tests/test_tracing.py reads what it received.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    service: str = ""


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Receiver(BaseHTTPRequestHandler):
    spans: list[ReceivedSpan] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        received = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource_spans in received.resource_spans:
                service = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}.get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(ReceivedSpan(
                            span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                            span.start_time_unix_nano, span.end_time_unix_nano,
                            {kv.key: _value(kv.value) for kv in span.attributes}, service,
                        ))
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def start_receiver() -> tuple[str, ThreadingHTTPServer]:
    """(its base URL, the server to shut down) of a receiver answering in a thread of this process."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server
