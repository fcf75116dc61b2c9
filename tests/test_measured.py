"""A restart takes what an earlier start on this machine timed (inference/engine/measured.py): the same
routes, the same decode stack, the same compiled buckets, without timing anything again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from inference.engine import Engine
from inference.engine import measured as measured_module
from inference.engine.measured import CONTENDED_SHARE, KeptMeasurements, MachineUse, kept_measurements, measurement_key
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


@contextmanager
def busy_neighbours():
    """A busy loop in another process on every CPU of the machine, as a compile or a test suite beside a worker."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(measured_module._machine_cpus())]
    try:
        time.sleep(0.3)  # running before the timing starts
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_a_second_start_routes_as_the_first_measured_without_timing_and_answers_the_same(tmp_path, monkeypatch):
    # What a busy start keeps is tested below; here the second start takes whatever the first timed.
    monkeypatch.setattr(measured_module, "CONTENDED_SHARE", 1.0)
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


def test_machine_use_counts_other_processes_and_not_this_one():
    quiet = []
    for _ in range(3):  # the least busy of three, should something else on the machine wake meanwhile
        with MachineUse() as use:
            spin(0.6)  # this process's own work is the timing, not a neighbour
        quiet.append(use.others_share)
    with busy_neighbours(), MachineUse() as busy:
        time.sleep(0.6)
    assert None not in quiet and min(quiet) < CONTENDED_SHARE, quiet
    assert busy.others_share > 0.6, busy.others_share


def test_a_measurement_timed_beside_busy_neighbours_is_timed_again_and_the_quiet_one_kept(tmp_path, monkeypatch):
    # Halfway between a quiet machine (a few percent) and busy loops on every CPU (~100%): what else
    # the machine runs during the test must not decide it.
    monkeypatch.setattr(measured_module, "CONTENDED_SHARE", 0.5)
    path = tmp_path / "engine-measurements.json"
    kept = KeptMeasurements(path, "k")
    with busy_neighbours():
        assert kept.measured("q4_routes", lambda: spin(0.5) or "busy") == ("busy", False)
    busy_share = json.loads(path.read_text())["k"]["others_share"]["q4_routes"]
    assert busy_share > measured_module.CONTENDED_SHARE

    assert kept.measured("q4_routes", lambda: spin(0.5) or "quiet") == ("quiet", False)
    quiet_share = json.loads(path.read_text())["k"]["others_share"]["q4_routes"]
    assert quiet_share < measured_module.CONTENDED_SHARE
    assert kept.measured("q4_routes", lambda: pytest.fail("a quiet measurement was timed again")) == ("quiet", True)


def test_a_retiming_no_quieter_than_the_kept_one_leaves_it(tmp_path):
    path = tmp_path / "engine-measurements.json"
    kept = KeptMeasurements(path, "k")
    kept.keep("q4_routes", "earlier", others_share=CONTENDED_SHARE + 0.01)
    with busy_neighbours():
        assert kept.measured("q4_routes", lambda: spin(0.5) or "busier") == ("earlier", True)
    entry = json.loads(path.read_text())["k"]
    assert entry["values"]["q4_routes"] == "earlier"
    assert entry["others_share"]["q4_routes"] == round(CONTENDED_SHARE + 0.01, 3)


def test_a_file_from_before_the_shares_is_taken_as_quiet(tmp_path):
    path = tmp_path / "engine-measurements.json"
    path.write_text(json.dumps({"k": {"values": {"skinny_rows": [1, 2]}}}))
    kept = KeptMeasurements(path, "k")
    assert kept.measured("skinny_rows", lambda: pytest.fail("timed again")) == ([1, 2], True)


def test_an_engine_whose_retiming_is_busier_routes_as_the_kept_quieter_start(tmp_path, monkeypatch):
    """The engine applies a kept answer that stands after timing again, not the routes its timing left."""
    config = q4_config(tmp_path)
    first = loaded(config, [])
    try:
        measured_routes = q4_routes(first.model)
        name = f"q4_routes.{first.kernels}"
    finally:
        first.stop()
    kept = kept_measurements(config)
    earlier = kept.recall(name)
    # An earlier start that routed no step to the 4-bit kernels, timed just over the contended share.
    earlier["routes"] = {route: 0 if route.endswith("q4_max_rows") else value
                         for route, value in measured_routes.items()}
    earlier["q4_max_rows"] = 0
    kept.keep(name, earlier, others_share=CONTENDED_SHARE + 0.01)
    assert earlier["routes"] != measured_routes

    retimed = []
    original = linears.time_routes
    monkeypatch.setattr(quantization, "time_routes", lambda *a, **k: retimed.append(1) or original(*a, **k))
    lines: list[str] = []
    with busy_neighbours():
        second = loaded(config, lines)
    try:
        assert retimed, "a kept measurement timed on a busy machine was not timed again"
        assert q4_routes(second.model) == earlier["routes"]
        assert second.q4_max_rows == 0
        assert kept.recall(name)["routes"] == earlier["routes"]
    finally:
        second.stop()
