"""Decode attention read in place from the paged KV cache (torch.ops.ceiling.decode_attention,
inference/engine/kernels/lowbit.cpp): the same numbers as gathering the rows and calling
scaled_dot_product_attention, inputs it cannot read refused with the reason, and the owned engine's
eager decode steps on it answering exactly as greedy decoding does (its compiled graphs run on it
in tests/test_compiled_decode.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.engine import kernels
from inference.engine.owned.kv import from_cache, to_cache
from inference.engine.owned.manager import OwnedManager
from tests.test_owned_engine import greedy, model, prompts, run_to_the_end  # noqa: F401  (fixtures)


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    assert kernels.load() is None


def gathered_attention(q, k_cache, v_cache, slots, lengths):
    """What the kernel replaces: gather each row's K and V, mask past its length, SDPA (grouped heads)."""
    rows, positions = slots.shape
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)
    mask = (torch.arange(positions).unsqueeze(0) < lengths.unsqueeze(1)).view(rows, 1, 1, positions)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True).reshape(rows, -1)


@pytest.mark.parametrize(("rows", "positions", "heads", "kv_heads"), [
    (1, 1, 9, 3),  # a first decode step sees one position
    (1, 300, 9, 3),  # a lone request, grouped-query heads as SmolLM2's
    (4, 77, 9, 3),  # a batch whose rows see different lengths
    (2, 5000, 4, 4),  # long enough to split across threads; one query head per KV head
    (2, 40, 16, 2),  # 8 query heads per KV head: the plain loops, not the 64-wide registers
])
def test_the_kernel_computes_the_gathered_attention(rows, positions, heads, kv_heads):
    generator = torch.Generator().manual_seed(rows * positions)
    cache_slots = positions * rows + 64
    k_cache = torch.randn(cache_slots, kv_heads, 64, generator=generator)
    v_cache = torch.randn(cache_slots, kv_heads, 64, generator=generator)
    q = torch.randn(rows, heads, 64, generator=generator)
    # Scattered slots, as blocks come back from the free list; the rows' lengths differ.
    slots = torch.stack([torch.randperm(cache_slots, generator=generator)[:positions] for _ in range(rows)])
    lengths = torch.tensor([max(1, positions - 13 * row) for row in range(rows)])
    got = torch.ops.ceiling.decode_attention(q, k_cache, v_cache, slots, lengths)
    assert got.shape == (rows, heads * 64)
    torch.testing.assert_close(got, gathered_attention(q, k_cache, v_cache, slots, lengths), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "positions", "heads", "kv_heads"), [(1, 300, 9, 3), (4, 77, 9, 3), (2, 2000, 4, 4), (2, 40, 16, 2)])
def test_the_kernel_reads_an_fp16_cache_as_the_same_values_widened(rows, positions, heads, kv_heads):
    """fp16 rounds each key and value once, when written; reading them back loses nothing more."""
    generator = torch.Generator().manual_seed(rows + positions)
    cache_slots = positions * rows + 64
    k_cache = torch.randn(cache_slots, kv_heads, 64, generator=generator).half()
    v_cache = torch.randn(cache_slots, kv_heads, 64, generator=generator).half()
    q = torch.randn(rows, heads, 64, generator=generator)
    slots = torch.stack([torch.randperm(cache_slots, generator=generator)[:positions] for _ in range(rows)])
    lengths = torch.tensor([max(1, positions - 13 * row) for row in range(rows)])
    got = torch.ops.ceiling.decode_attention(q, k_cache, v_cache, slots, lengths)
    expected = gathered_attention(q, k_cache.float(), v_cache.float(), slots, lengths)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "positions", "heads", "kv_heads"), [(1, 1, 9, 3), (1, 300, 9, 3), (4, 77, 9, 3),
                                                                     (2, 2000, 4, 4), (2, 40, 16, 2)])
