"""A bounded load run against a running Ceiling on this machine: many sockets open, some chatting.

    report = asyncio.run(run_load(LoadPlan(base_url, cookie, connections=200, chatting=50, max_tokens=16)))

Every socket is opened at once and held open; `chatting` of them send one chat each. While they
stream, a probe fetches an HTTP page and pings an idle socket every second, to show whether the
server stays responsive. The report (JSON-ready) holds latencies (p50/p99), counts and errors, and
the request ids, so a caller can check the ledger settled every one. Loopback only: this is a test
tool, never a way to load someone else's server.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse

from websockets.asyncio.client import connect

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
PROMPT = "Name one thing you like about the sea, in one short sentence."


class NotLoopback(ValueError):
    pass


@dataclass(frozen=True)
class LoadPlan:
    base_url: str  # http://127.0.0.1:8000
    cookie: str  # a session cookie value of the user the chats run as
    connections: int = 200
    chatting: int = 50
    max_tokens: int = 16
    timeout_s: float = 120.0  # the whole run, connecting to the last answer
    # Handshakes in flight at once. All 200 at the same instant exceed daphne's 5 s connect timeout
    # on a 2-core machine (each handshake's session lookup queues for the one thread-sensitive
    # database thread), so sockets are opened this many at a time, then all held open together.
    handshakes_at_once: int = 16
    feature: str = "chat"

    def __post_init__(self) -> None:
        host = urlparse(self.base_url).hostname
        if host not in LOOPBACK_HOSTS:
            raise NotLoopback(f"{self.base_url} is not this machine; the load test only runs against loopback")
        if not 0 < self.chatting <= self.connections:
            raise ValueError("chatting must be between 1 and the number of connections")

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http", "ws", 1).rstrip("/") + "/ws/chat/"


@dataclass
class ChatResult:
    outcome: str  # done | refused | error | timeout | closed
    request_id: str = ""
    ttft_ms: float | None = None
    total_ms: float | None = None
    completion_tokens: int = 0
    detail: str = ""


async def run_load(plan: LoadPlan) -> dict:
    started = time.monotonic()
    deadline = started + plan.timeout_s
    sockets, connect_ms, connect_errors = await _open_all(plan)
    errors = list(connect_errors)
    chatters, idle = sockets[: plan.chatting], sockets[plan.chatting :]
    stop_probing = asyncio.Event()
    probe = asyncio.ensure_future(_probe(plan, idle[0] if idle else None, stop_probing))
    results = await asyncio.gather(*(_chat(ws, plan, deadline) for ws in chatters))
    stop_probing.set()
    probes = await probe
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    errors += [f"chat {r.outcome}: {r.detail}" for r in results if r.outcome not in ("done", "refused")]
    errors += probes.pop("errors")
    return {
        "plan": {"connections": plan.connections, "chatting": plan.chatting, "max_tokens": plan.max_tokens, "timeout_s": plan.timeout_s},
        "wall_s": round(time.monotonic() - started, 2),
        "connections": {"opened": len(sockets), "failed": len(connect_errors), "connect_ms": summary(connect_ms)},
        "chats": {
            "sent": len(results),
            **{outcome: sum(r.outcome == outcome for r in results) for outcome in ("done", "refused", "error", "timeout", "closed")},
            "completion_tokens": sum(r.completion_tokens for r in results),
            "ttft_ms": summary([r.ttft_ms for r in results if r.ttft_ms is not None]),
            "total_ms": summary([r.total_ms for r in results if r.total_ms is not None]),
        },
        "responsiveness": probes,
        "errors": len(errors),
        "error_samples": errors[:20],
        "request_ids": [r.request_id for r in results if r.request_id],
    }


async def _open_all(plan: LoadPlan):
    gate = asyncio.Semaphore(plan.handshakes_at_once)

    async def open_one():
        async with gate:
            return await handshake()

    async def handshake():
        began = time.monotonic()
        ws = await connect(plan.ws_url, origin=plan.base_url.rstrip("/"), additional_headers={"Cookie": f"sessionid={plan.cookie}"},
                           open_timeout=30, ping_interval=None)
        return ws, (time.monotonic() - began) * 1000

    outcomes = await asyncio.gather(*(open_one() for _ in range(plan.connections)), return_exceptions=True)
    sockets = [o[0] for o in outcomes if not isinstance(o, BaseException)]
    connect_ms = [o[1] for o in outcomes if not isinstance(o, BaseException)]
    failures = [f"connect: {type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    return sockets, connect_ms, failures


async def _chat(ws, plan: LoadPlan, deadline: float) -> ChatResult:
    frame = {"type": "chat", "feature": plan.feature, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": plan.max_tokens}
    sent = time.monotonic()
    result = ChatResult("timeout")
    try:
        await ws.send(json.dumps(frame))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic())))
            kind = message["type"]
            result.request_id = message.get("request_id", result.request_id)
            if kind == "token" and result.ttft_ms is None:
                result.ttft_ms = (time.monotonic() - sent) * 1000
            if kind in ("done", "refused", "error"):
                result.outcome, result.total_ms = kind, (time.monotonic() - sent) * 1000
                result.completion_tokens = message.get("usage", {}).get("completion_tokens", 0)
                result.detail = message.get("code", "") + " " + message.get("message", "")
                return result
    except TimeoutError:
        result.detail = "no end before the run's time limit"
    except Exception as exc:  # noqa: BLE001 - a closed socket is a result to report, not a crash
        result.outcome, result.detail = "closed", f"{type(exc).__name__}: {exc}"
    return result


async def _probe(plan: LoadPlan, idle_ws, stop: asyncio.Event, every_s: float = 1.0) -> dict:
    """An HTTP page and a websocket ping every second while the chats run: are we still answered?"""
    http_ms, ping_ms, errors = [], [], []
    page = plan.base_url.rstrip("/") + "/accounts/login/"
    while not stop.is_set():
        began = time.monotonic()
        try:
            await asyncio.to_thread(_fetch, page)
            http_ms.append((time.monotonic() - began) * 1000)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"http probe: {type(exc).__name__}: {exc}")
        if idle_ws is not None:
            began = time.monotonic()
            try:
                await asyncio.wait_for(await idle_ws.ping(), timeout=30)
                ping_ms.append((time.monotonic() - began) * 1000)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"websocket ping: {type(exc).__name__}: {exc}")
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except TimeoutError:
            pass
    return {"http_page_ms": summary(http_ms), "websocket_ping_ms": summary(ping_ms), "errors": errors}


def _fetch(url: str) -> None:
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - loopback only, checked in LoadPlan
        response.read()


def summary(values: list[float]) -> dict:
    """count, p50, p99 and max in milliseconds (nearest-rank percentiles)."""
    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(round(p * len(ordered) + 0.5)) - 1))], 1)

    return {"count": len(ordered), "p50": rank(0.50), "p99": rank(0.99), "max": round(ordered[-1], 1)}
