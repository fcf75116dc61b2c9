"""Fused q|k|v and gate|up linears compute exactly what their parts did, and hold no second copy."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.engine.patches.fusion import fuse_linears
from inference.engine.patches.linears import skinny_route_table, use_skinny_linears
from inference.engine.patches.quantization import INT8, Q4_GROUP, pack_q4, quantize_model
from tests.test_q4 import bf16_exact, on_grid


class ThreeHeads(nn.Module):
    """Three linears over one input under `.layers.`, as q/k/v of a decoder layer (q4 packs them)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights)
        for layer, weight in zip(self.layers, weights, strict=True):
            layer.weight.data.copy_(weight)


def parts(seed: int = 0, sizes: tuple[int, ...] = (128, 64, 64)) -> list[torch.Tensor]:
    return [on_grid(rows, 128, seed + index) for index, rows in enumerate(sizes)]


def test_a_fused_linear_is_its_parts_side_by_side_and_the_parts_become_views_of_it():
    model = ThreeHeads(parts())
    x = torch.randn(3, 128)
    expected = [layer(x) for layer in model.layers]
    fused = fuse_linears(list(model.layers))
    assert fused.weight.shape == (256, 128)
    torch.testing.assert_close(fused(x), torch.cat(expected, dim=-1), rtol=0, atol=1e-5)
    for layer, out in zip(model.layers, expected, strict=True):
        assert layer.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(layer(x), out, rtol=0, atol=1e-5)  # the parts still serve alone


def test_fusion_keeps_the_measured_skinny_routes():
    model = ThreeHeads(parts())
    use_skinny_linears(model, [4])
    fused = fuse_linears(list(model.layers))
    assert fused.skinny_routes == skinny_route_table([4])
    x = torch.randn(4, 128)
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in model.layers], dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(128, 64, 64), (96, 32, 32)], ids=["whole-tiles", "packed-anew"])
def test_a_fused_q4_layer_serves_the_4_bit_codes_of_its_parts_up_to_their_row_limit(sizes):
    model = pack_q4(ThreeHeads(parts(sizes=sizes)))
    for layer in model.layers:
        layer.q4_max_rows = 4
    x = bf16_exact(2, 128)
    expected = torch.cat([layer(x) for layer in model.layers], dim=-1)  # each part's 4-bit route
    fused = fuse_linears(list(model.layers))
    assert fused.q4_max_rows == 4 and fused.q4_weight.shape[0] == sum(sizes)
    assert fused.q4_scales_and_zeros.shape == (128 // Q4_GROUP, sum(sizes), 2)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=1e-4)
    long = bf16_exact(9, 128)  # past the limit: the fp32 weights, as the parts would
    torch.testing.assert_close(fused(long), torch.cat([nn.functional.linear(long, w) for w in parts(sizes=sizes)], dim=-1),
                               rtol=1e-5, atol=1e-5)


def test_layers_that_differ_or_are_not_plain_linears_are_not_fused():
    model = ThreeHeads(parts())
    assert fuse_linears([model.layers[0], nn.Linear(64, 8)]) is None  # another input size
    int8 = quantize_model(ThreeHeads(parts()), INT8)
    assert fuse_linears(list(int8.layers)) is None
