"""Decode steps in one call into C++: the kernels' DecodeStack runs every layer of a step.

A lone decode step through SmolLM2's 30 layers is ~150 kernel calls. As a compiled graph
(compiled.py) its arithmetic took ~5 ms of a ~7.4 ms step on a 2-core AMD EPYC; the rest went to
calling them (dynamo's entry, Python between the custom ops, inductor's small loops each forking
and joining OpenMP's threads). DecodeStack (inference/engine/kernels/lowbit.cpp) holds each
layer's 4-bit weights, norms and KV cache once and runs the norms, rotary, cache writes,
attention and activation itself, the whole step in one parallel region (torch's threads woken once
a step, meeting at a barrier after each product, not forked and joined ~150 times).

It serves an engine whose block linears are all on Ceiling's 4-bit kernels with an fp32, fp16 or int8 cache
(the q4 variant on a CPU), for decode-only steps of up to the rows the 4-bit route was measured
to win (`q4_max_rows`): the same kernels those steps' linears would call, so the same arithmetic
up to the rounding of its norms, rotary and SiLU (tests/test_decode_stack.py says how close).
The lm_head stays a Python call: its own routing (int8 or fp32) lives there.
`unavailable_reason` says why an engine cannot use it; the runner then keeps its other paths.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..measured import kept_note
from ..patches.quantization import OWN_KERNELS
from .scheduler import StepPlan
from .sequence import Sequence as Request

MIN_GAIN = 0.05  # as compiled.py's: the stack must be at least 5% faster than eager steps to be used
_TIMED_STEPS = 5
_ROUNDS = 3


def unavailable_reason(runner) -> str | None:
    """Why the stack cannot run this runner's decode steps, or None when it can."""
    if not runner.paged_attention:
        return "the activations are not fp32 on a CPU with Ceiling's kernels loaded"
    linears = [linear for layer in runner.layers for linear in layer.linears]
    if not linears or any(linear is None for linear in linears):
        return "q|k|v or gate|up did not fuse into one linear"
    if any(getattr(linear, "q4_kernel", None) != OWN_KERNELS or not hasattr(linear, "q4_weight") for linear in linears):
        return "the block linears are not 4-bit weights on Ceiling's kernels"
    if any(linear.bias is not None for layer in runner.layers for linear in layer.linears[1:]):
        return "o, gate|up or down has a bias"
    if max_rows(runner) < 1:
        return "the 4-bit route serves no decode rows on this machine"
    return None


def max_rows(runner) -> int:
    """The most decode rows a stacked step takes: where every block linear still reads its 4-bit weights."""
    return min(getattr(linear, "q4_max_rows", 0) for layer in runner.layers for linear in layer.linears)


def build(runner, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]):
    """A DecodeStack over the runner's weights and the given caches (the live ones, or a scratch pair)."""
    stack = torch.classes.ceiling.DecodeStack(
        runner.embed, runner.cos.contiguous(), runner.sin.contiguous(), runner.final_norm,
        runner.heads, runner.kv_heads, runner.page_size, float(runner.eps),
    )
    no_bias = torch.empty(0)
    for layer, k_cache, v_cache in zip(runner.layers, k_caches, v_caches, strict=True):
        qkv, o, gate_up, down = layer.linears
        stack.add_layer(
            layer.input_norm, layer.post_norm,
            qkv.q4_weight, qkv.q4_scales_and_zeros, no_bias if qkv.bias is None else qkv.bias.detach().contiguous(),
            o.q4_weight, o.q4_scales_and_zeros, gate_up.q4_weight, gate_up.q4_scales_and_zeros,
            down.q4_weight, down.q4_scales_and_zeros, k_cache, v_cache,
        )
    return stack


