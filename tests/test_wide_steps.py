"""The q4 variant's wide steps (big decode batches, prefill chunks) read a bf16 copy of the weights
where that measured faster: the routes by row count, the load-time choice, fusion, and the owned
loop's greedy answers through that route."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.engine.owned.manager import OwnedManager
from inference.engine.patches.fusion import fuse_linears
from inference.engine.patches.quantization import (
    NEVER,
    Q4,
    WIDE_ROW_BUCKETS,
    bf16_forward,
    bytes_read_per_decode_step,
    describe_wide,
    keep_wide_copy,
    measure_wide_rows,
    q4_forward,
    quantize_model,
    weights_memory_bytes,
    wide_crossing,
)
from inference.engines import model_dir
from tests.test_fusion import ThreeHeads, parts
from tests.test_owned_engine import greedy, prompts, run_to_the_end  # noqa: F401  (fixture)
from tests.test_q4 import TinyDecoder, bf16_exact, on_grid


def test_each_row_count_takes_its_route_four_bit_then_fp32_then_the_bf16_copy():
    weight = on_grid()
    model = quantize_model(TinyDecoder(weight), Q4)
    layer = model.layers[0]
    assert layer.wide_min_rows == NEVER and not hasattr(layer, "bf16_weight")  # packed, not measured: no copy
    layer.q4_max_rows = 4
    keep_wide_copy([layer], 9)
    assert layer.bf16_weight.dtype == torch.bfloat16 and layer.q4_max_rows == 4
    x = bf16_exact(12, 128)
    for rows in (1, 4):
        assert torch.equal(layer(x[:rows]), q4_forward(layer, x[:rows]))
    for rows in (5, 8):
        assert torch.equal(layer(x[:rows]), nn.functional.linear(x[:rows], weight))
    for rows in (9, 12):
        got = layer(x[:rows])
        assert got.dtype == torch.float32 and torch.equal(got, bf16_forward(layer, x[:rows]))
        # on_grid's weights and these inputs are exact in bf16: only the output's rounding differs.
        torch.testing.assert_close(got, nn.functional.linear(x[:rows], weight), rtol=8e-3, atol=1e-3)


def test_a_wide_start_below_the_4_bit_reach_shortens_it_and_never_drops_the_copy():
    model = quantize_model(TinyDecoder(on_grid()), Q4)
    layer = model.layers[0]
    layer.q4_max_rows = 16
    without = weights_memory_bytes(model)
    keep_wide_copy([layer], 9)
    assert layer.q4_max_rows == 8  # a 9-row step must reach the copy, which is checked after the 4-bit route
    assert weights_memory_bytes(model) == without + 96 * 128 * 2
    assert bytes_read_per_decode_step(model, rows=9) - bytes_read_per_decode_step(model, rows=8) > 0
    keep_wide_copy([layer], NEVER)
    assert not hasattr(layer, "bf16_weight") and layer.wide_min_rows == NEVER
    assert weights_memory_bytes(model) == without
    x = bf16_exact(12, 128)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight))  # the fp32 route again


def test_the_measurement_keeps_the_copy_from_an_unbroken_run_of_wins_up_to_the_widest_bucket():
    model = quantize_model(TinyDecoder(on_grid(576, 1536)), Q4)
    start, timings = measure_wide_rows(model, repeats=1)
    buckets = [rows for rows in WIDE_ROW_BUCKETS if rows >= 2]
    assert [rows for rows, _, _ in timings] == buckets
    assert all(current > 0 and bf16 > 0 for _, current, bf16 in timings)
    wins = [bf16 < 0.95 * current for _, current, bf16 in timings]
    if start == NEVER:
        assert not wins[-1] and not hasattr(model.layers[0], "bf16_weight")
        assert "no bf16 copy kept" in describe_wide(start, timings)
    else:
        first = next(i for i in range(len(buckets)) if all(wins[i:]))
        assert start == (wide_crossing(timings[first - 1], timings[first]) if first else 2)
        assert (buckets[first - 1] < start <= buckets[first]) if first else True
        assert model.layers[0].wide_min_rows == start and model.layers[0].q4_max_rows < start
        assert f"the bf16 copy for steps of {start} rows and more" in describe_wide(start, timings)
    head = model.lm_head  # timed and routed on its own
    assert hasattr(head, "bf16_weight") == (head.wide_min_rows != NEVER)


def test_the_copy_starts_where_the_two_routes_times_cross_between_buckets():
    # Zen 4's figures: the 4-bit route 21.4 → 45.6 ms from 16 to 32 rows, the bf16 copy 33.4 → 41.1.
    # The lines cross at ~27.6 rows; with the 5% the copy must win by, at 30 (not 17, right after 16).
    assert wide_crossing((16, 21.4, 33.4), (32, 45.6, 41.1)) == 30
    assert wide_crossing((16, 30.0, 30.0), (32, 60.0, 31.0)) == 17  # already 5% ahead one row on
    assert wide_crossing((64, 80.0, 84.0), (256, 300.0, 284.0)) == 235
    assert wide_crossing((64, 80.0, 84.0), (256, 300.0, 290.0)) == 256  # 5% ahead only at the bucket itself


def test_a_fused_layer_carries_the_copy_as_one_tensor_its_parts_are_views_of():
    model = quantize_model(ThreeHeads(parts()), Q4)
    for layer in model.layers:
        layer.q4_max_rows = 4
    keep_wide_copy(list(model.layers), 9)
    x = bf16_exact(12, 128)
    expected = torch.cat([layer(x) for layer in model.layers], dim=-1)  # each part's bf16 route
    fused = fuse_linears(list(model.layers))
    assert fused.wide_min_rows == 9 and fused.bf16_weight.shape == (256, 128)
    for layer in model.layers:
        assert layer.bf16_weight.untyped_storage().data_ptr() == fused.bf16_weight.untyped_storage().data_ptr()
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(fused(x[:2]), torch.cat([q4_forward(layer, x[:2]) for layer in model.layers], dim=-1),
                               rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def wide_model():
    """The real model's q4 variant with every step on the bf16 copy (from 1 row): greedy's full passes,
    the prompt chunks and the decode rows, batched or alone, all take the same route."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32).eval()
    model = quantize_model(model, Q4)
    packed = [m for m in model.modules() if hasattr(m, "wide_min_rows")]
    keep_wide_copy(packed, 1)
    return model


