"""Linears that read the same input, fused into one: q/k/v of an attention, gate/up of an MLP.

A lone decode step is a chain of small kernels, and every kernel call costs its dispatch and an
OpenMP fork-join on top of its arithmetic (a 4-bit q_proj at one row: 12 µs, half of it fixed
cost). One call over the concatenated output rows does the same arithmetic with one fixed cost:
the owned loop's runner asks for a fused q|k|v and gate|up per layer, 210 → 120 linear calls per
step for SmolLM2's 30 layers.

Fusing concatenates along the output rows, which every weight form here allows: fp32 and bf16
rows, and the q4 copy's rows: Ceiling's kernels keep one row of codes and one of scales per
output, so any parts concatenate; torch's CPU int4 pack lays codes out in tiles of 64 output rows,
so parts whose sizes are multiples of 64 (all of SmolLM2's) concatenate as they are, and others are
packed anew from the fp32 weights (exact: they lie on the 4-bit grid), its [groups, out, 2] scales
concatenated along `out`. The originals then become views of the fused
weight, so no weight is held twice, and keep working for every other caller (transformers' loop,
`generate`). Each fused layer takes the routes the originals were measured to (skinny W·xᵀ row
buckets, the q4/fp32 row limit). A layer of another type (torch.ao's int8 modules) is not fused.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .linears import routed_linear_forward
from .quantization import OWN_KERNELS, q4_pack, q4_routed_forward

# Output rows per tile of torch's CPU int4 pack (_convert_weight_to_int4pack_for_cpu).
Q4_PACK_ROWS = 64


def fuse_linears(layers: list[nn.Module]) -> nn.Linear | None:
    """One Linear whose output is the given layers' outputs side by side, or None if they can't fuse."""
    if not _fusable(layers):
        return None
    first = layers[0]
    with torch.no_grad():
        weight = torch.cat([layer.weight.detach() for layer in layers])
        bias = torch.cat([layer.bias.detach() for layer in layers]) if first.bias is not None else None
    fused = nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    _share_rows(layers, weight, bias)
    if hasattr(first, "q4_weight"):
        _fuse_q4(fused, layers)
    elif getattr(first, "skinny_routes", None) is not None:
        fused.skinny_routes = first.skinny_routes
        fused.forward = types.MethodType(routed_linear_forward, fused)
    return fused.eval()


def _fusable(layers: list[nn.Module]) -> bool:
    first = layers[0]
    if any(type(layer) is not nn.Linear for layer in layers):
        return False
    return all(
        layer.in_features == first.in_features
        and layer.weight.dtype == first.weight.dtype
        and layer.weight.device == first.weight.device
        and (layer.bias is None) == (first.bias is None)
        and hasattr(layer, "q4_weight") == hasattr(first, "q4_weight")
        and getattr(layer, "q4_kernel", None) == getattr(first, "q4_kernel", None)
        and getattr(layer, "q4_max_rows", None) == getattr(first, "q4_max_rows", None)
        and getattr(layer, "wide_min_rows", None) == getattr(first, "wide_min_rows", None)
        and hasattr(layer, "bf16_weight") == hasattr(first, "bf16_weight")
        and getattr(layer, "skinny_routes", None) == getattr(first, "skinny_routes", None)
        for layer in layers
    )


def _share_rows(layers: list[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Make each original layer's weight (and bias) a view of its rows in the fused tensors."""
    start = 0
    for layer in layers:
        end = start + layer.out_features
        layer.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end


def _fuse_q4(fused: nn.Linear, layers: list[nn.Linear]) -> None:
    kernel = layers[0].q4_kernel
    own = kernel == OWN_KERNELS  # Ceiling's layout is one row per output: every size concatenates
    if own or all(layer.out_features % Q4_PACK_ROWS == 0 for layer in layers[:-1]):
        codes = torch.cat([layer.q4_weight for layer in layers])
        scales_and_zeros = torch.cat([layer.q4_scales_and_zeros for layer in layers], dim=0 if own else 1).contiguous()
        start = 0
        for layer in layers:  # the codes too are views now; the scales are a few KiB and stay apart
            end = start + layer.out_features
            layer.q4_weight = codes[start:end]
            start = end
    else:
        codes, scales_and_zeros = q4_pack(fused.weight.detach(), "a fused layer", kernel)
    fused.q4_kernel = kernel
    fused.register_buffer("q4_weight", codes, persistent=False)
    fused.register_buffer("q4_scales_and_zeros", scales_and_zeros, persistent=False)
    fused.q4_max_rows, fused.wide_min_rows = layers[0].q4_max_rows, layers[0].wide_min_rows
    if hasattr(layers[0], "bf16_weight"):  # the wide steps' copy, shared with the originals as their fp32 rows are
        wide = torch.cat([layer.bf16_weight for layer in layers])
        fused.register_buffer("bf16_weight", wide, persistent=False)
        start = 0
        for layer in layers:
            layer.bf16_weight = wide[start : start + layer.out_features]
            start += layer.out_features
    fused.consults_skinny_routes = True
    if getattr(layers[0], "skinny_routes", None) is not None:
        fused.skinny_routes = layers[0].skinny_routes
    fused.forward = types.MethodType(q4_routed_forward, fused)
