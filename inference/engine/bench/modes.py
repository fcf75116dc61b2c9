"""The modes `manage.py bench` compares, each replaying the same workload.

sequential and static call transformers' `generate`; engine calls our continuous-batching engine in
this process; stack goes through websockets, daphne, the guard, a Celery worker and back (see
stack.py); prefix times the shared-system-prompt requests with block sharing on, then off.
Each mode except stack runs in a fresh child process (run_in_child), so its peak RSS is its own and
no mode inherits another's warm caches.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from inference.engine.bench.measure import (
    BenchError,
    ModeResult,
    RequestTiming,
    own_peak_rss_mb,
    summarise,
    timing_rows,
)
from inference.engine.bench.workload import BenchRequest
from inference.engine.patches.quantization import NEVER

STATIC_BATCH_SIZE = 8


# --- running a mode in a child process ----------------------------------------------------------


def run_in_child(mode: str, model_dir: Path, requests: list[BenchRequest], options: dict, timeout: float) -> dict:
    """Run one mode in a spawned process; returns its result as a dict (ModeResult or prefix)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_child_main, args=(mode, str(model_dir), [asdict(r) for r in requests], options, results))
    child.start()
    try:
        outcome = results.get(timeout=timeout)
    except Exception:  # queue.Empty, or the child died before answering
        child.kill()
        raise BenchError(f"the {mode} mode did not finish within {timeout:.0f} s") from None
    finally:
        child.join(timeout=30)
    if "error" in outcome:
        raise BenchError(f"the {mode} mode failed: {outcome['error']}")
    return outcome


def _child_main(mode: str, model_dir: str, requests: list[dict], options: dict, results) -> None:
    try:
        workload = [BenchRequest(**r) for r in requests]
        runner = {"sequential": run_sequential, "static": run_static, "engine": run_engine, "prefix": run_prefix}[mode]
        outcome = runner(Path(model_dir), workload, **options)
        results.put(outcome if isinstance(outcome, dict) else asdict(outcome))
    except Exception as exc:  # noqa: BLE001 - reported to the parent with its traceback
        results.put({"error": f"{exc}\n{traceback.format_exc()}"})


# --- transformers generate: one at a time, and static batches ------------------------------------


