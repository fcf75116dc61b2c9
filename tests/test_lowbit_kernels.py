"""Ceiling's own 4-bit and int8 kernels (inference/engine/kernels): built here, exact to a reference
of the same arithmetic, chosen by the q4 variant where they build, torch's kernels where they don't."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from inference.engine import kernels
from inference.engine.patches.fusion import fuse_linears
from inference.engine.patches.quantization import (
    OWN_KERNELS,
    Q4,
    Q4_GROUP,
    TORCH_KERNELS,
    mode_of,
    pack_q4,
    q4_forward,
    q8_forward,
)
from inference.engines import engine_config_from_settings, model_dir
from tests.questions import ROBUST_ANSWER, ROBUST_QUESTION
from tests.test_fusion import ThreeHeads, parts
from tests.test_q4 import TinyDecoder, on_grid

REPOSITORY = Path(__file__).resolve().parent.parent


def engine_kernel_folder() -> Path:
    """Where the engines of this checkout keep the library (engine_config_from_settings)."""
    return engine_config_from_settings(model_dir()).kernel_cache_dir


@pytest.fixture(scope="module", autouse=True)
def built():
    # The engines' own library (built once per machine; a compile is a minute on 2 cores): these
    # tests check the kernels every engine here runs on. The build itself is checked below.
    failure = kernels.load(engine_kernel_folder())
    assert failure is None, failure


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernels quantize it: per 32 values, int8 codes (round half to even) and the scale largest |x| / 127."""
    groups = x.double().reshape(x.shape[0], -1, Q4_GROUP)
    largest = groups.abs().amax(-1, keepdim=True).float().double()
    scale = (largest.float() / 127).double()
    inverse = torch.where(largest > 0, (127 / largest.float()).double(), torch.zeros_like(largest))
    codes = torch.round((groups.float() * inverse.float()).double())
    return codes, scale


def random_q4(out_features: int, in_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // Q4_GROUP
    codes = torch.randint(0, 16, (out_features, groups, Q4_GROUP), generator=generator)
    scale = (torch.rand(out_features, groups, generator=generator) * 0.02).half()
    minimum = (torch.randn(out_features, groups, generator=generator) * 0.05).half()
    return codes, scale, minimum


def q4_reference(x: torch.Tensor, codes, scale, minimum) -> torch.Tensor:
    """Σ_g d·s·Σ q·q_x + m·Σx, in float64: the kernel's arithmetic without its summation order."""
    x_codes, x_scale = quantized_activations(x)
    dots = torch.einsum("rgj,ogj->rog", x_codes, codes.double())
    sums = x.double().reshape(x.shape[0], -1, Q4_GROUP).sum(-1)
    return (dots * scale.double()[None] * x_scale[..., 0][:, None] + minimum.double()[None] * sums[:, None]).sum(-1)


@pytest.mark.parametrize("in_features", [32, 96, 576, 1536])  # one group; 3 (a last half-chunk of one); a last chunk of 2; whole chunks
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])  # blocks of 4, 2 and 1 output rows; tiles of 4 input rows and a narrower last one
def test_the_4_bit_kernel_computes_the_quantized_product(in_features, rows):
    codes, scale, minimum = random_q4(70, in_features)
    packed, scales_and_mins = kernels.pack_q4(codes, scale, minimum)
    # Seeded: an activation whose x·127/max lands within an ulp of a half step rounds to either code,
    # and unseeded, which values came depended on the tests that ran before (a 0.4% miss, once in
    # a targeted run on a Zen 4 EPYC).
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows * 10_000 + in_features))
    got = torch.ops.ceiling.q4_linear(x, packed, scales_and_mins)
    assert got.shape == (rows, 70) and got.dtype == torch.float32
    expected = q4_reference(x, codes, scale, minimum)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # Against the exact product, the activations' int8 rounding is the only error: ~0.5% of the largest output.
    weight = codes.double() * scale.double()[..., None] + minimum.double()[..., None]
    exact = x.double() @ weight.reshape(70, in_features).t()
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("in_features", [32, 576, 608])
@pytest.mark.parametrize("rows", [1, 2, 5])  # blocks of 4, 2 and 1 output rows
def test_the_int8_kernel_computes_the_quantized_product(in_features, rows):
    generator = torch.Generator().manual_seed(1)
    weights = torch.randint(-127, 128, (300, in_features), generator=generator, dtype=torch.int8)
    row_scales = torch.rand(300, generator=generator) * 0.01
    x = torch.randn(rows, in_features, generator=generator)  # seeded, as in the 4-bit test above
    got = torch.ops.ceiling.q8_linear(x, (weights.int() + 128).to(torch.uint8), row_scales)
    x_codes, x_scale = quantized_activations(x)
    dots = torch.einsum("rgj,ogj->rog", x_codes, weights.double().reshape(300, -1, Q4_GROUP))
    expected = (dots * x_scale[..., 0][:, None]).sum(-1) * row_scales.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_inputs_the_kernels_cannot_read_are_refused_with_the_reason():
    packed, scales_and_mins = kernels.pack_q4(*random_q4(8, 64))
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \[rows, in\] float32 tensor"):
        torch.ops.ceiling.q4_linear(torch.randn(2, 64).double(), packed, scales_and_mins)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weights 64"):
        torch.ops.ceiling.q4_linear(torch.randn(2, 96), packed, scales_and_mins)
    with pytest.raises(RuntimeError, match=r"scales_and_mins must be a contiguous \[out, ceil\(in/128\), 8\] float16"):
        torch.ops.ceiling.q4_linear(torch.randn(2, 64), packed, scales_and_mins.float())
    with pytest.raises(RuntimeError, match=r"codes must be a contiguous \[out, in\] uint8 tensor \(the int8 weights \+ 128\)"):
        torch.ops.ceiling.q8_linear(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))


