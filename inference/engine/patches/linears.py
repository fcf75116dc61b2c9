"""Linear layers for decode steps of a few tokens, as W · xᵀ instead of x · Wᵀ — where it is faster.

A decode step multiplies a few token rows (2…64) by every weight matrix of the model, so on CPU it
is bound by reading the weights from memory. torch's CPU build hands `F.linear(x, W)` to MKL as
x · Wᵀ, and on an AMD EPYC (AVX2) MKL's kernel for that shape streams the weights at 6-12 GB/s
for 2-8 rows, while the same product written as W · xᵀ runs at the memory's ~19 GB/s (measured per
shape in docs/benchmarks.md: 576→1536 with 4 rows 542 → 253 µs, 1536→576 423 → 233 µs). On an
Intel Xeon with AVX-512 the opposite holds: F.linear is the faster one and W · xᵀ cost the engine
13% of its tokens/s. So which product a row count gets is measured when the model is loaded, over
the model's own weight matrices (`measure_row_buckets`), and W · xᵀ is used only for the row counts
where it won. Results differ from F.linear only by float summation order (~1e-6 relative).

Applied to one model's nn.Linear modules (the engine's; `generate` elsewhere is untouched).
Quantized layers (inference/engine/patches/quantization.py) are other module types and are left alone.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_MAX_ROWS = 64
# Row counts are measured in these buckets; a step with r rows takes the route its bucket (the
# smallest one ≥ r) measured faster. One-row steps are a GEMV either way and keep F.linear.
ROW_BUCKETS = (2, 4, 8, 16, 32, SKINNY_MAX_ROWS)
# W·xᵀ must beat F.linear by this much to be used: a tie on a noisy machine keeps the default path.
MIN_GAIN = 0.05


def skinny_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if not 2 <= rows <= SKINNY_MAX_ROWS or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(self.weight, flat.t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().view(*x.shape[:-1], self.out_features)


def skinny_route_table(buckets: Iterable[int]) -> tuple[bool, ...]:
    """Index r (0…SKINNY_MAX_ROWS) → whether r rows go through W·xᵀ, from the buckets that won."""
    chosen = set(buckets)
    return tuple(
        rows >= 2 and next(b for b in ROW_BUCKETS if b >= rows) in chosen for rows in range(SKINNY_MAX_ROWS + 1)
    )


def routed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    routes = getattr(self, "skinny_routes", None)  # none: skinny linears off, or not measured yet
    if rows <= SKINNY_MAX_ROWS and routes and routes[rows]:
        return skinny_linear_forward(self, x)
    return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class BucketTiming:
    rows: int
    f_linear_ms: float  # one pass over all the model's linear layers, best of the repeats
    skinny_ms: float

    @property
    def skinny_wins(self) -> bool:
        return self.skinny_ms < (1 - MIN_GAIN) * self.f_linear_ms


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    return [module for module in model.modules() if type(module) is nn.Linear]


def measure_row_buckets(linears: list[nn.Linear], repeats: int = 3) -> list[BucketTiming]:
    """Time both products over every given layer, as a decode step streams them, per row bucket.

    A whole pass over the model's weights (hundreds of MB) keeps the measurement cache-cold, as in
    a real step; the two routes alternate so a slow moment of the machine falls on both.
    """
    routes = {"plain": _plain_forward, "skinny": skinny_linear_forward}
    timings = []
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            timed = time_routes(linears, rows, routes, repeats)
            timings.append(BucketTiming(rows, timed["plain"], timed["skinny"]))
    return timings


def time_routes(layers: list[nn.Linear], rows: int, routes: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Each route's best time (ms) for one pass over the layers with `rows` token rows.

    The routes alternate within each repeat so a slow moment of the machine falls on all of them.
    """
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in layers}
    best = dict.fromkeys(routes, float("inf"))
    for _ in range(repeats):
        for route, forward in routes.items():
            started = time.perf_counter()
            for layer in layers:
                forward(layer, inputs[layer.in_features])
            best[route] = min(best[route], time.perf_counter() - started)
    return {route: seconds * 1e3 for route, seconds in best.items()}


def _plain_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def describe(timings: list[BucketTiming]) -> str:
    """One log line: each bucket's two timings and which route won."""
    return "; ".join(
        f"{t.rows} rows {t.f_linear_ms:.1f} vs {t.skinny_ms:.1f} ms{' (W·xᵀ)' if t.skinny_wins else ''}" for t in timings
    )


def use_skinny_linears(model: nn.Module, buckets: Iterable[int]) -> list[int]:
    """Route the model's plain Linear layers through W·xᵀ for the given row buckets.

    Returns the buckets routed; with none, every layer keeps F.linear and nothing is changed.
    """
    chosen = sorted(set(buckets))
    if chosen:
        routes = skinny_route_table(chosen)
        for module in plain_linears(model):
            module.skinny_routes = routes
            # A q4-packed layer's own forward already falls back to routed_linear_forward.
            if not getattr(module, "consults_skinny_routes", False):
                module.forward = types.MethodType(routed_linear_forward, module)
    return chosen