def test_batched_requests_through_the_bf16_copy_decode_exactly_as_greedy_alone(wide_model, prompts):  # noqa: F811
    manager = OwnedManager(wide_model, num_blocks=64, page_size=16, max_batch_tokens=32, prefix_sharing=False)
    manager.start()
    try:
        answers = run_to_the_end(manager, {f"w{i}": p for i, p in enumerate(prompts)}, 16)
    finally:
        manager.stop()
    for index, prompt in enumerate(prompts):  # greedy's full passes are wide steps too: the same route
        assert answers[f"w{index}"] == greedy(wide_model, prompt, 16)


def test_an_engine_asked_for_wide_steps_measures_them_at_load_and_counts_the_copy(q4_engine_load):
    engine, said = q4_engine_load.engine, q4_engine_load.said  # loaded once for the session (tests/conftest.py)
    assert engine.config.q4_wide_bf16
    assert any(line.startswith("Wide steps, their route vs a bf16 copy") for line in said)
    copies = [m for m in engine.model.modules() if hasattr(m, "bf16_weight")]
    assert bool(copies) == (engine.wide_min_rows != NEVER)
    assert engine.q4_max_rows < engine.wide_min_rows and engine.q4_max_rows <= engine.q4_max_rows_before_wide
    assert engine.weights_bytes == weights_memory_bytes(engine.model)


def test_an_engine_without_a_configured_prefill_budget_reads_one_from_its_step_times(q4_engine_load):
    from inference.engine.config import CPU_MAX_RUNNING
    from inference.engine.owned.scheduler import PREFILL_CHUNKS, measured_prefill_budget

    engine, said = q4_engine_load.engine, q4_engine_load.said
    assert engine.config.prefill_budget is None  # unset in the settings, as `make run` leaves it
    assert [rows for rows, _ in engine.step_ms] == [2, 4, 8, 16, 32, 64, 256]
    assert engine.prefill_budget == measured_prefill_budget(engine.step_ms, CPU_MAX_RUNNING) in PREFILL_CHUNKS
    assert f"Prefill budget beside decoding requests: {engine.prefill_budget} tokens" in "\n".join(said)
    engine.start()
    try:
        assert engine.manager.scheduler.prefill_budget == engine.prefill_budget
    finally:
        engine.stop()


@pytest.mark.parametrize("wide", [True, False])
def test_the_setting_reaches_the_engine_and_the_benchs_own_worker(settings, wide):
    from inference.engines import engine_config_from_settings
    from inference.management.commands.bench import stack_env

    settings.CEILING_Q4_WIDE_BF16 = wide
    assert engine_config_from_settings(model_dir()).q4_wide_bf16 is wide
    options = {"loop": "owned", "attention": "varlen", "max_batch_tokens": 512, "skinny_linear": True,
               "quantization": Q4, "compile_buckets": (), "q4_wide_bf16": wide, "prefill_budget": 0,
               "max_running": 0, "kv_dtype": "float32"}
    assert stack_env(options, 1)["CEILING_Q4_WIDE_BF16"] == ("1" if wide else "0")
