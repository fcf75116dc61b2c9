"""Decode steps in one C++ call (inference/engine/owned/stack.py, lowbit.cpp's DecodeStack): the same
logits and KV cache as the runner's eager step on the same 4-bit kernels, for lone and batched rows
with scattered blocks and a q|k|v bias; inputs it cannot serve refused with the reason and nothing
written; chosen by measurement, and then the compiled graphs it covers are never built."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from inference.engine import kernels
from inference.engine.owned import stack
from inference.engine.owned.kv import from_cache
from inference.engine.owned.manager import OwnedManager
from inference.engine.owned.runner import ModelRunner
from inference.engine.owned.scheduler import PrefillChunk, StepPlan
from inference.engine.owned.sequence import Sequence
from inference.engine.patches.quantization import pack_q4
from tests.test_owned_engine import run_to_the_end
from tests.test_q4 import on_grid

PAGE = 8
BLOCKS = 48
SHAPE = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # heads of 64


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    assert kernels.load() is None


def four_bit_model(build: Callable[[], nn.Module], q4_max_rows: int = 16, seed: int = 0) -> nn.Module:
    """The model `build` makes (its embeddings and norms drawn from `seed`), every decoder linear on a
    4-bit grid, packed for Ceiling's kernels, serving up to q4_max_rows."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for index, (name, module) in enumerate(model.named_modules()):
            if isinstance(module, nn.Linear) and ".layers." in name:
                module.weight.copy_(on_grid(module.out_features, module.in_features, seed=index))
                if module.bias is not None:  # transformers starts them at zero, which would test nothing
                    module.bias.normal_(0, 0.5)
    packed = pack_q4(model.eval(), own_kernels=True)
    for module in packed.modules():
        if hasattr(module, "q4_max_rows"):
            module.q4_max_rows = q4_max_rows
    return packed


@pytest.fixture(scope="module")
def llama():
    return four_bit_model(lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)))


@pytest.fixture(scope="module")
def qwen2():  # q, k and v carry biases
    return four_bit_model(lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, use_sliding_window=False)))


def prefilled(runner: ModelRunner, lengths: list[int], seed: int = 0) -> list[Sequence]:
    """Requests whose prompts are in the cache (prefilled eagerly), each on blocks scattered over the
    cache as they come back from the free list, each with its first token picked."""
    blocks = runner.k_cache[0].shape[0] // runner.page_size - 1  # less the compiled steps' scratch block
    shuffled = random.Random(seed).sample(range(blocks), blocks)
    seqs = []
    for index, length in enumerate(lengths):
        seq = Sequence(f"r{index}", [(31 * index + 7 * i) % 300 + 5 for i in range(length)], 64, frozenset())
        needed = -(-(length + 8) // PAGE)
        seq.block_table, shuffled = shuffled[:needed], shuffled[needed:]
        with torch.inference_mode():
            logits = runner.step(StepPlan(prefill=[PrefillChunk(seq, 0, length)]))
        seq.append(int(logits[-1].argmax()))
        seqs.append(seq)
    return seqs


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.float(), expected.float()
    return ((got - expected).norm() / expected.norm()).item()


def caches_of(runner: ModelRunner) -> list[torch.Tensor]:
    return [cache.clone() for cache in runner.k_cache + runner.v_cache]


@pytest.mark.parametrize("lengths", [[1], [37], [5, 40, 17]])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_stacked_step_computes_what_the_eager_step_computes(family, lengths, request):
    assert_stacked_steps_match_eager(request.getfixturevalue(family), lengths)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8], ids=["fp16", "int8"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 17]])
def test_a_stacked_step_on_a_narrower_cache_computes_what_the_eager_step_computes(lengths, kv_dtype, llama):
    assert_stacked_steps_match_eager(llama, lengths, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8], ids=["fp32", "fp16", "int8"])
@pytest.mark.parametrize("lengths", [[300], [400, 1], [260, 90, 3]])
def test_long_rows_attended_in_parts_compute_what_the_eager_step_computes(lengths, kv_dtype, llama, two_threads):
    # A step of few rows past 256 positions cuts each row's attention into parts, combined after
    # (lowbit.cpp's attention_parts): [300] in 2, [400, 1] in 3, so the short row's last part is
    # empty; [260, 90, 3] in 2, each part of the short rows a few positions.
    assert_stacked_steps_match_eager(llama, lengths, kv_dtype=kv_dtype, blocks=LONG_BLOCKS)


