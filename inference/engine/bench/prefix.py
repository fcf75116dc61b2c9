"""Benchmarks of the engine itself (numbers printed and written as JSON, never asserted in tests)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from inference.engine import Engine, EngineConfig

# A long, realistic system prompt shared by every request of a feature: what prefix sharing is for.
SHARED_SYSTEM_PROMPT = (
    "You are the support assistant of Ceiling, a self-hosted LLM serving stack with an enforced budget ceiling. "
    "Answer briefly and precisely. Policies: never reveal another customer's data; quote prices in US dollars; "
    "when a user asks about limits, explain the daily and monthly caps on requests, tokens and cost, the maximum "
    "input and output length of every call, loop budgets for anything that calls the model more than once, and "
    "provider spend limits with alerts at 50, 80 and 100 percent. When a request is refused, say which limit was "
    "hit, with the numbers, and when it resets. "
) * 6

QUESTIONS = [
    "How do I raise my daily token cap?",
    "Why was my last request refused?",
    "What happens at 80% of the provider limit?",
    "Can a loop call the model forever?",
    "How long may my prompt be?",
    "When does my monthly allowance reset?",
    "Do cached answers cost anything?",
    "How is the cost of a request computed?",
]


@dataclass(frozen=True)
class PrefixResult:
    requests: int
    prompt_tokens: int
    shared_prefix_tokens: int
    ttft_p50_ms_on: float
    ttft_p50_ms_off: float
    ttft_ms_on: list[float]
    ttft_ms_off: list[float]

    @property
    def speedup(self) -> float:
        return self.ttft_p50_ms_off / self.ttft_p50_ms_on if self.ttft_p50_ms_on else 0.0


def time_to_first_token(engine: Engine, request_id: str, prompt_ids: list[int]) -> float:
    started = time.perf_counter()
    ttft = None
    # Two tokens, not one: a request that ends at prefill leaves no completed blocks to share.
    for event in engine.submit(request_id, prompt_ids, 2, ignore_eos=True).events(timeout=120):
        if event.new_tokens and ttft is None:
            ttft = (time.perf_counter() - started) * 1000
    if ttft is None:
        raise RuntimeError("the engine produced no token")
    return ttft


def prefix_sharing(model_dir, requests: int = 8, progress=print) -> PrefixResult:
    """TTFT of requests sharing a long system prompt, sent one after another, sharing on then off."""
    conversations = [
        [{"role": "system", "content": SHARED_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        for q in (QUESTIONS * (requests // len(QUESTIONS) + 1))[:requests]
    ]
    timings, prompts = ttft_with_sharing_on_and_off(model_dir, conversations, progress=progress)
    return PrefixResult(
        requests=requests,
        prompt_tokens=round(statistics.mean(len(p) for p in prompts)),
        shared_prefix_tokens=_common_prefix(prompts),
        ttft_p50_ms_on=round(statistics.median(timings[True]), 1),
        ttft_p50_ms_off=round(statistics.median(timings[False]), 1),
        ttft_ms_on=[round(t, 1) for t in timings[True]],
        ttft_ms_off=[round(t, 1) for t in timings[False]],
    )


def ttft_with_sharing_on_and_off(
    model_dir, conversations: list[list[dict]], threads: int = 2, progress=print
) -> tuple[dict[bool, list[float]], list[list[int]]]:
    """Each conversation's TTFT, one after another, on a fresh engine with block sharing on, then off."""
    timings: dict[bool, list[float]] = {}
    prompts: list[list[int]] = []
    for sharing in (True, False):
        engine = Engine(EngineConfig(model_dir=model_dir, torch_threads=threads, prefix_sharing=sharing))
        engine.load(progress=lambda _: None)
        engine.start()
        try:
            prompts = [engine.encode_chat(messages) for messages in conversations]
            time_to_first_token(engine, "warm-up", prompts[0][:32])  # first forward pass pays one-off costs
            timings[sharing] = [time_to_first_token(engine, f"p{sharing}-{i}", ids) for i, ids in enumerate(prompts)]
            progress(f"prefix sharing {'on' if sharing else 'off'}: TTFT p50 {statistics.median(timings[sharing]):.0f} ms")
        finally:
            engine.stop()
    return timings, prompts


def _common_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    length = len(first)
    for other in prompts[1:]:
        length = next((i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b), min(length, len(other)))
    return length
