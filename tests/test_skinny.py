"""inference/engine/patches/linears.py: decode-sized linear layers as W·xᵀ give F.linear's results, only where measured faster."""

import pytest
import torch
from torch import nn

from inference.engine.patches.linears import (
    ROW_BUCKETS,
    SKINNY_MAX_ROWS,
    BucketTiming,
    measure_row_buckets,
    plain_linears,
    skinny_linear_forward,
    skinny_route_table,
    use_skinny_linears,
)


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


def test_a_row_count_takes_the_route_its_bucket_won():
    routes = skinny_route_table([4, 32])
    assert len(routes) == SKINNY_MAX_ROWS + 1
    assert [rows for rows in range(SKINNY_MAX_ROWS + 1) if routes[rows]] == [3, 4, *range(17, 33)]
    assert not any(skinny_route_table([]))
    assert not skinny_route_table(ROW_BUCKETS)[1], "one row is a GEMV either way and keeps F.linear"


def test_only_plain_linear_layers_are_rerouted_and_results_stay_equal():
    quantized = torch.ao.nn.quantized.dynamic.Linear(8, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)), quantized)
    assert use_skinny_linears(model, [8, 4, 4]) == [4, 8]
    assert "forward" in model[0].__dict__ and "forward" in model[2][0].__dict__
    assert "forward" not in quantized.__dict__
    for rows in (1, 3, 8, 9, 100):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))


def test_with_no_winning_bucket_nothing_is_changed():
    model = nn.Sequential(nn.Linear(8, 8))
    assert use_skinny_linears(model, []) == []
    assert "forward" not in model[0].__dict__


def test_every_bucket_is_measured_over_the_given_layers():
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64, bias=False))
    timings = measure_row_buckets(plain_linears(model), repeats=2)
    assert [t.rows for t in timings] == list(ROW_BUCKETS)
    assert all(t.f_linear_ms > 0 and t.skinny_ms > 0 for t in timings)


def test_w_x_must_win_clearly_to_be_chosen():
    assert BucketTiming(4, f_linear_ms=10.0, skinny_ms=9.0).skinny_wins
    assert not BucketTiming(4, f_linear_ms=10.0, skinny_ms=9.8).skinny_wins, "a tie keeps F.linear"
    assert not BucketTiming(4, f_linear_ms=10.0, skinny_ms=12.0).skinny_wins