LONG_BLOCKS = 72  # 576 slots: a row of 400 positions and its three steps beside shorter ones


@pytest.fixture
def two_threads():
    """The parts are cut only where two threads or more share a step (every CI machine has 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


def assert_stacked_steps_match_eager(model: nn.Module, lengths: list[int], kv_dtype: torch.dtype = torch.float32,
                                     blocks: int = BLOCKS) -> None:
    """Three decode steps of requests of these prompt lengths, eager and stacked from the same cache.
    (tests/test_lowbit_kernels.py reruns it on the kernels' narrower instruction paths.)"""
    runner = ModelRunner(model, blocks, PAGE, paged_attention=True, kv_dtype=kv_dtype)
    assert runner.k_cache[0].dtype == kv_dtype
    assert stack.unavailable_reason(runner) is None
    stacked = stack.StackedDecode(runner)
    seqs = prefilled(runner, lengths)
    before = caches_of(runner)
    for _ in range(3):  # each step writes a position the next one reads
        with torch.inference_mode():
            eager = runner.step(StepPlan(decode=seqs))
            eager_caches = caches_of(runner)
            for cache, saved in zip(runner.k_cache + runner.v_cache, before, strict=True):
                cache.copy_(saved)  # the stacked step starts from the same cache
            got = stacked.decode(seqs)
        # The same 4-bit kernels. The norms, rotary and SiLU round differently in their last bits, and
        # where a value sits on a rounding edge its int8 code flips: the eager step itself moves
        # ~1% with its input scaled by 1 + 1e-6. Over 8 seeds of these models: logits ≤ 3.3% apart,
        # caches ≤ 0.6%; leaving out the q|k|v bias moved them 26-100%.
        assert relative_error(got, eager) < 0.06
        assert max(relative_error(from_cache(cache, torch.float32), from_cache(expected, torch.float32))
                   for cache, expected in zip(runner.k_cache + runner.v_cache, eager_caches, strict=True)) < 0.02
        before = caches_of(runner)
        for seq, row in zip(seqs, eager, strict=True):
            seq.append(int(row.argmax()))


def test_the_engine_chooses_the_stack_by_measurement_and_then_compiles_nothing_it_covers(llama, monkeypatch):
    monkeypatch.setattr(stack, "MIN_GAIN", -10.0)  # whatever this machine measures, the stack counts as faster
    manager = OwnedManager(llama, num_blocks=BLOCKS, page_size=PAGE, max_batch_tokens=64, prefix_sharing=False,
                           compile_buckets=(1, 2), paged_attention=True)
    manager.start()
    try:
        report = manager.stack_report
        assert report.state == "used" and report.max_rows == 16 and manager.runner.stacked is not None
        assert [t.rows for t in report.timings] == [1, 2] and all(t.eager_ms > 0 and t.stacked_ms > 0 for t in report.timings)
        assert manager.compiler is None  # the graphs for 1 and 2 rows would never run
        assert "decode steps in one C++ call, up to 16 rows: 1 row eager" in report.describe()
        calls = []
        step = manager.runner.stacked.decode
        manager.runner.stacked.decode = lambda seqs: calls.append(len(seqs)) or step(seqs)
        answers = run_to_the_end(manager, {"a": [5, 6, 7, 8], "b": [9, 10, 11]}, 6)
        assert [len(tokens) for tokens in answers.values()] == [6, 6] and 2 in calls
    finally:
        manager.stop(timeout=10)


def test_a_stack_that_measures_slower_is_not_used(llama, monkeypatch):
    monkeypatch.setattr(stack, "MIN_GAIN", 10.0)  # no step can be 1000% faster
    runner = ModelRunner(llama, BLOCKS, PAGE, paged_attention=True)
    report = stack.install(runner, (1, 4))
    assert report.state == "slower" and runner.stacked is None
    assert [t.rows for t in report.timings] == [1, 4] and report.describe().endswith("ms") and "not used, slower" in report.describe()


def test_runners_the_stack_cannot_serve_say_why(llama):
    fp32 = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    assert stack.unavailable_reason(ModelRunner(fp32, BLOCKS, PAGE, paged_attention=True)) == (
        "the block linears are not 4-bit weights on Ceiling's kernels")
    assert stack.unavailable_reason(ModelRunner(llama, BLOCKS, PAGE, paged_attention=False)) == (
        "the activations are not fp32 on a CPU with Ceiling's kernels loaded")
    report = stack.install(ModelRunner(fp32, BLOCKS, PAGE, paged_attention=True))
    assert report.state == "unavailable" and report.describe() == (
        "decode steps in one C++ call: not here (the block linears are not 4-bit weights on Ceiling's kernels)")
    unmeasured = four_bit_model(lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)), q4_max_rows=0)
    assert stack.unavailable_reason(ModelRunner(unmeasured, BLOCKS, PAGE, paged_attention=True)) == (
        "the 4-bit route serves no decode rows on this machine")


