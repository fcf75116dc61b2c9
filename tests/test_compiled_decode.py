"""Decode steps as compiled graphs by batch bucket (inference/engine/owned/compiled.py): built in the
background while the loop serves, the same tokens as greedy decoding alone and in padded batches,
no recompile at any length or block layout, and the eager path wherever no graph applies."""

from __future__ import annotations

import pytest
import torch

from inference.engine import Engine, EngineConfig, kernels
from inference.engine.owned.compiled import CompileReport, DecodeRow, decode_arguments, decode_step_function
from inference.engine.owned.manager import OwnedManager
from inference.engines import model_dir
from tests.test_owned_engine import greedy, model, prompts, run_to_the_end  # noqa: F401  (fixtures)

NEW_TOKENS = 12
READ_SLOTS = 6  # decode_arguments: hidden, cos, sin, k_caches, v_caches, write_slots, read_slots, lengths, mask
BUCKETS = (1, 2)  # each bucket is a compile of its own (~a minute here): the suite compiles two

pytestmark = pytest.mark.timeout(1200)  # a cold inductor cache on a loaded 2-core machine


@pytest.fixture(scope="module")
def compiled_manager(model):  # noqa: F811
    # As an engine on a CPU runs them: decode attention on Ceiling's kernel, in place in the paged
    # cache (the SDPA graph is compiled by tests/test_lowbit_kernels.py's own-kernels test).
    assert kernels.load() is None
    manager = OwnedManager(model, num_blocks=64, page_size=32, max_batch_tokens=256, prefix_sharing=False,
                           compile_buckets=BUCKETS, paged_attention=True)
    manager.start()
    try:
        assert manager.compiler is not None and manager.compiler.wait(timeout=1100), "the compile thread never finished"
        report = manager.compiler.report
        assert report.state in ("used", "slower"), report.describe()
        # Whichever way the timing went on this machine, the graphs themselves are what is under test.
        manager.runner.decode_steps = dict(manager.compiler.compiled_steps)
        yield manager
    finally:
        manager.stop(timeout=10)


def counting(manager: OwnedManager) -> list[int]:
    """Wrap every installed graph so the test sees how many rows each compiled call carried."""
    calls: list[int] = []
    for bucket, step in list(manager.runner.decode_steps.items()):
        def counted(*arguments, _step=step):
            calls.append(int(arguments[0].shape[0]))
            return _step(*arguments)
        manager.runner.decode_steps[bucket] = counted
    return calls


def test_the_compile_reports_every_bucket_timed_both_ways(compiled_manager):
    report: CompileReport = compiled_manager.compiler.report
    assert report.compile_seconds > 0
    assert [timing.rows for timing in report.buckets] == list(BUCKETS)
    assert all(timing.eager_ms > 0 and timing.compiled_ms > 0 for timing in report.buckets)
    assert [(rows, name) for _, rows, name, _ in report.timings] == [(1, "eager"), (1, "compiled"), (2, "eager"), (2, "compiled")] * 3
    assert report.describe().startswith("decode steps compiled in ") and "2 rows eager" in report.describe()
    assert [bucket["rows"] for bucket in report.as_dict()["buckets"]] == list(BUCKETS)


def test_lone_requests_through_the_graph_match_greedy(compiled_manager, model, prompts):  # noqa: F811
    calls = counting(compiled_manager)
    for index, prompt in enumerate(prompts):  # one at a time: every decode step is a lone one
        answers = run_to_the_end(compiled_manager, {f"lone-{index}": prompt}, NEW_TOKENS)
        assert answers[f"lone-{index}"] == greedy(model, prompt, NEW_TOKENS)
    assert calls and set(calls) == {1}
    assert compiled_manager.compiler.report.fallbacks == 0  # slot 0, other blocks and lengths: no recompile


