"""Linear layers for decode steps of a few tokens, as W · xᵀ instead of x · Wᵀ.

A decode step multiplies a few token rows (2…64) by every weight matrix of the model, so on CPU it
is bound by reading the weights from memory. torch's CPU build hands `F.linear(x, W)` to MKL as
x · Wᵀ, and on this AMD EPYC (AVX2) MKL's kernel for that shape streams the weights at 6-12 GB/s
for 2-8 rows, while the same product written as W · xᵀ runs at the memory's ~19 GB/s (measured per
shape in docs/benchmarks.md: 576→1536 with 4 rows 542 → 253 µs, 1536→576 423 → 233 µs). From a few
hundred rows on (prefill chunks) MKL's own path is as fast or faster, and one row is a GEMV either
way, so only 2…SKINNY_MAX_ROWS rows take the other route. Results differ from F.linear only by
float summation order (~1e-6 relative).

Applied to one model's nn.Linear modules (the engine's; `generate` elsewhere is untouched).
Quantized layers (inference/quantization.py) are other module types and are left alone.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_MAX_ROWS = 64


def skinny_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if not 2 <= rows <= SKINNY_MAX_ROWS or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(self.weight, flat.t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().view(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module) -> int:
    """Route the model's plain Linear layers through skinny_linear_forward; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(skinny_linear_forward, module)
            count += 1
    return count
