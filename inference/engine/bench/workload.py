"""The benchmark's workload: the same requests, in the same order, for every mode it compares.

Chat-like questions from prompts.json; output lengths long-tailed between 8 and 256 tokens and fixed
per request (EOS ignored), so every mode does exactly the same work; a fraction of the requests
share a long system prompt (what prefix caching is for); arrivals all at once or Poisson.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from inference.engine.bench.prefix import SHARED_SYSTEM_PROMPT

PROMPTS_FILE = Path(__file__).with_name("prompts.json")
MIN_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS = 8, 256
SHORT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly."


@dataclass(frozen=True)
class BenchRequest:
    index: int
    messages: list[dict]
    output_tokens: int  # generated exactly, EOS ignored
    shared_prefix: bool
    arrival_s: float  # offset from the start of the run


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 64
    seed: int = 0
    shared_fraction: float = 0.25
    rate: float | None = None  # requests per second (Poisson); None = all at once
    max_output_tokens: int = MAX_OUTPUT_TOKENS  # lower only for smoke runs (the suite's)

    def as_dict(self) -> dict:
        return asdict(self)


def load_prompts() -> list[str]:
    return json.loads(PROMPTS_FILE.read_text())["prompts"]


def long_tailed_length(rng: random.Random, cap: int = MAX_OUTPUT_TOKENS) -> int:
    """Log-normal with a median of ~40 tokens: most answers short, a few run to the 256 cap."""
    value = math.exp(rng.gauss(math.log(40), 0.9))
    return max(min(MIN_OUTPUT_TOKENS, cap), min(cap, round(value)))


def mixed_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    prompts = load_prompts()
    arrival = 0.0
    requests = []
    for index in range(spec.requests):
        shared = rng.random() < spec.shared_fraction
        system = SHARED_SYSTEM_PROMPT if shared else SHORT_SYSTEM_PROMPT
        question = prompts[rng.randrange(len(prompts))]
        if spec.rate:
            arrival += rng.expovariate(spec.rate)
        requests.append(
            BenchRequest(
                index=index,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                output_tokens=long_tailed_length(rng, spec.max_output_tokens),
                shared_prefix=shared,
                arrival_s=round(arrival, 4) if spec.rate else 0.0,
            )
        )
    return requests


def labelled(requests: list[BenchRequest], label: str) -> list[BenchRequest]:
    """The same requests with `[label]` at the start of every system prompt.

    A server that keeps prompts cached between requests answers a burst it has seen before from its
    cache: llama.cpp's server keeps each slot's last prompt (`cache_prompt`), and in a bench's second
    and third rounds it evaluated 1 token of most prompts, the shared ~780-token system prompt
    included, while the engine and stack modes start every round in a fresh process. So each round
    (and each warm-up, and each send of the remote mode) gets a label of its own: no mode finds an
    earlier round's prompts in a cache, and within a round the shared-prefix requests still share
    their system prompt with each other, which is what prefix caching is for.
    """
    return [replace(request, messages=[_with_label(message, label) for message in request.messages]) for request in requests]


def _with_label(message: dict, label: str) -> dict:
    if message["role"] != "system":
        return message
    return {**message, "content": f"[{label}] {message['content']}"}


def describe(spec: WorkloadSpec, requests: list[BenchRequest], prompt_lengths: list[int]) -> dict:
    outputs = [r.output_tokens for r in requests]
    return {
        **spec.as_dict(),
        "arrivals": f"poisson at {spec.rate}/s" if spec.rate else "all at once",
        "shared_prefix_requests": sum(r.shared_prefix for r in requests),
        "prompt_tokens_total": sum(prompt_lengths),
        "prompt_tokens_min": min(prompt_lengths),
        "prompt_tokens_max": max(prompt_lengths),
        "output_tokens_total": sum(outputs),
        "output_tokens_min": min(outputs),
        "output_tokens_median": sorted(outputs)[len(outputs) // 2],
        "output_tokens_max": max(outputs),
    }