def test_two_requests_share_the_two_row_graph_and_match_greedy(compiled_manager, model, prompts):  # noqa: F811
    calls = counting(compiled_manager)
    pair = {"pair-0": prompts[0], "pair-1": prompts[2]}  # different lengths: the mask hides the shorter's padding
    answers = run_to_the_end(compiled_manager, pair, NEW_TOKENS)
    assert answers["pair-0"] == greedy(model, prompts[0], NEW_TOKENS)
    assert answers["pair-1"] == greedy(model, prompts[2], NEW_TOKENS)
    assert 2 in calls


def test_three_requests_run_eagerly_past_the_largest_bucket_and_agree(compiled_manager, model, prompts):  # noqa: F811
    calls = counting(compiled_manager)
    fallbacks = compiled_manager.compiler.report.fallbacks
    answers = run_to_the_end(compiled_manager, {f"batch-{i}": p for i, p in enumerate(prompts)}, NEW_TOKENS)
    for index, prompt in enumerate(prompts):
        assert answers[f"batch-{index}"] == greedy(model, prompt, NEW_TOKENS)
    assert compiled_manager.compiler.report.fallbacks == fallbacks
    assert 3 not in calls  # three decode rows: no bucket holds them (the last steps, with fewer left, may)


def test_a_padded_row_writes_only_the_scratch_block(compiled_manager):
    """One request in the two-row graph: the padding row's K/V land in the spare block past the
    manager's blocks, and the real row's logits and K/V equal the eager step's."""
    runner = compiled_manager.runner
    shape = runner.k_cache[0].shape
    generator = torch.Generator().manual_seed(91)  # the same cache every run: a failure can be replayed
    caches = [[torch.randn(shape, generator=generator) for _ in runner.layers] for _ in range(2)]
    copies = [[cache.clone() for cache in layer_caches] for layer_caches in caches]
    row = DecodeRow(42, [9, 2, 40], 78)  # blocks out of order: a shared prefix block, a reused one
    written = 40 * runner.page_size + 77 % runner.page_size
    scratch = shape[0] - runner.page_size
    untouched = [c.clone() for c in caches[0]]
    with torch.inference_mode():
        compiled = runner.decode_steps[2](*decode_arguments(runner, [row], 2, *caches))
        eager = decode_step_function(runner)(*decode_arguments(runner, [row], 1, *copies))
    assert compiled.shape[0] == 2
    # fp32 through 30 layers of random (large) keys and values, fused differently by inductor: the
    # logits agree to ~1e-4 of their scale (seen: 2.1e-3 at a largest |logit| of 26.6), not to 1e-3 flat.
    tolerance = 2e-4 * float(eager.abs().max())
    assert torch.allclose(compiled[:1], eager, atol=tolerance, rtol=1e-3)
    top_two = eager[0].topk(2).values
    if top_two[0] - top_two[1] > 2 * tolerance:  # a near tie may go either way within that tolerance
        assert int(compiled[0].argmax()) == int(eager.argmax())
    for after, before, expected in zip(caches[0], untouched, copies[0], strict=True):
        changed = (after != before).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert set(changed) <= {written, scratch} and written in changed
        # inductor fuses the norms and the rotary into its own loops: the same values to float rounding
        # grown over the layers before, not bit for bit. The growth is steady and deterministic per CPU:
        # on a Zen 3 EPYC (AVX2) the largest difference went from 7e-8 of the row's scale at layer 1 to
        # 5.5e-5 at layer 30, past a bound of 5e-5 that had held on Intel; the logits' bound holds here.
        scale = float(expected[written].abs().max())
        assert torch.allclose(after[written], expected[written], atol=2e-4 * scale, rtol=1e-4)


