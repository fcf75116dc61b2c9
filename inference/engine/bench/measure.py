"""What one mode of the benchmark measured, summarised as vLLM's `bench serve` does.

TTFT = first token − arrival; e2e = last token − arrival; TPOT = (e2e − TTFT) / (output tokens − 1);
output tokens/s = all output tokens / (last finish − first arrival).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

import torch

MODE_KEYS = (
    "requests",
    "output_tokens",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "peak_rss_mb",
)


@dataclass
class RequestTiming:
    index: int
    arrival: float  # perf_counter seconds
    first_token: float | None = None
    finished: float | None = None  # the last token's arrival (vLLM's e2e ends there)
    done: float | None = None  # the stack's `done` frame, sent once the ledger row is settled
    output_tokens: int = 0
    error: str | None = None
    request_id: str | None = None  # the stack's: from its `accepted` frame, to find its ledger row

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.arrival) * 1000

    @property
    def e2e_ms(self) -> float:
        return (self.finished - self.arrival) * 1000

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def done_after_last_token_ms(self) -> float | None:
        """How long after the last token the stack's `done` frame came (the ledger's settlement); None without one."""
        if self.done is None or self.finished is None:
            return None
        return (self.done - self.finished) * 1000

    def record_chat_frame(self, message: dict, now: float) -> bool:
        """Time one frame of Ceiling's chat socket; True once the chat has ended (done, error or refused)."""
        kind = message["type"]
        if kind == "accepted":
            self.request_id = message["request_id"]
        elif kind == "token":
            self.first_token = self.first_token or now
            self.finished = now  # the last token ends e2e, as the peer's last chunk does
        elif kind == "done":
            self.done, self.finished = now, self.finished or now
            self.output_tokens = message["usage"]["completion_tokens"]
            return True
        elif kind in ("error", "refused"):
            self.error = f"{kind} {message.get('code')}: {message.get('message')}"
            return True
        return False


@dataclass
class ModeResult:
    """One mode's figures: `summary` has exactly MODE_KEYS; `extra` what only some modes have."""

    summary: dict
    extra: dict = field(default_factory=dict)
    timings: list[dict] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so p50 of two values is their mean."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarise(timings: list[RequestTiming], peak_rss_mb: float) -> dict:
    done = [t for t in timings if t.error is None and t.finished is not None and t.first_token is not None]
    failed = [t for t in timings if t not in done]
    if failed:
        raise BenchError(f"{len(failed)} of {len(timings)} requests failed: {failed[0].error or 'no answer'}")
    span = max(t.finished for t in done) - min(t.arrival for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    ttft = [t.ttft_ms for t in done]
    tpot = [t.tpot_ms for t in done if t.tpot_ms is not None]
    e2e = [t.e2e_ms for t in done]
    return {
        "requests": len(done),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / span, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "tpot_p50_ms": round(percentile(tpot, 50), 1),
        "tpot_p99_ms": round(percentile(tpot, 99), 1),
        "e2e_p50_ms": round(percentile(e2e, 50), 1),
        "e2e_p99_ms": round(percentile(e2e, 99), 1),
        "peak_rss_mb": round(peak_rss_mb, 1),
    }


def timing_rows(timings: list[RequestTiming]) -> list[dict]:
    return [
        {
            "index": t.index,
            "output_tokens": t.output_tokens,
            "ttft_ms": round(t.ttft_ms, 1),
            "e2e_ms": round(t.e2e_ms, 1),
            "tpot_ms": None if t.tpot_ms is None else round(t.tpot_ms, 2),
        } | ({} if t.done_after_last_token_ms is None else {"done_after_last_token_ms": round(t.done_after_last_token_ms, 1)})
        for t in timings
    ]


class BenchError(RuntimeError):
    pass


# --- memory ----------------------------------------------------------------------------------


def own_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def process_peak_rss_mb(pid: int) -> float:
    """VmHWM of another live process (its peak resident set), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) another live process has used so far, 0 if it is gone.

    A process's CPU per request does not depend on how busy the machine is, where its latency does.
    """
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# --- the machine -----------------------------------------------------------------------------


def measured_flops(threads: int, sizes: tuple[int, ...] = (512, 1024, 2048), seconds: float = 1.0) -> float:
    """Best fp32 matmul FLOP/s over a few sizes, on the threads the engine uses."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            a @ b  # warm-up: first call allocates and picks a kernel
            runs, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds / len(sizes):
                a @ b
                runs += 1
            best = max(best, 2 * n**3 * runs / (time.perf_counter() - started))
    finally:
        torch.set_num_threads(previous)
    return best


def measured_copy_bandwidth(threads: int, megabytes: int = 256, seconds: float = 1.0) -> float:
    """Bytes per second that one large tensor copy moves (each byte read once and written once).

    The ceiling of a decode step that must read every weight once: a lone request's
    memory-bandwidth roofline is this ÷ the bytes it reads per step.
    """
    torch.set_num_threads(threads)
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: page in both buffers
    copies, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        target.copy_(source)
        copies += 1
    return 2 * source.nbytes * copies / (time.perf_counter() - started)


def roofline_tokens_per_s(flops: float, parameters: int) -> float:
    """Decode costs ~2 FLOPs per parameter per token: the compute-bound ceiling of tokens/s."""
    return flops / (2 * parameters)


def machine_facts(threads: int) -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "device": "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
