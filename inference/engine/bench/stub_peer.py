"""A stub OpenAI-compatible server with fixed timing: the peer of `bench --modes remote`.

It answers GET /v1/models and streamed POST /v1/chat/completions as llama.cpp's server or vLLM
does: status and headers at once, then, after a fixed first-byte delay, one chunk per token at a
fixed interval (max_tokens of them: it never stops early, as `ignore_eos` asks), a usage chunk and
[DONE]. Its time to first token is the same for every request however many arrive together, so a
comparison of the same burst sent to it directly and through Ceiling measures Ceiling's own
overhead, not a model's queueing.

HTTP/1.1 with chunked bodies, so a client may keep its connection for the next request (as a
pooled client does); every request is recorded with the client's address, which tells how many
connections a client opened.

    python -m inference.engine.bench.stub_peer --port 8090 --first-byte-ms 2000 --token-ms 20
    manage.py bench --quick --modes remote --peer http://127.0.0.1:8090

Only the standard library: the engine package imports nothing of Django.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_ID = "stub-peer"


@dataclass
class Received:
    """One chat request the stub answered: its body and the client's (host, port), i.e. its connection."""

    body: dict
    client: tuple[str, int]
    headers: dict = field(default_factory=dict)


class StubPeer(ThreadingHTTPServer):
    daemon_threads = True
    # A burst opens its connections all at once: the default backlog of 5 would make some clients
    # wait for a SYN retry (1 s), which is no part of either side's latency.
    request_queue_size = 256

    def __init__(self, port: int = 0, *, first_byte_s: float = 0.0, token_s: float = 0.002, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.first_byte_s = first_byte_s
        self.token_s = token_s
        self.received: list[Received] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that closed its kept-alive connection: nothing went wrong
        super().handle_error(request, client_address)

    def start(self) -> StubPeer:
        """Serve on a daemon thread (tests, the bench's own test); stop with shutdown() and server_close()."""
        threading.Thread(target=self.serve_forever, name="stub-peer", daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a pooled client reuses its connection
    server: StubPeer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            self._whole(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})
        else:
            self._whole(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._whole(404, {"error": {"message": f"no route {self.path}"}})
            return
        self.server.record(Received(body, self.client_address[:2], dict(self.headers)))
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        time.sleep(self.server.first_byte_s)
        try:
            for index in range(tokens):
                if index:
                    time.sleep(self.server.token_s)
                self._event({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL_ID,
                             "choices": [{"index": 0, "delta": {"content": f"t{index} "}, "finish_reason": None}]})
            self._event({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL_ID,
                         "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            self._event({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL_ID, "choices": [],
                         "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens}})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")  # the chunked body's end: the connection stays open for the next request
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client hung up (a cancel): stop generating

    def _event(self, data: dict) -> None:
        self._chunk(b"data: " + json.dumps(data).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _whole(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--first-byte-ms", type=float, default=2000.0, help="from the request to its first chunk")
    parser.add_argument("--token-ms", type=float, default=20.0, help="between one chunk and the next")
    args = parser.parse_args()
    server = StubPeer(args.port, first_byte_s=args.first_byte_ms / 1000, token_s=args.token_ms / 1000, host=args.host)
    print(f"stub peer on {server.url}: first chunk after {args.first_byte_ms:g} ms, then one per {args.token_ms:g} ms", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