def test_a_shared_prefix_request_goes_through_the_graph(model, prompts):  # noqa: F811
    """Prefix sharing hands the second request the first one's prompt blocks and fresh ones after
    them: not consecutive, and still the compiled step, token for token greedy."""
    assert kernels.load() is None
    manager = OwnedManager(model, num_blocks=64, page_size=8, max_batch_tokens=256, prefix_sharing=True,
                           compile_buckets=(1,), paged_attention=True)
    manager.start()
    try:
        assert manager.compiler.wait(timeout=1100) and manager.compiler.compiled_steps
        manager.runner.decode_steps = dict(manager.compiler.compiled_steps)
        tables = []
        step = manager.runner.decode_steps[1]
        manager.runner.decode_steps[1] = lambda *arguments: tables.append(arguments[READ_SLOTS][0]) or step(*arguments)
        for name in ("first", "second"):
            answers = run_to_the_end(manager, {name: prompts[0]}, NEW_TOKENS)
            assert answers[name] == greedy(model, prompts[0], NEW_TOKENS)
        assert manager.blocks.shared_tokens > 0
        scattered = [slots for slots in tables if not torch.equal(slots, torch.arange(int(slots[0]), int(slots[0]) + len(slots)))]
        assert scattered, "the second request's blocks should not have been consecutive"
        assert manager.compiler.report.fallbacks == 0
    finally:
        manager.stop(timeout=10)


def test_a_q4_engine_reports_its_compiled_steps_and_answers_as_it_did_eagerly(prompts):  # noqa: F811
    """The q4 variant (4-bit weights, int8 lm_head) through the graph: its stats say what the compile
    measured, and its tokens are the ones its eager steps gave. On torch's kernels, whose bf16
    activations absorb the fused kernels' last-bit differences, so the two agree token for token;
    Ceiling's own kernels round fp32 activations to int8, where such a difference can flip a code
    (tests/test_lowbit_kernels.py checks their graph)."""
    engine = Engine(EngineConfig(model_dir=model_dir(), quantization="q4", compile_buckets=(1,), own_kernels=False))
    engine.start()
    try:
        assert engine.stats().compiled_decode_state in ("compiling", "used", "slower")
        eager = _answer(engine, prompts[1], "eager")  # served while the graph compiles, or eagerly anyway
        assert engine.wait_for_compile(timeout=1100)
        stats = engine.stats()
        assert stats.compiled_decode_state in ("used", "slower"), stats.compiled_decode
        assert "1 row eager" in stats.compiled_decode and " ms vs compiled " in stats.compiled_decode
        engine.manager.runner.decode_steps = dict(engine.manager.compiler.compiled_steps)  # whichever way the timing went
        assert _answer(engine, prompts[1], "compiled") == eager
        assert engine.compile_report().fallbacks == 0
    finally:
        engine.stop()


def test_an_engine_without_the_compile_says_nothing_of_it(model):  # noqa: F811
    assert EngineConfig(model_dir=".").compile_buckets == ()
    engine = Engine(EngineConfig(model_dir=model_dir()))
    engine.start()
    try:
        assert engine.wait_for_compile(timeout=0) and engine.compile_report() is None
        assert engine.manager.runner.decode_steps == {}
        assert (engine.stats().compiled_decode_state, engine.stats().compiled_decode) == ("", "")
    finally:
        engine.stop()


def _answer(engine: Engine, prompt: list[int], name: str) -> list[int]:
    handle = engine.submit(name, prompt, NEW_TOKENS, ignore_eos=True)
    return [token for event in handle.events(timeout=300) for token in event.new_tokens]


def test_a_bucket_wider_than_the_scratch_length_gets_rows_of_one_position_or_more(model):  # noqa: F811
    # Buckets up to 64 rows are allowed (CEILING_COMPILE_BUCKETS); the compile's scratch rows are
    # 41, 40, … positions long, so past 40 rows they must stop at one rather than go empty.
    from inference.engine.owned.compiled import _scratch_rows
    from inference.engine.owned.runner import ModelRunner

    runner = ModelRunner(model, num_blocks=8, page_size=32)
    rows = _scratch_rows(runner, 64, 41)
    assert len(rows) == 64 and rows[0].length == 41 and min(row.length for row in rows) == 1
    arguments = decode_arguments(runner, rows, 64, runner.k_cache, runner.v_cache)
    with torch.inference_mode():
        logits = decode_step_function(runner)(*arguments)  # eagerly: the graph's code, no compile
    assert logits.shape == (64, model.config.vocab_size) and torch.isfinite(logits).all()
