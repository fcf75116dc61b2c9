"""Time per output token by position: how much a long context slows a lone answer.

A decode step reads every weight once and every cached key and value of its request once; at a
few thousand positions the fp32 cache of a small model is as large as its 4-bit weights. This
measures a lone request's time per token after prompts of several lengths, for each KV cache
dtype asked for, in alternating rounds, so a shared machine's slow minutes fall on every variant alike.

Each dtype's engine lives in a process of its own, loaded once and kept idle while the other runs,
as a worker holds one engine per process. Both engines in this command's process slowed each other:
on a 2-core Intel Xeon position 0 took 10.5-10.8 ms a token there, 3.56-3.66 with one engine per
process (the bench's lone request: 3.77 in the same hour), so the short positions looked slow and
the ratios to them looked better than a worker's (fp16 at 2,000 positions 1.29× there, 2.21× here).
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
import traceback
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


class PositionsError(RuntimeError):
    """An engine's process failed to load or to answer: the message says which dtype and why."""


def measure_positions(model_dir: Path, kv_dtypes: list[str], positions: tuple[int, ...] = DEFAULT_POSITIONS,
                      tokens: int = 32, rounds: int = 3, threads: int = 2, engine_options: dict | None = None,
                      progress=print, timeout: float = 1800) -> list[PositionRun]:
    engines: dict[str, _EngineProcess] = {}
    try:
        for kv_dtype in kv_dtypes:  # loaded one after another: a load's own threads never meet a measurement
            engines[kv_dtype] = _EngineProcess(model_dir, kv_dtype, threads, engine_options or {}, timeout)
        runs = {kv_dtype: PositionRun(kv_dtype, decode_path=engine.decode_path) for kv_dtype, engine in engines.items()}
        for round_number in range(rounds):
            order = kv_dtypes if round_number % 2 == 0 else list(reversed(kv_dtypes))
            for kv_dtype in order:
                for position in positions:
                    ms = engines[kv_dtype].ask("measure", position, tokens)
                    runs[kv_dtype].ms_per_token.setdefault(position, []).append(ms)
                    progress(f"round {round_number + 1}, {kv_dtype} cache, position {position}: {ms:.2f} ms/token")
        for kv_dtype, engine in engines.items():
            runs[kv_dtype].thread_backoffs = engine.ask("thread_backoffs")
        return [runs[kv_dtype] for kv_dtype in kv_dtypes]
    finally:
        for engine in engines.values():
            engine.close()


class _EngineProcess:
    """One KV dtype's engine in a spawned process, answering measure requests over a pipe."""

    def __init__(self, model_dir: Path, kv_dtype: str, threads: int, engine_options: dict, timeout: float) -> None:
        self.kv_dtype, self.timeout = kv_dtype, timeout
        context = multiprocessing.get_context("spawn")
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve_engine, args=(child_end, str(model_dir), kv_dtype, threads, engine_options),
                                       name=f"positions-{kv_dtype}", daemon=True)
        self.process.start()
        child_end.close()
        self.decode_path = self._answer()

    def ask(self, *command):
        self.connection.send(command)
        return self._answer()

    def _answer(self):
        if not self.connection.poll(self.timeout):
            raise PositionsError(f"the {self.kv_dtype} engine did not answer within {self.timeout:.0f} s")
        try:
            kind, value = self.connection.recv()
        except EOFError:
            raise PositionsError(f"the {self.kv_dtype} engine's process died (exit code {self.process.exitcode})") from None
        if kind == "error":
            raise PositionsError(f"the {self.kv_dtype} engine failed: {value}")
        return value

    def close(self) -> None:
        try:
            self.connection.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


def _serve_engine(connection, model_dir: str, kv_dtype: str, threads: int, engine_options: dict) -> None:
    """In the child: load one engine, say how its decode steps run, then time what the parent asks for."""
    from inference.engine import Engine, EngineConfig

    engine = None
    try:
        config = replace(EngineConfig(model_dir=Path(model_dir), torch_threads=threads), **engine_options, kv_dtype=kv_dtype)
        engine = Engine(config)
        engine.load(progress=lambda _: None)
        engine.start()
        engine.wait_for_compile(timeout=1800)
        vocab = engine.model.config.vocab_size
        connection.send(("ok", decode_path(engine)))
        while True:
            command = connection.recv()
            if command[0] == "stop":
                return
            if command[0] == "thread_backoffs":
                connection.send(("ok", engine.stats().thread_backoffs))
                continue
            _, position, tokens = command
            connection.send(("ok", lone_ms_per_token(engine, context_prompt(vocab, position), tokens)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent with its traceback
        connection.send(("error", f"{exc}\n{traceback.format_exc()}"))
    finally:
        if engine is not None:
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
