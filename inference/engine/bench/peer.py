"""The `peer` mode: the same workload replayed against any OpenAI-compatible server, in the same run.

Each request goes out at its arrival time on its own thread as a streamed chat completion with the
workload's messages, `max_tokens` = its fixed output length, temperature 0 and `ignore_eos` (a
llama.cpp server extension; a server that ignores it may stop early, and the mode then reports the
tokens it really got). Time to first token is the first chunk carrying content; the token count
is the server's own `usage.completion_tokens` when it sends one, else one token per content chunk.
Only the standard library is used, so the bench needs nothing more to compare against a peer.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from inference.engine.bench.measure import BenchError, ModeResult, RequestTiming, summarise, timing_rows
from inference.engine.bench.workload import BenchRequest, labelled


def check_peer(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> str:
    """The peer's first model id; a sentence (BenchError) if it does not answer like an OpenAI server."""
    try:
        models_request = urllib.request.Request(f"{url.rstrip('/')}/v1/models", headers=headers or {})
        with urllib.request.urlopen(models_request, timeout=timeout) as response:
            models = json.load(response).get("data") or []
    except (OSError, ValueError) as exc:
        raise BenchError(f"the peer at {url} does not answer GET /v1/models like an OpenAI-compatible server: {exc}") from None
    return models[0]["id"] if models else "default"


def run_peer(url: str, requests: list[BenchRequest], lone_tokens: int = 64) -> ModeResult:
    model = check_peer(url)
    # The warm-up and the lone request carry labels of their own (workload.labelled): neither leaves
    # a workload prompt in the peer's prompt cache.
    warm_up, lone_request = labelled([requests[0]], "warm-up")[0], labelled([requests[0]], "lone")[0]
    stream_one(url, model, warm_up, RequestTiming(-1, time.perf_counter()), max_tokens=2)
    timings = replay(url, model, requests)
    summary = summarise(timings, peak_rss_mb=0.0)  # the peer's memory is its own process's: not measured
    lone = RequestTiming(-2, time.perf_counter())
    stream_one(url, model, lone_request, lone, max_tokens=lone_tokens)
    extra = {"peer_url": url, "peer_model": model, "tpot_ms_at_1": _rounded(lone.tpot_ms)}
    return ModeResult(summary, extra=extra, timings=timing_rows(timings))


def replay(url: str, model: str, requests: list[BenchRequest], *, headers: dict[str, str] | None = None,
           extra_body: dict | None = None) -> list[RequestTiming]:
    """Every request at its arrival time, each on its own thread; their timings once all have ended.

    `headers` and `extra_body` go with every request: the bench's remote mode sends the same burst
    through Ceiling's /v1 with an API key and the feature that forwards to the peer.
    """
    start = time.perf_counter()
    timings = [RequestTiming(r.index, arrival=start + r.arrival_s) for r in requests]
    threads = []
    for request, timing in zip(requests, timings, strict=True):
        delay = timing.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=stream_one, args=(url, model, request, timing),
                                  kwargs={"headers": headers, "extra_body": extra_body}, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    return timings


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def stream_one(url: str, model: str, request: BenchRequest, timing: RequestTiming, max_tokens: int | None = None, *,
                headers: dict[str, str] | None = None, extra_body: dict | None = None) -> None:
    body = {
        "model": model,
        "messages": request.messages,
        "max_tokens": max_tokens or request.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }
    http_request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})}, method="POST",
    )
    chunks = 0
    usage_tokens = None
    try:
        with urllib.request.urlopen(http_request, timeout=600) as response:
            timing.request_id = response.headers.get("X-Request-Id")  # Ceiling's, to find its ledger row
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if any((choice.get("delta") or {}).get("content") for choice in event.get("choices") or []):
                    chunks += 1
                    timing.finished = time.perf_counter()
                    if timing.first_token is None:
                        timing.first_token = timing.finished
    except (OSError, ValueError, urllib.error.HTTPError) as exc:
        timing.error = f"the peer failed: {exc}"
        return
    timing.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if timing.first_token is None:
        timing.error = "the peer streamed no content"
