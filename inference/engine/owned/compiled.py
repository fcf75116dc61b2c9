"""Decode steps as compiled graphs (torch.compile, inductor's CPU backend), one per batch bucket.

A decode step of a few rows is one token per request through every layer: the arithmetic is small
and the time goes to dispatching ~60 small ops per layer (norms, rotary, slicing, casts around the
4-bit kernel, residual adds). Inductor fuses the elementwise ones into a few C++ loops per layer and
calls the matmul kernels (int4, int8, fp32) as they are, so each weight variant keeps its numerics.

Static shapes in a few buckets: a decode-only step of n requests runs in the graph of the smallest
bucket ≥ n (1, 2, 4, 8 by default), its rows padded with rows that write to a scratch block of the
cache no request owns and whose logits are dropped. The cached length is a symbolic size
(`dynamic=True`), so one compile per bucket serves every length. Steps that carry prompt chunks, or
more rows than the largest bucket, keep the eager path (runner.py): there the matmuls dominate.

Compiling takes about a minute per bucket on 2 cores, so it never holds up serving: `DecodeCompiler`
compiles every bucket in a thread of its own on a small scratch cache while the loop serves eagerly,
then times each compiled bucket against the same step run eagerly and hands the runner only the
buckets that measure faster (`MIN_GAIN`), all at once (dynamo's stance is process-wide: the loop's
`fail_on_recompile` must not meet a compile in progress). A call the graph's guards would reject (a
recompile, another minute in the loop's thread) is stepped eagerly instead, and counted.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..measured import KeptMeasurements, kept_note
from .kv import from_cache, row_width, to_cache
from .rows import DecodeRow, decode_arguments, rotate

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8)
MIN_GAIN = 0.05  # a compiled bucket must be at least 5% faster than eager to be used
_TIMED_STEPS = 12
_LONGEST_SCRATCH = 60 + _TIMED_STEPS + 1  # the longest row the compile and the timing step


@dataclass
class BucketTiming:
    rows: int
    eager_ms: float
    compiled_ms: float

    @property
    def faster(self) -> bool:
        return self.compiled_ms <= (1 - MIN_GAIN) * self.eager_ms


@dataclass
class CompileReport:
    """What compiling the decode steps found; the engine's stats carry it, the worker logs it."""

    state: str = "compiling"  # compiling → used (some bucket is faster) | slower | failed
    compile_seconds: float = 0.0
    buckets: list[BucketTiming] = field(default_factory=list)
    error: str = ""
    fallbacks: int = 0  # steps the graphs' guards refused, served eagerly instead
    timings: list = field(default_factory=list)  # (round, rows, "eager" | "compiled", ms)
    kept: bool = False  # the verdicts are an earlier start's on this machine (inference/engine/measured.py)

    def describe(self) -> str:
        if self.state == "failed":
            return f"compiling the decode steps failed ({self.error}): eager steps"
        if self.state == "compiling":
            return "compiling the decode steps…"
        parts = [
            f"{b.rows} row{'s' if b.rows > 1 else ''} eager {b.eager_ms:.1f} ms vs compiled {b.compiled_ms:.1f} ms"
            f"{'' if b.faster else ' (eager kept)'}"
            for b in self.buckets
        ]
        return f"decode steps compiled in {self.compile_seconds:.0f} s: " + "; ".join(parts) + kept_note(self.kept)

    def as_dict(self) -> dict:
        return {
            "state": self.state, "compile_s": round(self.compile_seconds, 1), "fallbacks": self.fallbacks,
            "error": self.error,
            "buckets": [{"rows": b.rows, "eager_ms": round(b.eager_ms, 2), "compiled_ms": round(b.compiled_ms, 2),
                         "used": b.faster} for b in self.buckets],
        }


