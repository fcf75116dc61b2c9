"""A restart takes what an earlier start on this machine timed (inference/engine/measured.py): the same
routes, the same decode stack, the same compiled buckets, without timing anything again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from inference.engine import Engine
from inference.engine.measured import KeptMeasurements, kept_measurements, measurement_key
from inference.engine.owned import compiled as compiled_module
from inference.engine.owned import stack as stack_module
from inference.engine.owned.compiled import DecodeCompiler
from inference.engine.patches import linears, quantization
from inference.engine.patches.quantization import Q4, q4_routes
from inference.engines import engine_config_from_settings, model_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def q4_config(tmp_path):
    return replace(engine_config_from_settings(model_dir()), num_blocks=64, quantization=Q4, compile_buckets=(),
                   measurements_file=tmp_path / "engine-measurements.json", remeasure=False)


def answer(engine: Engine) -> list[int]:
    handle = engine.submit("kept-answer", engine.encode_chat(QUESTION), 12)
    return [token for event in handle.events(timeout=120) for token in event.new_tokens]


def loaded(config, lines: list[str]) -> Engine:
    engine = Engine(config)
    engine.load(progress=lines.append)
    engine.start()
    return engine


def forbid_timing(monkeypatch) -> None:
    def timed(*_args, **_kwargs):
        raise AssertionError("a kept measurement was timed again")

    monkeypatch.setattr(linears, "time_routes", timed)
    monkeypatch.setattr(quantization, "time_routes", timed)
    monkeypatch.setattr(stack_module, "_timed", timed)


def test_a_second_start_routes_as_the_first_measured_without_timing_and_answers_the_same(tmp_path, monkeypatch):
    config = q4_config(tmp_path)
    first_lines: list[str] = []
    first = loaded(config, first_lines)
    try:
        measured = {"skinny": first.skinny_buckets, "q4": first.q4_max_rows, "wide": first.wide_min_rows,
                    "routes": q4_routes(first.model), "stack": first.manager.stack_report.state,
                    "bytes": first.weights_bytes}
        first_answer = answer(first)
    finally:
        first.stop()
    kept = json.loads(config.measurements_file.read_text())
    assert list(kept) == [measurement_key(config)]
    assert set(kept[measurement_key(config)]["values"]) == {"skinny_rows", f"q4_routes.{first.kernels}", "decode_stack"}
    assert not any("kept from an earlier start" in line for line in first_lines)

    forbid_timing(monkeypatch)
    second_lines: list[str] = []
    second = loaded(config, second_lines)
    try:
        assert {"skinny": second.skinny_buckets, "q4": second.q4_max_rows, "wide": second.wide_min_rows,
                "routes": q4_routes(second.model), "stack": second.manager.stack_report.state,
                "bytes": second.weights_bytes} == measured
        assert second.manager.stack_report.kept and "kept from an earlier start" in second.manager.stack_report.describe()
        assert sum("kept from an earlier start on this machine" in line for line in second_lines) >= 2
        assert answer(second) == first_answer
    finally:
        second.stop()


def test_remeasure_times_again_and_replaces_what_was_kept(tmp_path):
    config = replace(q4_config(tmp_path), remeasure=True)
    kept = kept_measurements(config)
    kept.keep("skinny_rows", [{"rows": 2, "f_linear_ms": 9.0, "skinny_ms": 1.0}])
    assert kept.recall("skinny_rows") is None  # remeasure: nothing is taken from the file
    assert kept.measured("skinny_rows", lambda: ["timed now"]) == (["timed now"], False)
    assert replace(kept, remeasure=False).recall("skinny_rows") == ["timed now"]


def test_another_cpu_threads_variant_or_model_is_another_key(tmp_path, monkeypatch):
    config = q4_config(tmp_path)
    key = measurement_key(config)
    assert measurement_key(config) == key  # the hour, the port, the process change nothing
    assert measurement_key(replace(config, torch_threads=config.torch_threads + 1)) != key
    assert measurement_key(replace(config, quantization="none")) != key
    assert measurement_key(replace(config, kv_dtype="float32" if config.kv_dtype == "float16" else "float16")) != key
    monkeypatch.setattr("inference.engine.measured.cpu_identity", lambda: "another CPU | 2 cores | abc")
    assert measurement_key(config) != key


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"k": {"values": "not a dict"}})])
def test_a_torn_or_foreign_file_is_timed_again_and_rewritten(tmp_path, content):
    path = tmp_path / "engine-measurements.json"
    path.write_text(content)
    kept = KeptMeasurements(path, "k")
    assert kept.measured("q4_routes", lambda: {"q4_max_rows": 8}) == ({"q4_max_rows": 8}, False)
    assert json.loads(path.read_text())["k"]["values"]["q4_routes"] == {"q4_max_rows": 8}


def test_no_file_keeps_nothing_and_times_every_time(tmp_path):
    kept = KeptMeasurements(None)
    kept.keep("skinny_rows", [1])
    assert kept.recall("skinny_rows") is None
    assert kept.measured("skinny_rows", lambda: [2]) == ([2], False)


def test_kept_compile_verdicts_with_no_faster_bucket_compile_nothing(tmp_path, monkeypatch):
    kept = KeptMeasurements(tmp_path / "engine-measurements.json", "k")
    kept.keep("compiled_decode", [{"rows": 1, "eager_ms": 50.0, "compiled_ms": 49.0},
                                  {"rows": 8, "eager_ms": 63.2, "compiled_ms": 62.5}])
    monkeypatch.setattr(compiled_module.torch, "compile", lambda *a, **k: pytest.fail("compiled although kept slower"))
    compiler = DecodeCompiler(runner=None, threads=1, buckets=(1, 8), kept=kept)
    compiler.start()
    assert compiler.wait(timeout=30)
    assert compiler.report.state == "slower" and compiler.report.kept
    assert compiler.report.describe().startswith("decode steps compiled in 0 s: 1 row eager 50.0 ms vs compiled 49.0 ms (eager kept)")
    assert "kept from an earlier start" in compiler.report.describe()