def _load_model(model_dir: Path, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    return tokenizer, model.eval()


class _StepClock:
    """A generate() streamer that notes when each step's tokens appear (the first put is the prompt)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _prompt_ids(tokenizer, request: BenchRequest) -> list[int]:
    from inference.engine import encode_chat

    return encode_chat(tokenizer, request.messages)


def _wait_for_arrival(start: float, request: BenchRequest) -> None:
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_sequential(model_dir: Path, requests: list[BenchRequest], threads: int = 2, **_) -> ModeResult:
    tokenizer, model = _load_model(model_dir, threads)
    prompts = [_prompt_ids(tokenizer, r) for r in requests]
    _generate(model, [prompts[0][:16]], 2)  # warm-up: the first forward pass pays one-off costs
    start = time.perf_counter()
    timings = []
    for request, prompt in zip(requests, prompts, strict=True):
        _wait_for_arrival(start, request)
        timing = RequestTiming(request.index, arrival=start + request.arrival_s)
        clock = _generate(model, [prompt], request.output_tokens)
        timing.first_token, timing.finished = clock.steps[0], clock.steps[-1]
        timing.output_tokens = len(clock.steps)
        timings.append(timing)
    return ModeResult(summarise(timings, own_peak_rss_mb()), timings=timing_rows(timings))


def run_static(model_dir: Path, requests: list[BenchRequest], threads: int = 2, **_) -> ModeResult:
    """Batches of 8 in arrival order; each runs until its longest member is done (no one joins or leaves)."""
    tokenizer, model = _load_model(model_dir, threads)
    prompts = [_prompt_ids(tokenizer, r) for r in requests]
    _generate(model, [prompts[0][:16]], 2)
    start = time.perf_counter()
    timings = []
    for first in range(0, len(requests), STATIC_BATCH_SIZE):
        batch = requests[first : first + STATIC_BATCH_SIZE]
        _wait_for_arrival(start, batch[-1])  # a static batch starts once its last member has arrived
        clock = _generate(model, prompts[first : first + STATIC_BATCH_SIZE], max(r.output_tokens for r in batch))
        for request in batch:
            # A request's answer is complete at the step that produced its last useful token.
            timings.append(
                RequestTiming(
                    request.index,
                    arrival=start + request.arrival_s,
                    first_token=clock.steps[0],
                    finished=clock.steps[request.output_tokens - 1],
                    output_tokens=request.output_tokens,
                )
            )
    return ModeResult(summarise(timings, own_peak_rss_mb()), timings=timing_rows(timings))


def _generate(model, prompts: list[list[int]], new_tokens: int) -> _StepClock:
    """Greedy generate of exactly new_tokens for every row (EOS suppressed), left-padded."""
    longest = max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id or 0
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=clock,
        )
    return clock


# --- the continuous-batching engine in this process ---------------------------------------------


def run_engine(model_dir: Path, requests: list[BenchRequest], threads: int = 2, engine_options: dict | None = None,
               **_) -> ModeResult:
    from inference.engine import Engine, EngineConfig

    config = replace(EngineConfig(model_dir=model_dir, torch_threads=threads), **(engine_options or {}))
    engine = Engine(config)
    engine.load(progress=lambda _: None)
    engine.start()
    try:
        # The workload and the lone probe measure the engine as it serves once warm: with its
        # compiled decode steps decided (used or not), not the minutes it serves eagerly while compiling.
        if not engine.wait_for_compile(timeout=COMPILE_TIMEOUT_S):
            raise RuntimeError(f"the decode steps were still compiling after {COMPILE_TIMEOUT_S} s")
        prompts = [engine.encode_chat(r.messages) for r in requests]
        _drain(engine.submit("warm-up", prompts[0][:16], 2, ignore_eos=True), RequestTiming(-1, 0.0))
        sampler = BatchSampler(engine)
        sampler.start()
        timings = replay_on_engine(engine, requests, prompts)
        sampler.stop()
        step_ms = {"decode_step_ms_p50": engine.stats().decode_step_ms_p50}  # the burst's, before the lone probe
        lone = lone_request_figures(engine, prompts[0], threads)
    finally:
        engine.stop()
    report = engine.compile_report()
    compiled = {} if report is None else {"compiled_decode": report.as_dict()}
    stack = engine.stack_report()
    compiled |= {} if stack is None else {"decode_stack": stack.as_dict()}
    extra = sampler.figures() | lone | step_ms | compiled | {"skinny_buckets": engine.skinny_buckets, "loop": engine.loop,
                                        "quantization": engine.config.quantization, "q4_max_rows": engine.q4_max_rows,
                                        "q4_kernels": engine.kernels, "prefill_budget": engine.prefill_budget,
                                        "wide_min_rows": None if engine.wide_min_rows == NEVER else engine.wide_min_rows}
    return ModeResult(summarise(timings, own_peak_rss_mb()), extra=extra, timings=timing_rows(timings))


LONE_TOKENS = 64
COMPILE_TIMEOUT_S = 1800  # inductor took ~150 s per bucket on 2 busy cores with a cold cache


def lone_request_figures(engine, prompt: list[int], threads: int) -> dict:
    """A lone request's time per output token, beside its memory-bandwidth roofline.

    Measured after the workload, with nothing else running: what one user alone waits per token.
    The roofline is the time to read the step's weights once at the machine's measured copy
    bandwidth; the share says how close the step comes to it.
    """
    from inference.engine.bench.measure import measured_copy_bandwidth
    from inference.engine.patches.quantization import bytes_read_per_decode_step

    timing = RequestTiming(-2, time.perf_counter())
    _drain(engine.submit("bench-lone", prompt, LONE_TOKENS, ignore_eos=True), timing)
    tpot = timing.tpot_ms
    step_bytes = bytes_read_per_decode_step(engine.model, rows=1)
    bandwidth = measured_copy_bandwidth(threads)
    roofline_ms = step_bytes / bandwidth * 1000
    return {
        "tpot_ms_at_1": None if tpot is None else round(tpot, 2),
        "decode_bytes_per_step_at_1": step_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bandwidth_roofline_tpot_ms_at_1": round(roofline_ms, 2),
        "bandwidth_roofline_share_at_1": None if not tpot else round(roofline_ms / tpot, 3),
    }


def replay_on_engine(engine, requests: list[BenchRequest], prompts: list[list[int]]) -> list[RequestTiming]:
    """Submit each request at its arrival time and record its tokens as the engine's pump hands them
    over (a listener, as the worker streams: no thread woken per request per step)."""
    start = time.perf_counter()
    timings = [RequestTiming(r.index, arrival=start + r.arrival_s) for r in requests]
    handles = []
    for request, prompt, timing in zip(requests, prompts, timings, strict=True):
        _wait_for_arrival(start, request)
        handles.append(engine.submit(f"bench-{request.index}", prompt, request.output_tokens, ignore_eos=True,
                                     listener=partial(_record, timing)))
    for handle, timing in zip(handles, timings, strict=True):
        if handle.wait_end(timeout=600) is None:
            engine.cancel(handle.request_id)
            timing.error = "the engine produced no end for 600 s"
    return timings


def _record(timing: RequestTiming, event) -> None:
    now = time.perf_counter()
    if event.new_tokens and timing.first_token is None:
        timing.first_token = now
    timing.output_tokens += len(event.new_tokens)
    if event.finished:
        timing.finished = now
        if event.error:
            timing.error = event.error


def _drain(handle, timing: RequestTiming) -> None:
    try:
        for event in handle.events(timeout=600):
            _record(timing, event)
    except Exception as exc:  # noqa: BLE001 - recorded; summarise() reports failed requests
        timing.error = str(exc)


class BatchSampler:
    """Samples the engine's running batch and KV blocks every 20 ms while the workload runs."""

    def __init__(self, engine, every_s: float = 0.02) -> None:
        self.engine = engine
        self.every_s = every_s
        self.running: list[int] = []
        self.kv_blocks: list[int] = []
        self.kv_blocks_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from inference.engine.internals import kv_block_usage, scheduler_counts

        while not self._stop.wait(self.every_s):
            running, _ = scheduler_counts(self.engine.manager)
            used, self.kv_blocks_total = kv_block_usage(self.engine.manager, self.engine.config.num_blocks)
            if running:
                self.running.append(running)
                self.kv_blocks.append(used)

    def figures(self) -> dict:
        return batch_figures(self.running, self.kv_blocks, self.kv_blocks_total)


def batch_figures(running: list[int], kv_blocks: list[int], kv_blocks_total: int) -> dict:
    return {
        "mean_running_batch": round(sum(running) / len(running), 1) if running else 0.0,
        "peak_running_batch": max(running, default=0),
        "kv_blocks_used_mean": round(sum(kv_blocks) / len(kv_blocks), 1) if kv_blocks else 0.0,
        "kv_blocks_used_peak": max(kv_blocks, default=0),
        "kv_blocks_total": kv_blocks_total,
    }


# --- prefix caching on and off ------------------------------------------------------------------


def run_prefix(model_dir: Path, requests: list[BenchRequest], threads: int = 2, **_) -> dict:
    """TTFT of the shared-system-prompt requests, sent one after another, with block sharing on then off."""
    from inference.engine.bench.measure import percentile
    from inference.engine.bench.prefix import ttft_with_sharing_on_and_off

    shared = [r for r in requests if r.shared_prefix]
    if len(shared) < 2:
        raise BenchError("the workload has fewer than 2 shared-prefix requests; raise --shared-fraction")
    ttft, _ = ttft_with_sharing_on_and_off(model_dir, [r.messages for r in shared], threads, progress=lambda _: None)
    return {
        "requests": len(shared),
        "ttft_p50_ms_on": round(percentile(ttft[True], 50), 1),
        "ttft_p50_ms_off": round(percentile(ttft[False], 50), 1),
        "ttft_ms_on": [round(t, 1) for t in ttft[True]],
        "ttft_ms_off": [round(t, 1) for t in ttft[False]],
    }
