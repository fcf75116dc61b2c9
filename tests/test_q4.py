"""The q4 variant: decode steps of a few rows read the GGUF's own 4-bit weights, every other step the fp32 ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.engine.config import Sampling
from inference.engine.patches.linears import skinny_linear_forward, use_skinny_linears
from inference.engine.patches.quantization import (
    NEVER,
    Q4,
    Q4_GROUP,
    Q4_ROW_BUCKETS,
    QuantizationError,
    check_mode,
    describe_q4,
    measure_head_rows,
    measure_q4_rows,
    mode_of,
    pack_q4,
    q4_forward,
    q8_forward,
    quantize_model,
    weights_memory_bytes,
)
from tests.questions import ROBUST_ANSWER, ROBUST_QUESTION


class TinyDecoder(nn.Module):
    """Names as in a transformers decoder: linears under `.layers.` are packed, the lm_head is not."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(weight.shape[1], weight.shape[0], bias=False)])
        self.layers[0].weight.data.copy_(weight)
        self.lm_head = nn.Linear(weight.shape[0], 16, bias=False)


def on_grid(out_features: int = 96, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    """A weight on a 4-bit grid of 32-weight groups, as a Q4_1 GGUF's dequantized weights are.

    Scales and group minimums are powers of two and small multiples of them, so bf16 holds them and
    the kernel's arithmetic can be compared with F.linear exactly (up to summation order).
    """
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // Q4_GROUP
    codes = torch.randint(0, 16, (out_features, groups, Q4_GROUP), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its whole range, as llama.cpp's Q4_1 does
    scale = 2.0 ** -torch.randint(4, 8, (out_features, groups, 1), generator=generator).float()
    low = -8 * scale + scale * torch.randint(-2, 3, (out_features, groups, 1), generator=generator).float()
    return (codes * scale + low).reshape(out_features, in_features)


def bf16_exact(rows: int, features: int) -> torch.Tensor:
    return torch.randn(rows, features).to(torch.bfloat16).float()


def test_the_packed_weights_multiply_as_the_fp32_ones():
    weight = on_grid()
    model = pack_q4(TinyDecoder(weight))
    layer = model.layers[0]
    x = bf16_exact(5, 128)
    got = q4_forward(layer, x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # bf16 output rounding is the only difference left: inputs, scales and zeros are exact in bf16.
    torch.testing.assert_close(got, nn.functional.linear(x, weight), rtol=8e-3, atol=1e-3)


def test_weights_off_a_4_bit_grid_are_refused_with_the_reason_and_nothing_is_packed():
    model = TinyDecoder(on_grid())
    model.layers.append(nn.Linear(128, 96, bias=False))  # random weights: off any 4-bit grid
    with pytest.raises(QuantizationError, match=r"of layers\.1's weights are not on a 4-bit grid of 32-weight groups .*would change the model"):
        pack_q4(model)
    assert mode_of(model) != Q4 and not any("forward" in layer.__dict__ for layer in model.layers)


def test_an_input_size_that_is_not_a_whole_number_of_groups_is_refused():
    with pytest.raises(QuantizationError, match=r"input size \(100\) to be a multiple of 32"):
        pack_q4(TinyDecoder(torch.zeros(96, 100)))


def test_q4_runs_on_cpu_only():
    with pytest.raises(QuantizationError, match="q4 weights run on CPU only .*int4 kernel.*cuda"):
        check_mode(Q4, "cuda:0")
    with pytest.raises(QuantizationError, match="unknown quantization 'q3'"):
        check_mode("q3", "cpu")


def test_steps_up_to_the_measured_rows_take_the_4_bit_route_and_longer_ones_fp32():
    weight = on_grid()
    model = quantize_model(TinyDecoder(weight), Q4)
    layer = model.layers[0]
    assert mode_of(model) == Q4 and not hasattr(model.lm_head, "q4_weight")
    x = bf16_exact(9, 128)
    # Packed but not yet measured: no step reads the 4-bit copy.
    assert torch.equal(layer(x[:1]), nn.functional.linear(x[:1], weight))
    layer.q4_max_rows = 4
    for rows in (1, 4):
        assert torch.equal(layer(x[:rows]), q4_forward(layer, x[:rows]))
    for rows in (5, 9):
        assert torch.equal(layer(x[:rows]), nn.functional.linear(x[:rows], weight))


def test_the_lm_head_gets_an_int8_copy_with_a_scale_per_row_that_serves_the_measured_rows():
    model = quantize_model(TinyDecoder(on_grid()), Q4)
    head = model.lm_head
    assert head.q8_weight.dtype == torch.int8 and head.q8_scales.shape == (16,)
    x = bf16_exact(3, 96)
    # Symmetric per-row int8: half a step (max |w| / 127) of rounding, plus the bf16 scale's own
    # rounding (up to 2⁻⁸ relative: 7 stored mantissa bits) times at most 127 codes: within one step.
    rebuilt = head.q8_weight.float() * head.q8_scales.float()[:, None]
    step = head.weight.abs().amax(1, keepdim=True) / 127
    assert ((rebuilt - head.weight).abs() <= 1.0 * step).all()
    assert torch.equal(head(x), nn.functional.linear(x, head.weight))  # not measured yet: fp32
    head.q4_max_rows = 4
    torch.testing.assert_close(head(x), q8_forward(head, x))
    torch.testing.assert_close(head(x), nn.functional.linear(x, head.weight), rtol=0.05, atol=0.05)


def test_longer_steps_of_a_packed_layer_keep_their_skinny_route():
    weight = on_grid()
    model = quantize_model(TinyDecoder(weight), Q4)
    layer = model.layers[0]
    q4_routed = layer.forward
    use_skinny_linears(model, [8])
    assert layer.forward == q4_routed, "the skinny routes must not replace the q4 routing"
    assert "forward" in model.lm_head.__dict__
    layer.q4_max_rows = 2
    x = bf16_exact(8, 128)
    assert torch.equal(layer(x[:2]), q4_forward(layer, x[:2]))
    assert torch.equal(layer(x), skinny_linear_forward(layer, x))


def test_the_measurement_routes_an_unbroken_run_of_winning_buckets():
    model = quantize_model(TinyDecoder(on_grid(576, 1536)), Q4)
    max_rows, timings = measure_q4_rows(model, repeats=1)
    assert [rows for rows, _, _ in timings] == list(Q4_ROW_BUCKETS)
    assert all(fp32 > 0 and q4 > 0 for _, fp32, q4 in timings)
    assert max_rows in (0, *Q4_ROW_BUCKETS) and model.layers[0].q4_max_rows == max_rows
    winners = [rows for rows, fp32, q4 in timings if q4 < 0.95 * fp32]
    assert max_rows == 0 or winners[: Q4_ROW_BUCKETS.index(max_rows) + 1] == list(Q4_ROW_BUCKETS[: Q4_ROW_BUCKETS.index(max_rows) + 1])


def test_the_lm_head_is_routed_on_its_own_and_its_timings_returned():
    model = quantize_model(TinyDecoder(on_grid(576, 1536)), Q4)
    max_rows, timings = measure_head_rows(model, repeats=1)
    assert [rows for rows, _, _ in timings] == list(Q4_ROW_BUCKETS)
    assert all(fp32 > 0 and int8 > 0 for _, fp32, int8 in timings)
    assert model.lm_head.q4_max_rows == max_rows
    assert describe_q4(max_rows, timings, "the int8 copy").endswith(f"→ the int8 copy for steps of up to {max_rows} rows")
    assert measure_head_rows(nn.Sequential(nn.Linear(8, 8)), repeats=1) == (0, [])  # no int8 head: nothing timed


def test_the_real_model_serves_its_own_4_bit_codes_in_the_engine(q4_engine):
    engine = q4_engine  # loaded once for the session (tests/conftest.py), not started
    packed = [m for m in engine.model.modules() if hasattr(m, "q4_weight")]
    # 30 decoder layers × (q, k, v, o, gate, up, down); the tied lm_head gets an int8 copy instead.
    assert len(packed) == 210 and mode_of(engine.model) == Q4
    assert hasattr(engine.model.lm_head, "q8_weight")
    assert engine.weights_bytes == weights_memory_bytes(engine.model)
    # fp32 weights (513 MiB) stay for long steps; the 4-bit codes and bf16 scales add ~66 MiB, the int8 lm_head 27 MiB;
    # the bf16 copies for wide steps, where this machine measured them faster, their own bytes.
    wide = sum(m.bf16_weight.nbytes for m in engine.model.modules() if hasattr(m, "bf16_weight"))
    assert (wide > 0) == (engine.wide_min_rows != NEVER)
    assert 590 * 2**20 < engine.weights_bytes - wide < 630 * 2**20
    for layer in [*packed, engine.model.lm_head]:  # force the packed routes whatever this machine measured
        layer.q4_max_rows = 64
    engine.start()
    try:
        prompt = engine.encode_chat([{"role": "user", "content": ROBUST_QUESTION}])
        handle = engine.submit("q4-capital", prompt, 12)
        tokens = [token for event in handle.events(timeout=120) for token in event.new_tokens]
        assert ROBUST_ANSWER in engine.tokenizer.decode(tokens)
        # The demo features' default (greedy with a frequency penalty) runs on q4 too, and stays
        # deterministic: the same question twice, the same answer (the answer caches depend on it).
        penalised = Sampling(frequency_penalty=0.5)
        answers = []
        for attempt in range(2):
            handle = engine.submit(f"q4-penalty-{attempt}", engine.encode_chat([{"role": "user", "content": "What is a KV cache?"}]),
                                   48, sampling=penalised)
            answers.append([token for event in handle.events(timeout=120) for token in event.new_tokens])
        assert answers[0] == answers[1] and len(answers[0]) > 8
        stats = engine.stats()
        assert (stats.quantization, stats.weights_bytes) == (Q4, engine.weights_bytes)
    finally:
        engine.stop()