def test_q4_packs_for_the_own_kernels_and_multiplies_as_the_fp32_weights():
    weight = on_grid(96, 576)
    model = pack_q4(TinyDecoder(weight), own_kernels=True)
    layer, head = model.layers[0], model.lm_head
    assert mode_of(model) == Q4 and layer.q4_kernel == head.q4_kernel == OWN_KERNELS
    assert layer.q4_weight.shape == (96, 288) and layer.q4_scales_and_zeros.shape == (96, 5, 8)
    assert head.q8_weight.dtype == torch.uint8 and head.q8_scales.dtype == torch.float32
    x = torch.randn(3, 576)
    expected = nn.functional.linear(x, weight)
    assert (q4_forward(layer, x) - expected).abs().max() < 0.02 * expected.abs().max()
    logits = nn.functional.linear(expected, head.weight)
    assert (q8_forward(head, expected) - logits).abs().max() < 0.03 * logits.abs().max()


def test_scales_a_float16_cannot_hold_keep_the_torch_kernels():
    weight = on_grid(96, 128) * 1.1  # scales 1.1·2⁻ᵏ: not float16 numbers, so the own layout would round them
    model = pack_q4(TinyDecoder(weight), own_kernels=True)
    assert model.layers[0].q4_kernel == model.lm_head.q4_kernel == TORCH_KERNELS
    assert model.layers[0].q4_scales_and_zeros.dtype == torch.bfloat16


def test_fused_layers_of_any_size_concatenate_in_the_own_layout():
    model = pack_q4(ThreeHeads(parts(sizes=(96, 32, 32))), own_kernels=True)  # not multiples of 64 rows
    x = torch.randn(2, 128)
    expected = torch.cat([q4_forward(layer, x) for layer in model.layers], dim=-1)
    fused = fuse_linears(list(model.layers))
    assert fused.q4_kernel == OWN_KERNELS and fused.q4_weight.shape == (160, 64)
    assert torch.equal(q4_forward(fused, x), expected)  # row by row, the same arithmetic


def test_torch_compile_traces_through_the_kernels():
    model = pack_q4(TinyDecoder(on_grid(96, 128)), own_kernels=True)
    layer = model.layers[0]
    step = torch.compile(lambda x: nn.functional.silu(q4_forward(layer, x)) * 2, fullgraph=True)
    x = torch.randn(1, 128)
    torch.testing.assert_close(step(x), nn.functional.silu(q4_forward(layer, x)) * 2)