def decode_step_function(runner) -> Callable:
    """A decode step of B rows through every layer, as plain torch code dynamo can trace.

    Arguments: the rows' hidden states [B, hidden], their rotary cos/sin [B, 1, head_dim], the
    per-layer K and V caches, the slot each row's K/V go to ([B]), the slots each row reads
    ([B, L]: positions 0…L-1, padded past a shorter row's end), the number of positions each row
    sees ([B]) and their mask ([B, 1, 1, L], None for a lone row; unused where the runner attends
    on Ceiling's kernel, which reads the slots in place and stops at each row's length). Slots rather than views of consecutive blocks:
    a request whose prompt shares a prefix block, or whose blocks came back from the free list out
    of order, takes the same graph. Returns the logits [B, vocab].
    """
    heads, kv_heads, head_dim = runner.heads, runner.kv_heads, runner.head_dim
    hidden_size, eps, intermediate = runner.hidden, runner.eps, runner.intermediate
    layers, final_norm, lm_head = runner.layers, runner.final_norm, runner.lm_head

    paged_attention = runner.paged_attention

    def decode_step(hidden, cos, sin, k_caches, v_caches, write_slots, read_slots, lengths, mask):
        rows = hidden.shape[0]
        for layer, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
            x = F.rms_norm(hidden, (hidden_size,), layer.input_norm, eps)
            qkv = layer.qkv(x).view(rows, heads + 2 * kv_heads, head_dim)
            qk = rotate(qkv[:, : heads + kv_heads], cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            k_cache[write_slots] = to_cache(k, k_cache.dtype)
            v_cache[write_slots] = to_cache(v, v_cache.dtype)
            if paged_attention:
                attended = torch.ops.ceiling.decode_attention(q.contiguous(), k_cache, v_cache, read_slots, lengths)
            else:
                keys = from_cache(k_cache[read_slots], q.dtype).transpose(1, 2)  # [B, kv_heads, L, head_dim]
                values = from_cache(v_cache[read_slots], q.dtype).transpose(1, 2)
                queries = q.unsqueeze(2)  # [B, heads, 1, head_dim]
                attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
            hidden = hidden + layer.o(attended.reshape(rows, -1).to(hidden.dtype))
            x = F.rms_norm(hidden, (hidden_size,), layer.post_norm, eps)
            gate_up = layer.gate_up(x)
            hidden = hidden + layer.down(F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:])
        return lm_head(F.rms_norm(hidden, (hidden_size,), final_norm, eps))

    return _with_code_of_its_own(decode_step)


_step_functions = itertools.count(1)