class StackedDecode:
    """Decode-only steps of up to `max_rows` rows through one DecodeStack call, then the lm_head."""

    def __init__(self, runner, k_caches: Sequence[torch.Tensor] | None = None,
                 v_caches: Sequence[torch.Tensor] | None = None) -> None:
        self.stack = build(runner, runner.k_cache if k_caches is None else k_caches,
                           runner.v_cache if v_caches is None else v_caches)
        self.lm_head = runner.lm_head
        self.max_rows = max_rows(runner)

    def __call__(self, tokens: list[int], lengths: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Logits [rows, vocab] of rows whose last token is tokens[r] at position lengths[r] - 1."""
        width = max(len(table) for table in block_tables)
        tables = [table + [0] * (width - len(table)) for table in block_tables]  # padding is never read
        normed = self.stack.step(torch.tensor(tokens), torch.tensor(lengths), torch.tensor(tables))
        return self.lm_head(normed)

    def decode(self, seqs) -> torch.Tensor:
        return self([seq.token_at(len(seq) - 1) for seq in seqs], [len(seq) for seq in seqs],
                    [seq.block_table for seq in seqs])


@dataclass
class StackTiming:
    rows: int
    eager_ms: float
    stacked_ms: float


@dataclass
class StackReport:
    """Whether decode steps run on the stack, and why; the engine's stats and the bench carry it."""

    state: str  # used | slower | unavailable
    reason: str = ""
    max_rows: int = 0
    timings: list[StackTiming] = field(default_factory=list)
    kept: bool = False  # the timings are an earlier start's on this machine (inference/engine/measured.py)

    def describe(self) -> str:
        if self.state == "unavailable":
            return f"decode steps in one C++ call: not here ({self.reason})"
        parts = "; ".join(f"{t.rows} row{'s' if t.rows > 1 else ''} eager {t.eager_ms:.1f} ms vs stacked "
                          f"{t.stacked_ms:.1f} ms" for t in self.timings)
        verb = "up to " + str(self.max_rows) + " rows" if self.state == "used" else "not used, slower"
        return f"decode steps in one C++ call, {verb}: {parts}{kept_note(self.kept)}"

    def as_dict(self) -> dict:
        return {"state": self.state, "reason": self.reason, "max_rows": self.max_rows,
                "timings": [{"rows": t.rows, "eager_ms": round(t.eager_ms, 2), "stacked_ms": round(t.stacked_ms, 2)}
                            for t in self.timings]}


def install(runner, rows_to_time: Sequence[int] = (1, 8)) -> StackReport:
    """Time stacked decode steps against the runner's eager ones and give the runner the stack if it
    is faster at every timed row count. Run in the loop thread before it serves: the timing writes
    only to the cache's scratch block, but its steps must not meet live ones."""
    reason = unavailable_reason(runner)
    if reason is not None:
        return StackReport("unavailable", reason)
    stacked = StackedDecode(runner)
    report = StackReport("slower", max_rows=stacked.max_rows)
    for rows in sorted({min(rows, stacked.max_rows) for rows in rows_to_time}):
        eager_ms, stacked_ms = _timed(runner, stacked, rows)
        report.timings.append(StackTiming(rows, eager_ms, stacked_ms))
    if all(t.stacked_ms <= (1 - MIN_GAIN) * t.eager_ms for t in report.timings):
        runner.stacked = stacked
        report.state = "used"
    return report


def install_as_kept(runner, kept: dict) -> StackReport:
    """Give the runner the stack as an earlier start on this machine decided (`kept`: a StackReport's
    as_dict()), without timing; the stack's own checks of the weights still run."""
    reason = unavailable_reason(runner)
    if reason is not None:
        return StackReport("unavailable", reason)
    stacked = StackedDecode(runner)
    report = StackReport(kept["state"], max_rows=stacked.max_rows, kept=True,
                         timings=[StackTiming(t["rows"], t["eager_ms"], t["stacked_ms"]) for t in kept["timings"]])
    if report.state == "used":
        runner.stacked = stacked
    return report


@torch.inference_mode()
def _timed(runner, stacked: StackedDecode, rows: int) -> tuple[float, float]:
    """Best-of-rounds median step time (ms) of `rows` decode rows, eager then stacked, alternating so a
    noisy neighbour slows both alike. Every row lives in the scratch block (runner.py allocates one
    block past those the block manager hands out)."""
    scratch = runner.k_cache[0].shape[0] // runner.page_size - 1
    seqs = []
    for row in range(rows):
        seq = Request(f"stack-timing-{row}", [11 + row] * (runner.page_size - 1), 1, frozenset())
        seq.block_table = [scratch]
        seq.append(13)
        seqs.append(seq)
    plan = StepPlan(decode=seqs)
    best = {"eager": float("inf"), "stacked": float("inf")}
    for _ in range(_ROUNDS):
        for name, step in (("eager", lambda: runner.step(plan)), ("stacked", lambda: stacked.decode(seqs))):
            times = []
            for _ in range(_TIMED_STEPS):
                began = time.perf_counter()
                step()
                times.append((time.perf_counter() - began) * 1000)
            best[name] = min(best[name], statistics.median(times))
    return best["eager"], best["stacked"]
