"""The `--quick` burst on one q4 engine, with and without a change, in alternating rounds.

The machine this runs on is shared and moves ±10% from minute to minute, so a change to the
engine's hot loop is judged by a ratio inside one run: one engine is loaded once, and each round
replays the same burst (24 requests at once, EOS ignored) one way and the other, in ABBA order so
a machine slowing down or speeding up falls on both. What alternates:

- `wide`: wide steps' bf16 copy of the weights (patches/quantization.py, measure_wide_rows) on,
  against the routes those steps took before (4-bit up to the measured rows, fp32 above);
- `buckets`: every compiled decode bucket of `--compile-buckets` installed, against only those
  of up to 8 rows (the default buckets before).

Run with Django's settings (the model folder comes from them; hence it lives in inference/tools, not in the
Django-free engine package):

    .venv/bin/python manage.py shell -c "from inference.tools.burst_ab import main; main(['--rounds', '2'])"

It prints one line per run and the medians, and writes them as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from inference.engine.bench.measure import RequestTiming, summarise
from inference.engine.bench.modes import _drain, replay_on_engine
from inference.engine.bench.workload import WorkloadSpec, mixed_workload
from inference.engine.patches.quantization import NEVER, keep_wide_copy

QUICK_REQUESTS = 24


def packed_modules(engine) -> list:
    """Every layer that routes by rows: the model's own and the runner's fused ones."""
    modules = [m for m in engine.model.modules() if hasattr(m, "wide_min_rows")]
    for layer in engine.manager.runner.layers:
        for forward in (layer.qkv, layer.gate_up):
            fused = getattr(forward, "__self__", None)
            if fused is not None and hasattr(fused, "wide_min_rows"):
                modules.append(fused)
    return modules


def wide_switch(engine, start: int = 0):
    """A function turning the wide steps' bf16 route on or off on every layer: as loaded, or from
    `start` rows (a load-time measurement on a busy machine can miss what the burst would gain)."""
    modules = packed_modules(engine)
    if start:
        keep_wide_copy(modules, start)
    measured = [(m, m.q4_max_rows, m.wide_min_rows) for m in modules]
    narrow = engine.q4_max_rows_before_wide

    def switch(on: bool) -> None:
        for module, q4_max_rows, wide_min_rows in measured:
            module.q4_max_rows = q4_max_rows if on else narrow
            module.wide_min_rows = wide_min_rows if on else NEVER

    return switch


def bucket_switch(engine):
    """A function installing all compiled buckets, or only those of up to 8 rows."""
    runner = engine.manager.runner
    steps = dict(engine.manager.compiler.compiled_steps)

    def switch(on: bool) -> None:
        runner.decode_steps = {rows: step for rows, step in steps.items() if on or rows <= 8}

    return switch


def run_burst(engine, requests, prompts) -> dict:
    summary = summarise(replay_on_engine(engine, requests, prompts), 0.0)
    return {key: summary[key] for key in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms") if key in summary}


def main(argv: list[str] | None = None) -> dict:
    from inference.engine import Engine
    from inference.engines import engine_config_from_settings, model_dir

    parser = argparse.ArgumentParser(prog="burst_ab")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experiment", choices=("wide", "buckets"), default="wide")
    parser.add_argument("--wide-from", type=int, default=0, help="wide: the bf16 copy from this many rows (0: as measured)")
    parser.add_argument("--compile-buckets", default="", help="e.g. 1,2,4,8 (empty: eager steps)")
    parser.add_argument("--json", type=Path, default=Path("var/bench/burst_ab.json"))
    options = parser.parse_args(argv or [])
    buckets = tuple(int(b) for b in options.compile_buckets.split(",") if b)
    config = replace(engine_config_from_settings(model_dir()), quantization="q4", compile_buckets=buckets,
                     q4_wide_bf16=options.experiment == "wide")
    engine = Engine(config)
    engine.load(progress=print)
    engine.start()
    try:
        if buckets and not engine.wait_for_compile(timeout=1800):
            raise RuntimeError("the decode steps were still compiling after 1800 s")
        requests = mixed_workload(WorkloadSpec(requests=QUICK_REQUESTS))
        prompts = [engine.encode_chat(r.messages) for r in requests]
        switch = wide_switch(engine, options.wide_from) if options.experiment == "wide" else bucket_switch(engine)
        _drain(engine.submit("warm-up", prompts[0][:16], 2, ignore_eos=True), RequestTiming(-1, 0.0))
        run_burst(engine, requests, prompts)  # the first burst fills the shared prefix's blocks: not counted
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for round_ in range(options.rounds):
            for name in ("before", "after") if round_ % 2 == 0 else ("after", "before"):  # ABBA: a trend falls on both
                switch(name == "after")
                runs[name].append(run_burst(engine, requests, prompts))
                print(f"round {round_} {name}: {runs[name][-1]}", flush=True)
    finally:
        engine.stop()
    medians = {name: {key: statistics.median(r[key] for r in results) for key in results[0]} for name, results in runs.items()}
    ratio = medians["after"]["output_tokens_per_s"] / medians["before"]["output_tokens_per_s"]
    result = {"experiment": options.experiment, "runs": runs, "medians": medians, "after_over_before_tok_s": round(ratio, 3),
              "q4_max_rows": engine.q4_max_rows, "wide_min_rows": engine.wide_min_rows,
              "compile": None if engine.compile_report() is None else engine.compile_report().as_dict()}
    print(f"{options.experiment}: medians {medians}; after ÷ before output tok/s {ratio:.3f}", flush=True)
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps(result, indent=1))
    return result