def _with_code_of_its_own(function: Callable) -> Callable:
    """The same function over a copy of its code object. Dynamo keeps its compiled graphs on the code
    object, so each runner's step gets a cache of its own: a second engine in the process (another
    variant, another layout of its weights) can never be handed the first one's graph, even with
    the guards on the model's modules skipped."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_step_functions)}")
    copy = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    copy.__qualname__ = f"{function.__qualname__}_{code.co_name}"
    return copy


class DecodeCompiler:
    """Compiles a runner's decode buckets in a thread of its own and installs those that are faster."""

    def __init__(self, runner, threads: int, cache_dir: Path | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, kept: KeptMeasurements | None = None) -> None:
        self.runner = runner
        self.kept = kept or KeptMeasurements(None)  # the verdict per bucket, from an earlier start on this machine
        self.threads = threads
        self.cache_dir = cache_dir
        self.buckets = sorted(set(buckets))
        self.report = CompileReport()
        self.compiled_steps: dict[int, Callable] = {}  # every compiled bucket, used or not
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-compile-decode", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.threads)
            if self.cache_dir is not None:  # Engine.load sets it first; this serves a runner built without one
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.cache_dir))
            self._compile_and_choose()
        except Exception as exc:  # an inductor or compiler failure leaves the engine eager, and says why
            log.warning("compiling the decode steps failed: %s", exc, exc_info=True)
            self.report.state, self.report.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            log.info(self.report.describe())
            self.done.set()

    @torch.inference_mode()
    def _compile_and_choose(self) -> None:
        kept = self.kept.recall("compiled_decode")
        if kept is not None:
            self._compile_as_kept([BucketTiming(**bucket) for bucket in kept])
            return
        self._compile_and_time()
        self.kept.keep("compiled_decode", [asdict(bucket) for bucket in self.report.buckets])

    def _compile_as_kept(self, buckets: list[BucketTiming]) -> None:
        """Compile only the buckets an earlier start on this machine measured faster (none: nothing to
        compile), and use them without timing them again."""
        self.report.buckets, self.report.kept = buckets, True
        faster = [bucket.rows for bucket in buckets if bucket.faster]
        if not faster:
            self.report.state = "slower"
            return
        compiled, k_caches, v_caches = self._compiled_step_and_scratch(decode_step_function(self.runner))
        started = time.monotonic()
        for bucket in faster:
            compiled(*decode_arguments(self.runner, _scratch_rows(self.runner, bucket, 41), bucket, k_caches, v_caches))
        self.report.compile_seconds = time.monotonic() - started
        guarded = _guarded(compiled, self.report)
        self.compiled_steps = dict.fromkeys(faster, guarded)
        self.runner.decode_steps = dict(self.compiled_steps)  # one assignment: the loop sees all of them or none
        self.report.state = "used"

    def _compiled_step_and_scratch(self, eager: Callable) -> tuple[Callable, list[torch.Tensor], list[torch.Tensor]]:
        runner = self.runner
        # Dynamo's guards on the model's modules cost ~1 ms of a lone step's ~12 (one thread). The
        # runner's modules never change once loaded, and its step has a code object (so a graph
        # cache) of its own (decode_step_function): the guards on the modules can go.
        compiled = torch.compile(eager, dynamic=True,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        # A scratch cache of the live one's layout (one spare block, as runner.py's): the live cache
        # holds other requests' KV.
        dtype = runner.k_cache[0].dtype
        shape = ((_scratch_blocks(runner) + 1) * runner.page_size, runner.kv_heads, row_width(runner.head_dim, dtype))
        # Allocated outside inference mode, as the live cache is: dynamo guards on the dispatch keys,
        # and an inference tensor's differ from a normal one's (every live step would recompile).
        with torch.inference_mode(False):
            k_caches = [torch.zeros(shape, dtype=dtype, device=runner.device) for _ in runner.layers]
            v_caches = [torch.zeros(shape, dtype=dtype, device=runner.device) for _ in runner.layers]
        return compiled, k_caches, v_caches

    def _compile_and_time(self) -> None:
        runner = self.runner
        eager = decode_step_function(runner)
        compiled, k_caches, v_caches = self._compiled_step_and_scratch(eager)
        started = time.monotonic()
        for bucket in self.buckets:  # the first call of each shape compiles it
            compiled(*decode_arguments(runner, _scratch_rows(runner, bucket, 41), bucket, k_caches, v_caches))
        self.report.compile_seconds = time.monotonic() - started
        eager_ms: dict[int, list[float]] = {bucket: [] for bucket in self.buckets}
        compiled_ms: dict[int, list[float]] = {bucket: [] for bucket in self.buckets}
        for round_ in range(3):  # alternate, so a noisy neighbour slows both alike
            for bucket in self.buckets:
                for name, function, times in (("eager", eager, eager_ms), ("compiled", compiled, compiled_ms)):
                    times[bucket].append(_median_step_ms(runner, function, bucket, k_caches, v_caches))
                    self.report.timings.append((round_, bucket, name, times[bucket][-1]))
        self.report.buckets = [BucketTiming(b, min(eager_ms[b]), min(compiled_ms[b])) for b in self.buckets]
        guarded = _guarded(compiled, self.report)
        self.compiled_steps = {bucket: guarded for bucket in self.buckets}
        faster = {timing.rows: guarded for timing in self.report.buckets if timing.faster}
        runner.decode_steps = faster  # one assignment: the loop sees all of them or none
        self.report.state = "used" if faster else "slower"


def _scratch_blocks(runner) -> int:
    return -(-_LONGEST_SCRATCH // runner.page_size)


def _scratch_rows(runner, count: int, length: int) -> list[DecodeRow]:
    """`count` rows of lengths length, length-1, … on the scratch cache, each with its blocks in an
    order of its own (descending, then rotated), as live requests' blocks may come back from the
    free list. What they read is whatever earlier rows wrote: only the shapes and the time matter."""
    blocks = list(reversed(range(_scratch_blocks(runner))))
    return [DecodeRow(5 + index, blocks[index:] + blocks[:index], max(length - index, 1)) for index in range(count)]


def _median_step_ms(runner, function, bucket: int, k_caches, v_caches) -> float:
    times = []
    for length in range(60, 60 + _TIMED_STEPS):
        arguments = decode_arguments(runner, _scratch_rows(runner, bucket, length + 1), bucket, k_caches, v_caches)
        began = time.perf_counter()
        function(*arguments)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def _guarded(compiled: Callable, report: CompileReport) -> Callable:
    """The compiled step, or None where its guards would ask for a recompile (a minute in the loop's
    thread): the runner then takes the eager path for that step, and the report counts it."""

    def call(*arguments):
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*arguments)
        except RuntimeError as exc:
            if "Detected recompile" not in str(exc):
                raise
            if not report.fallbacks:  # the guard that failed says why; once is enough
                log.warning("a compiled decode step would recompile, stepping eagerly: %s", exc)
            report.fallbacks += 1
            return None

    return call