def test_a_built_library_is_reused_and_a_failed_build_says_why(tmp_path, monkeypatch):
    # The engines' folder: built already if an engine loaded here before (else built now); a
    # compile into an empty folder, and its temporary file, are checked on the narrower paths below.
    folder = engine_kernel_folder()
    first = kernels.build(folder)
    built_at = first.stat().st_mtime_ns
    assert kernels.build(folder) == first and first.stat().st_mtime_ns == built_at
    assert not list(folder.glob(f".{first.name}.*"))  # no temporary file of its build left behind
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: another fingerprint, so a build is tried
    with pytest.raises(kernels.KernelBuildError, match="false failed"):
        kernels.build(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left of the failed build


# The paths lowbit.cpp has besides the one -march=native takes here: AVX-512 VNNI, AVX2, plain loops.
# Each CPU runs its own above; these rebuild it without the wider instructions and rerun the
# product and attention tests on that library, in a process of its own (one library per process
# can own the ceiling:: namespace).
NARROWER_PATHS = {"avx2": ("-mno-avx512f",), "plain loops": ("-mno-avx512f", "-mno-avx2")}


@pytest.mark.parametrize("path", sorted(NARROWER_PATHS))
def test_the_narrower_instruction_paths_compute_the_same_products(path, tmp_path):
    if path == "avx2" and not ("avx512f" in kernels._cpu_flags() and "avx2" in kernels._cpu_flags()):
        pytest.skip("the native build is the AVX2 path on this CPU (no AVX-512), or it has no AVX2")
    library = kernels.build(tmp_path, NARROWER_PATHS[path])
    assert [p.name for p in tmp_path.iterdir()] == [library.name]  # compiled, renamed, no temporary file left
    script = (
        "import django; django.setup()\n"
        "import torch\n"
        f"torch.ops.load_library({str(library)!r})\n"
        "from tests import test_lowbit_kernels as products, test_paged_attention as attention\n"
        "for in_features in (32, 96, 576):\n"
        "    for rows in (1, 2, 9):\n"
        "        products.test_the_4_bit_kernel_computes_the_quantized_product(in_features, rows)\n"
        "for in_features, rows in ((576, 1), (608, 5)):\n"
        "    products.test_the_int8_kernel_computes_the_quantized_product(in_features, rows)\n"
        "for shape in ((1, 300, 9, 3), (4, 77, 9, 3), (2, 40, 16, 2)):\n"
        "    attention.test_the_kernel_computes_the_gathered_attention(*shape)\n"
        "    attention.test_the_kernel_reads_an_fp16_cache_as_the_same_values_widened(*shape)\n"
        "    attention.test_the_kernel_reads_an_int8_cache_as_its_codes_times_their_scales(*shape)\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from tests import test_decode_stack as stacked\n"
        "model = stacked.four_bit_model(lambda: LlamaForCausalLM(LlamaConfig(**stacked.SHAPE)))\n"
        "stacked.assert_stacked_steps_match_eager(model, [5, 40, 17])\n"
        "stacked.assert_stacked_steps_match_eager(model, [5, 40, 17], kv_dtype=torch.float16)\n"
        "stacked.assert_stacked_steps_match_eager(model, [5, 40, 17], kv_dtype=torch.int8)\n"
        "torch.set_num_threads(max(2, torch.get_num_threads()))\n"
        "stacked.assert_stacked_steps_match_eager(model, [400, 1], blocks=stacked.LONG_BLOCKS)\n"
        "stacked.assert_stacked_steps_match_eager(model, [300], kv_dtype=torch.float16, blocks=stacked.LONG_BLOCKS)\n"
        "stacked.assert_stacked_steps_match_eager(model, [300], kv_dtype=torch.int8, blocks=stacked.LONG_BLOCKS)\n"
        "print('all equal')\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], cwd=REPOSITORY, capture_output=True, text=True,
                              timeout=300, env=os.environ | {"DJANGO_SETTINGS_MODULE": "project.settings"})
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "all equal" in finished.stdout


def test_an_engine_where_the_kernels_cannot_build_serves_q4_on_torchs(tmp_path):
    """In a process of its own: a load's outcome is kept for the process's life."""
    script = (
        "from dataclasses import replace\n"
        "from pathlib import Path\n"
        "from inference.engine import Engine\n"
        "from inference.engines import engine_config_from_settings, model_dir\n"
        f"config = replace(engine_config_from_settings(model_dir()), quantization='q4', num_blocks=32, "
        f"skinny_linear=False, kernel_cache_dir=Path({str(tmp_path)!r}))\n"
        "engine = Engine(config)\n"
        "engine.load(progress=print)\n"
        "layers = [m for m in engine.model.modules() if hasattr(m, 'q4_weight')]\n"
        "print('kernels', engine.kernels, {m.q4_kernel for m in layers}, engine.model.lm_head.q4_kernel)\n"
    )
    environment = os.environ | {"CXX": "/nonexistent/g++", "PATH": "/usr/bin/nonexistent", "DJANGO_SETTINGS_MODULE": "project.settings"}
    finished = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + script],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "4-bit kernels: torch's (KernelBuildError: no C++ compiler (g++ or c++) on the PATH)" in finished.stdout
    assert "kernels torch {'torch'} torch" in finished.stdout