@pytest.mark.parametrize(("tokens", "lengths", "tables", "message"), [
    ([320], [3], [[0]], "token 320 is not in the vocabulary"),
    ([5], [0], [[0]], "row 0 has length 0"),
    ([5], [400], [[0] * 50], "the rotary table holds 384 positions"),  # one per cache slot
    ([5], [9], [[0]], "row 0's block table is 1 blocks, its length needs 2"),
    ([5], [3], [[BLOCKS + 1]], f"block {BLOCKS + 1} is past the cache's {BLOCKS + 1}"),
    ([5, 6], [3], [[0]], "tokens and lengths must be \\[rows\\] int64"),
])
def test_inputs_the_stack_cannot_serve_are_refused_with_the_reason_and_nothing_is_written(
        llama, tokens, lengths, tables, message):
    runner = ModelRunner(llama, BLOCKS, PAGE, paged_attention=True)
    for cache in runner.k_cache + runner.v_cache:
        cache.normal_()
    before = caches_of(runner)
    with pytest.raises(RuntimeError, match=message):
        runner_stack = stack.build(runner, runner.k_cache, runner.v_cache)
        runner_stack.step(torch.tensor(tokens), torch.tensor(lengths), torch.tensor(tables))
    assert all(torch.equal(cache, saved) for cache, saved in zip(runner.k_cache + runner.v_cache, before, strict=True))


def test_weights_the_step_would_misread_are_refused_when_the_stack_is_built(llama):
    runner = ModelRunner(llama, BLOCKS, PAGE, paged_attention=True)
    qkv = runner.layers[0].linears[0]
    short_scales = qkv.q4_scales_and_zeros[:-1]  # one output row's scales missing: the step would read past them
    with pytest.raises(RuntimeError, match="scales_and_mins a contiguous"):
        build_with(runner, qkv_scales=short_scales)
    with pytest.raises(RuntimeError, match="same intermediate size"):
        build_with(runner, layer=1, down_codes=runner.layers[1].linears[3].q4_weight[:, :-16],
                   gate_up_codes=runner.layers[1].linears[2].q4_weight[:-64])


def build_with(runner: ModelRunner, layer: int = 0, **replaced):
    """stack.build's calls, with some of layer `layer`'s tensors replaced."""
    built = torch.classes.ceiling.DecodeStack(runner.embed, runner.cos.contiguous(), runner.sin.contiguous(),
                                              runner.final_norm, runner.heads, runner.kv_heads, runner.page_size,
                                              float(runner.eps))
    for index, (each, k_cache, v_cache) in enumerate(zip(runner.layers, runner.k_cache, runner.v_cache, strict=True)):
        qkv, o, gate_up, down = each.linears
        tensors = {"qkv_codes": qkv.q4_weight, "qkv_scales": qkv.q4_scales_and_zeros, "gate_up_codes": gate_up.q4_weight,
                   "down_codes": down.q4_weight}
        if index == layer:
            tensors |= replaced
        built.add_layer(each.input_norm, each.post_norm, tensors["qkv_codes"], tensors["qkv_scales"], torch.empty(0),
                        o.q4_weight, o.q4_scales_and_zeros, tensors["gate_up_codes"], gate_up.q4_scales_and_zeros,
                        tensors["down_codes"], down.q4_scales_and_zeros, k_cache, v_cache)
    return built
