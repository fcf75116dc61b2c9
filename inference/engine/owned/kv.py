"""The KV cache's element types: fp32, fp16, or int8 codes with a scale per (slot, KV head).

A cache tensor is [slots, kv_heads, width]. For fp32 and fp16 the width is head_dim and a value is
stored as it is (fp16 rounds it once). For int8 it is head_dim + 4: head_dim codes q = round(x / s)
in -127…127, then the row's scale s = max|x| / 127 as the 4 bytes of an fp32, so x ≈ s·q within s/2.
The C++ kernels (kernels/lowbit.cpp: store_kv, row_scale) write and read the same layout with the
same rounding, so a row written here (a prompt chunk) and one written there (a decode step) agree.

Why int8 at all: a decode step reads every cached position's K and V of every layer. At 2,000
positions a lone SmolLM2 row reads 92 MB of an fp32 cache, 46 MB of fp16 and 24 MB of int8, beside
~95 MB of 4-bit weights and int8 lm_head: only int8 keeps the step within 1.3× of position 0's
bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale after each int8 row


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension for one KV head: its values, and for int8 its scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def to_cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] activations as cache rows of `dtype` ([..., row_width])."""
    if dtype != torch.int8:
        return values.to(dtype)
    values = values.float()
    largest = values.abs().amax(dim=-1, keepdim=True)
    scale = largest / 127
    inverse = torch.where(largest > 0, 127 / largest, torch.zeros_like(largest))
    codes = torch.round(values * inverse).clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ([..., row_width]) back as [..., head_dim] values of `dtype` (the activations')."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scale_bytes = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)
    return (codes.to(torch.float32) * scale).to(dtype)