@pytest.fixture
def own_kernels_engine(q4_engine):
    """The real model's q4 variant on the own kernels, loaded once for the session (tests/conftest.py;
    not started). These tests route every step themselves."""
    return q4_engine


def test_the_real_model_answers_on_the_own_kernels(own_kernels_engine):
    engine = own_kernels_engine
    assert engine.kernels == OWN_KERNELS
    for layer in [m for m in engine.model.modules() if hasattr(m, "q4_weight")] + [engine.model.lm_head]:
        layer.q4_max_rows = 64  # every decode step on the kernels, whatever this machine measured
    engine.start()
    try:
        prompt = engine.encode_chat([{"role": "user", "content": ROBUST_QUESTION}])
        tokens = [t for event in engine.submit("own-kernels", prompt, 12).events(timeout=120) for t in event.new_tokens]
        assert ROBUST_ANSWER in engine.tokenizer.decode(tokens)
    finally:
        engine.stop()


@pytest.mark.timeout(1200)  # a cold inductor cache on a loaded 2-core machine
def test_a_compiled_lone_step_on_the_own_kernels_approximates_fp32_as_the_eager_one_does(own_kernels_engine):
    """The graph calls the kernels as eager steps do (same layers, same layout), but its fused norms
    differ from eager ones in the last bit, and int8 rounding can turn that into another code: the
    two steps are two approximations of the fp32 step, equally good but not equal. Measured (max
    logit error against fp32, graph vs eager, two prompts, two kernel versions): 1.31 vs 1.28, 2.70
    vs 1.18, 1.74 vs 1.12, 2.44 vs 1.62. Bound: the same next token, and the graph's error within 3×
    the eager one's (a graph on the wrong weight layout is off by tens)."""
    from inference.engine.owned.compiled import DecodeRow, decode_arguments, decode_step_function
    from inference.engine.owned.runner import ModelRunner

    engine = own_kernels_engine
    packed = [m for m in engine.model.modules() if hasattr(m, "q4_weight")] + [engine.model.lm_head]
    runner = ModelRunner(engine.model, num_blocks=8, page_size=32)
    eager = decode_step_function(runner)
    compiled = torch.compile(eager, dynamic=True)
    prompt = engine.encode_chat([{"role": "user", "content": ROBUST_QUESTION}])

    def route(rows: int) -> None:  # 0: every step on the fp32 weights; 64: on the kernels
        for layer in packed:
            layer.q4_max_rows = rows

    with torch.inference_mode():
        route(64)
        for position, token in enumerate(prompt):  # fill the cache one row at a time, eagerly
            logits = eager(*decode_arguments(runner, [DecodeRow(token, [0, 1], position + 1)], 1, runner.k_cache, runner.v_cache))
        arguments = decode_arguments(runner, [DecodeRow(int(logits.argmax()), [0, 1], len(prompt) + 1)], 1,
                                     runner.k_cache, runner.v_cache)
        from_graph, from_eager = compiled(*arguments), eager(*arguments)
        route(0)
        from_fp32 = eager(*arguments)
    assert int(from_graph.argmax()) == int(from_eager.argmax()) == int(from_fp32.argmax())
    assert (from_graph - from_fp32).abs().max() <= 3 * (from_eager - from_fp32).abs().max()