def test_the_kernel_reads_an_int8_cache_as_its_codes_times_their_scales(rows, positions, heads, kv_heads):
    """int8 rounds each (slot, KV head) row once, when written (kv.py); the kernel reads the codes
    times the row's scale, as kv.from_cache decodes them, and nothing more is lost."""
    generator = torch.Generator().manual_seed(7 * rows + positions)
    cache_slots = positions * rows + 64
    k_cache = to_cache(torch.randn(cache_slots, kv_heads, 64, generator=generator) * 3, torch.int8)
    v_cache = to_cache(torch.randn(cache_slots, kv_heads, 64, generator=generator), torch.int8)
    assert k_cache.shape == (cache_slots, kv_heads, 68) and k_cache.dtype == torch.int8
    q = torch.randn(rows, heads, 64, generator=generator)
    slots = torch.stack([torch.randperm(cache_slots, generator=generator)[:positions] for _ in range(rows)])
    lengths = torch.tensor([max(1, positions - 13 * row) for row in range(rows)])
    got = torch.ops.ceiling.decode_attention(q, k_cache, v_cache, slots, lengths)
    expected = gathered_attention(q, from_cache(k_cache, torch.float32), from_cache(v_cache, torch.float32), slots, lengths)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_int8_rows_keep_each_value_within_half_its_rows_step():
    """x ≈ s·q with s = max|x| / 127: every value within s/2, each row's largest exactly, zeros as zeros."""
    values = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    values[7, 1] = 0.0  # a row of zeros: scale 0, codes 0, no division by zero
    rows = to_cache(values, torch.int8)
    back = from_cache(rows, torch.float32)
    step = values.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((back - values).abs() <= step / 2 + 1e-7 * values.abs())
    assert torch.equal(back[7, 1], torch.zeros(64))
    largest = values.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, largest), values.gather(-1, largest), rtol=1e-6, atol=0)


def test_slots_past_a_rows_length_are_never_read():
    k_cache, v_cache, q = torch.randn(16, 1, 64), torch.randn(16, 1, 64), torch.randn(1, 1, 64)
    slots = torch.tensor([[3, 4, 99_999]])  # the third would be outside the cache, past the row's length
    got = torch.ops.ceiling.decode_attention(q, k_cache, v_cache, slots, torch.tensor([2]))
    torch.testing.assert_close(got, gathered_attention(q, k_cache, v_cache, slots[:, :2], torch.tensor([2])))


@pytest.mark.parametrize(("change", "message"), [
    ({"q": torch.randn(1, 9, 64).double()}, r"q must be a contiguous \[rows, heads, head_dim\] float32 tensor"),
    ({"k_cache": torch.randn(32, 3, 64).bfloat16()}, "the caches must be contiguous"),
    ({"k_cache": torch.randn(32, 3, 64).half()}, "the caches must be contiguous"),  # K and V of one type
    ({"k_cache": torch.zeros(32, 3, 64, dtype=torch.int8), "v_cache": torch.zeros(32, 3, 64, dtype=torch.int8)},
     "head_dim differs"),  # int8 rows need 4 bytes more, for their scale
    ({"q": torch.randn(1, 8, 64)}, "heads are not a multiple of kv_heads"),
    ({"lengths": torch.tensor([11])}, "row 0 sees 11 positions, its slots hold 10"),
    ({"lengths": torch.tensor([0])}, "row 0 sees 0 positions"),
    ({"slots": torch.full((1, 10), 32)}, "a slot past the cache's 32"),
    ({"slots": torch.zeros(1, 10, dtype=torch.int32)}, "slots must be a contiguous"),
])
def test_inputs_the_kernel_cannot_read_are_refused_with_the_reason(change, message):
    arguments = {"q": torch.randn(1, 9, 64), "k_cache": torch.randn(32, 3, 64), "v_cache": torch.randn(32, 3, 64),
                 "slots": torch.arange(10).unsqueeze(0), "lengths": torch.tensor([10])} | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ceiling.decode_attention(**arguments)


def test_eager_decode_steps_on_the_kernel_answer_as_greedy(model, prompts):  # noqa: F811
    """Chunked prefill (SDPA) beside decode rows on the kernel, in batches of every size: every answer
    the greedy one. (The compiled graphs on it: tests/test_compiled_decode.py.)"""
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=16, prefix_sharing=True,
                           paged_attention=True)
    manager.start()
    try:
        assert manager.runner.paged_attention
        answers = run_to_the_end(manager, {f"r{i}": p for i, p in enumerate(prompts)}, 16)
    finally:
        manager.stop()
    for index, prompt in enumerate(prompts):
        assert answers[f"r{index}"] == greedy(model, prompt, 16)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8], ids=["fp16", "int8"])
def test_eager_decode_steps_on_a_narrower_cache_answer_as_greedy(kv_dtype, model, prompts):  # noqa: F811
    """The fp16 or int8 cache (CEILING_KV_DTYPE) under chunked prefill (rows written by kv.py, read
    back for SDPA) and batched decode rows on the kernel: the short prompts' greedy answers are those
    of fp32 full forward passes."""
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=16, prefix_sharing=True,
                           paged_attention=True, kv_dtype=kv_dtype)
    manager.start()
    try:
        assert manager.runner.k_cache[0].dtype == kv_dtype and manager.runner.paged_attention
        answers = run_to_the_end(manager, {f"r{i}": p for i, p in enumerate(prompts)}, 16)
    finally:
        manager.stop()
    for index, prompt in enumerate(prompts):
        assert answers[f"r{index}"] == greedy(model, prompt, 16)
