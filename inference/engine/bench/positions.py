"""Time per output token by position: how much a long context slows a lone answer.

A decode step reads every weight once and every cached key and value of its request once; at a
few thousand positions the fp32 cache of a small model is as large as its 4-bit weights. This
measures a lone request's time per token after prompts of several lengths, for each KV cache
dtype asked for, in alternating rounds (each engine loaded once, kept idle while the other runs),
so a shared machine's slow minutes fall on every variant alike.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_POSITIONS = (0, 500, 1000, 2000)


@dataclass
class PositionRun:
    kv_dtype: str
    ms_per_token: dict[int, list[float]] = field(default_factory=dict)  # position → one figure per round
    decode_path: str = ""  # how decode steps ran: the stack's report (used, slower, unavailable) and why
    # Times the engine dropped to one thread, thinking another process held a core (owned/threads.py):
    # a step it ran on one thread is no measure of the cache's cost.
    thread_backoffs: int = 0

    def medians(self) -> dict[int, float]:
        return {position: round(statistics.median(runs), 2) for position, runs in self.ms_per_token.items()}

    def ratios(self) -> dict[int, float]:
        """Each position's median over position 0's (or the shortest measured)."""
        medians = self.medians()
        base = medians[min(medians)]
        return {position: round(value / base, 2) for position, value in medians.items()}

    def as_dict(self) -> dict:
        return {
            "kv_dtype": self.kv_dtype,
            "decode_path": self.decode_path,
            "thread_backoffs": self.thread_backoffs,
            "ms_per_token_median": {str(p): v for p, v in self.medians().items()},
            "ratio_to_first": {str(p): v for p, v in self.ratios().items()},
            "ms_per_token_runs": {str(p): [round(v, 2) for v in runs] for p, runs in self.ms_per_token.items()},
        }


def context_prompt(vocab_size: int, position: int, seed: int = 0) -> list[int]:
    """A prompt that leaves the next token at `position` (at least one token): fixed random ids, the
    same for every variant, so only the cache's dtype differs between them."""
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab_size) for _ in range(max(1, position))]


def measure_positions(model_dir: Path, kv_dtypes: list[str], positions: tuple[int, ...] = DEFAULT_POSITIONS,
                      tokens: int = 32, rounds: int = 3, threads: int = 2, engine_options: dict | None = None,
                      progress=print) -> list[PositionRun]:
    from inference.engine import Engine, EngineConfig

    engines = {}
    try:
        for kv_dtype in kv_dtypes:
            config = replace(EngineConfig(model_dir=model_dir, torch_threads=threads), **(engine_options or {}),
                             kv_dtype=kv_dtype)
            engine = Engine(config)
            engine.load(progress=lambda _: None)
            engine.start()
            engine.wait_for_compile(timeout=1800)
            engines[kv_dtype] = engine
        runs = {kv_dtype: PositionRun(kv_dtype, decode_path=decode_path(engine)) for kv_dtype, engine in engines.items()}
        vocab = next(iter(engines.values())).model.config.vocab_size
        for round_number in range(rounds):
            order = kv_dtypes if round_number % 2 == 0 else list(reversed(kv_dtypes))
            for kv_dtype in order:
                for position in positions:
                    ms = lone_ms_per_token(engines[kv_dtype], context_prompt(vocab, position), tokens)
                    runs[kv_dtype].ms_per_token.setdefault(position, []).append(ms)
                    progress(f"round {round_number + 1}, {kv_dtype} cache, position {position}: {ms:.2f} ms/token")
        for kv_dtype, engine in engines.items():
            runs[kv_dtype].thread_backoffs = engine.stats().thread_backoffs
        return [runs[kv_dtype] for kv_dtype in kv_dtypes]
    finally:
        for engine in engines.values():
            engine.stop()


def decode_path(engine) -> str:
    """A lone decode step runs in the stack (q4) or eagerly: the ratio is only fair between engines on the same path."""
    report = engine.stack_report()
    return "eager (no decode stack)" if report is None else report.describe()


def lone_ms_per_token(engine, prompt: list[int], tokens: int) -> float:
    """Milliseconds between a lone request's first and last tokens, per token (prefill left out)."""
    arrivals: list[float] = []
    handle = engine.submit(f"positions-{time.monotonic_ns()}", prompt, tokens + 1, ignore_eos=True)
    for event in handle.events(timeout=600):
        if event.error:
            raise RuntimeError(event.error)
        arrivals.extend(time.perf_counter() for _ in event.new_tokens)
    if len(arrivals) < 2:
        raise RuntimeError(f"the request produced {len(arrivals)} token(s)")
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1000
