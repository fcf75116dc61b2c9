"""inference/skinny.py: decode-sized linear layers as W·xᵀ give F.linear's results, and only plain Linears change."""

import pytest
import torch
from torch import nn

from inference.skinny import SKINNY_MAX_ROWS, skinny_linear_forward, use_skinny_linears


@pytest.mark.parametrize("rows", [1, 2, 4, 8, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear_for_every_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    expected = layer(x)
    got = skinny_linear_forward(layer, x)
    assert got.shape == expected.shape == (1, rows, 160) and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_only_plain_linear_layers_are_rerouted():
    quantized = torch.ao.nn.quantized.dynamic.Linear(8, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)), quantized)
    assert use_skinny_linears(model) == 2
    assert "forward" in model[0].__dict__ and "forward" in model[2][0].__dict__
    assert "forward" not in quantized.__dict__
    x = torch.randn(4, 8)
    torch.testing.assert_close(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))
