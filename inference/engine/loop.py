"""The continuous-batching engine: one per worker process, many requests in one running batch.

It wraps transformers' ContinuousBatchingManager (paged KV cache, block sharing for common
prefixes). Facts that shape this file (docs/engine.md, checked on transformers 5.24):

- add_request / cancel_request are thread-safe, but reading results is not: get_result(request_id)
  puts other requests' outputs back and returns None at once. So ONE pump thread reads every output
  and routes it to a per-request queue registered before add_request, or, for a request submitted
  with a listener (the worker's chats), calls the listener itself and queues only the end.
- A streamed output carries all tokens so far; we turn it into "new tokens since last time".
- A cancelled request never gets a final output: cancel() pushes its own "cancelled" marker.
- An empty prompt, a request larger than the whole KV cache, or a duplicate request id kill the
  manager's loop thread: submit() validates first and uses a fresh engine id every time; the pump
  rebuilds the manager if its thread died anyway.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

from . import kernels
from .chat import encode_chat
from .config import CPU_MAX_RUNNING, CPU_PREFILL_BUDGET, GREEDY, EngineConfig, EngineError, Sampling
from .internals import kv_block_usage, scheduler_counts
from .measured import KeptMeasurements, kept_measurements, kept_note
from .owned.manager import OwnedManager
from .owned.runner import KV_DTYPES, unsupported_reason
from .owned.scheduler import PREFILL_STEP_STRETCH, measured_prefill_budget
from .patches import attention
from .patches.linears import BucketTiming, describe, measure_row_buckets, plain_linears, use_skinny_linears
from .patches.quantization import (
    NEVER,
    OWN_KERNELS,
    Q4,
    TORCH_KERNELS,
    describe_q4,
    describe_wide,
    kernels_of,
    measure_head_rows,
    measure_q4_rows,
    measure_wide_rows,
    q4_routes,
    quantize_model,
    route_packed_layers,
    weights_memory_bytes,
)
from .stream import CANCELLED, EngineStats, FailedOutput, RequestHandle, StreamEvent

log = logging.getLogger(__name__)

def in_a_passing_thread(work):
    """Run parallel torch work in a thread that ends with it, and return its result.

    Each thread that runs an OpenMP region keeps its own team of OpenMP threads for as long as it
    lives. Once a process holds more OpenMP threads than cores, libgomp stops spinning at barriers
    (its throttled spin count) and every parallel region of the engine's generation thread, hundreds
    per step, waits on a futex wake instead: one 512×512 matmul in the main thread before the
    engine started took the bench's engine mode from 147 to 102 tokens/s. A thread that exits takes
    its team with it (leaving the `with` joins the executor's one thread; its error is re-raised here).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load-work") as executor:
        return executor.submit(work).result()


# Outputs further apart than this mean the engine was idle in between (a CPU decode step with a
# full batch takes well under a second); BUSY_MIN_TOKENS generated are needed before a busy rate
# counts (fewer, and one slow step decides it).
IDLE_GAP_S = 2.0
BUSY_MIN_TOKENS = 32


class Engine:
    """Loads the model once and serves many concurrent streaming requests from it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None
        self.model = None
        self.manager = None
        self._handles: dict[str, RequestHandle] = {}  # engine id → handle
        self._by_request: dict[str, str] = {}  # our request id → engine id
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._pump_thread: threading.Thread | None = None
        self._tokens_generated = 0
        self._requests_finished = 0
        self._peak_running = 0
        self._restarts = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()
        # What the machine has shown it can do, which a self-hosted price per token divides the
        # hourly cost by (budgets/selfhosted.py): the best decode rate while busy, and the best
        # prefill rate of one request (its prompt tokens over the time to its first token).
        self._peak_tokens_per_s = 0.0
        self._last_prefill_tokens_per_s = 0.0
        self._peak_prefill_tokens_per_s = 0.0
        self.weights_bytes = 0
        self.skinny_buckets: list[int] = []  # decode row buckets computed as W·xᵀ (inference/engine/patches/linears.py)
        self.q4_max_rows = 0  # steps of up to this many rows read the 4-bit weights (q4 variant only)
        self.paged_attention = False  # decode rows attend on Ceiling's kernel, in place in the paged cache
        self.wide_min_rows = NEVER  # steps of at least this many rows read the bf16 copy (q4 variant only)
        self.q4_max_rows_before_wide = 0  # the 4-bit route's reach as measured against fp32 alone
        # (rows, ms) of a pass over the block linears on the route each width takes, as load() timed
        # them (q4 variant only): what a measured prefill budget is read from.
        self.step_ms: list[tuple[int, float]] = []
        # The owned loop's prefill budget: as configured, or measured at load (_choose_prefill_budget).
        self.prefill_budget = config.prefill_budget if config.prefill_budget is not None else CPU_PREFILL_BUDGET
        self.kernels = TORCH_KERNELS  # whose kernels the q4 variant's packed layers run on
        self.kept = KeptMeasurements(None)  # what load() times, kept per machine (measured.py); set by load()
        self.loop = config.loop  # the loop that really runs: "owned" or "transformers" (see _choose_loop)

    # --- lifecycle ------------------------------------------------------------------------------

    def load(self, progress=print) -> None:
        from transformers import AutoTokenizer

        torch.set_num_threads(self.config.torch_threads)
        if self.config.compile_cache_dir is not None:
            # Inductor reads its cache folder from the environment, and the first call that asks for
            # it writes the system temp folder there if it is unset; loading the model already asks,
            # so setting it when the compile starts (as before) was too late: var/inductor never
            # filled and every restart compiled again. A folder the environment names still wins.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.config.compile_cache_dir))
        started = time.monotonic()
        self.kept = kept_measurements(self.config)
        progress(f"Loading tokenizer from {self.config.model_dir}…")
        # The caller's thread (a worker's main thread) lives on: its torch work must not. The
        # tokenizer too: on one Xeon, loading it here left an OpenMP team in the calling thread
        # (counted in gdb) and a lone request's decode steps were ~40% slower (docs/engine.md;
        # tests/test_engine_threads.py counts the teams a load leaves).
        self.tokenizer = in_a_passing_thread(lambda: AutoTokenizer.from_pretrained(str(self.config.model_dir)))
        progress(f"Loading model weights ({self.config.device})…")
        in_a_passing_thread(lambda: self._load_model(progress))
        progress(
            f"Model loaded in {time.monotonic() - started:.1f} s "
            f"({self.config.quantization}, weights {self.weights_bytes / 2**20:.0f} MiB)"
        )

    def _load_model(self, progress) -> None:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if self.config.device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            str(self.config.model_dir), dtype=dtype, attn_implementation="sdpa"
        )
        model = model.to(self.config.device).eval()
        # Every CPU variant's decode attention runs on them (paged_attention), q4's linears too.
        unavailable = self._own_kernels_unavailable() if not self.config.device.startswith("cuda") else "on a GPU"
        self.model = quantize_model(model, self.config.quantization, own_kernels=unavailable is None)
        # The kernel reads an fp32 cache, and the cache takes the embeddings' dtype (bf16 for that variant).
        self.paged_attention = unavailable is None and self.model.get_input_embeddings().weight.dtype == torch.float32
        if self.config.quantization == Q4:
            self.kernels = kernels_of(self.model)  # packing keeps torch's layout where a scale is no float16
            progress("4-bit kernels: Ceiling's (inference/engine/kernels)" if self.kernels == OWN_KERNELS
                     else f"4-bit kernels: torch's ({unavailable or 'scales that are not float16 numbers'})")
        self.weights_bytes = weights_memory_bytes(self.model)
        on_cpu = not self.config.device.startswith("cuda")
        self.loop = self._choose_loop(progress)
        if self.config.attention == "varlen" and on_cpu and self.loop == "transformers":
            attention.enable(self.model)
        if self.config.skinny_linear and on_cpu:
            timings, kept = self.kept.measured(
                "skinny_rows", lambda: [asdict(t) for t in measure_row_buckets(plain_linears(self.model))])
            timings = [BucketTiming(**t) for t in timings]
            self.skinny_buckets = use_skinny_linears(self.model, [t.rows for t in timings if t.skinny_wins])
            progress(f"Decode linears, F.linear vs W·xᵀ per pass over the weights: {describe(timings)}{kept_note(kept)}")
        if self.config.quantization == Q4:
            self._route_q4(progress)
        self.prefill_budget = self._choose_prefill_budget(progress)

    def _route_q4(self, progress) -> None:
        """The 4-bit route's reach, and the bf16 copy's for wide steps: as kept from an earlier start on
        this machine (inference/engine/measured.py), else timed now and kept."""
        # Per kernel set: routes timed on torch's kernels (Ceiling's could not be built) say nothing of Ceiling's.
        kept, was_kept = self.kept.measured(f"q4_routes.{self.kernels}", self._time_q4_routes)
        if was_kept:  # timing routed the layers as this start measured; a kept answer routes them as it says
            route_packed_layers(self.model, kept["routes"])
        note = kept_note(was_kept)
        self.q4_max_rows = self.q4_max_rows_before_wide = kept["q4_max_rows"]
        progress("Decode linears, fp32 vs 4-bit weights per pass over the block linears: "
                 f"{describe_q4(self.q4_max_rows, kept['q4_timings'])}{note}")
        if kept.get("head_timings"):
            progress("The lm_head, fp32 vs its int8 copy per pass: "
                     f"{describe_q4(kept['head_max_rows'], kept['head_timings'], 'the int8 copy')}{note}")
        if self.config.q4_wide_bf16:
            self.wide_min_rows = kept["wide_min_rows"]
            self.q4_max_rows = min(self.q4_max_rows, self.wide_min_rows - 1)
            progress(f"Wide steps, their route vs a bf16 copy per pass over the block linears: "
                     f"{describe_wide(self.wide_min_rows, kept['wide_timings'])}{note}")
        self.step_ms = routed_step_ms(kept, self.wide_min_rows)
        self.weights_bytes = weights_memory_bytes(self.model)

    def _time_q4_routes(self) -> dict:
        """Time the packed layers' routes on this machine and route them (the kept shape of q4_routes)."""
        # After the skinny routes: q4 competes with the route an fp32 step would really take.
        max_rows, q4_timings = measure_q4_rows(self.model)
        head_max_rows, head_timings = measure_head_rows(self.model)
        wide_min_rows, wide_timings = NEVER, []
        if self.config.q4_wide_bf16:
            wide_min_rows, wide_timings = measure_wide_rows(self.model)
        return {"q4_max_rows": max_rows, "q4_timings": q4_timings, "wide_min_rows": wide_min_rows,
                "wide_timings": wide_timings, "head_max_rows": head_max_rows, "head_timings": head_timings,
                "routes": q4_routes(self.model)}

    def _choose_prefill_budget(self, progress) -> int:
        """The configured prefill budget, else the one this machine's step times give (owned/scheduler.py)."""
        if self.config.prefill_budget is not None:
            return self.config.prefill_budget
        decode_rows = self.config.max_running or CPU_MAX_RUNNING
        budget = measured_prefill_budget(self.step_ms, decode_rows)
        if budget is None:
            progress(f"Prefill budget beside decoding requests: {CPU_PREFILL_BUDGET} tokens "
                     "(no step times measured: only the q4 variant times its steps by rows)")
            return CPU_PREFILL_BUDGET
        progress(f"Prefill budget beside decoding requests: {budget} tokens, the largest chunk that keeps a step of "
                 f"{decode_rows} decoding rows within {PREFILL_STEP_STRETCH:g}× their own "
                 f"({describe_step_ms(self.step_ms)})")
        return budget

    def _own_kernels_unavailable(self) -> str | None:
        """Why the q4 variant cannot run on Ceiling's kernels (None: built, once per machine, and loaded now)."""
        if not self.config.own_kernels:
            return "own kernels turned off"
        return kernels.load(self.config.kernel_cache_dir)

    def start(self) -> None:
        if self.model is None:
            self.load()
        self.manager = self._new_manager()
        self._stopping.clear()
        self._pump_thread = threading.Thread(target=self._pump, name="engine-pump", daemon=True)
        self._pump_thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self.manager is not None:
            self.manager.stop(block=True, timeout=5, hard_stop=True)
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=5)
        self._fail_all("the engine stopped")

    def _new_manager(self):
        if self.loop == "owned":
            manager = OwnedManager(
                self.model, num_blocks=self.config.num_blocks, page_size=self.config.page_size,
                max_batch_tokens=self.config.max_batch_tokens, prefix_sharing=self.config.prefix_sharing,
                compile_buckets=() if self.config.device.startswith("cuda") else self.config.compile_buckets,
                compile_cache_dir=self.config.compile_cache_dir, paged_attention=self.paged_attention,
                prefill_budget=self.prefill_budget, kv_dtype=KV_DTYPES[self.config.kv_dtype],
                kept=self.kept, max_running=self.config.max_running,
            )
            manager.start()
            return manager
        return self._new_transformers_manager()

    def _choose_loop(self, progress) -> str:
        if self.config.loop != "owned":
            return "transformers"
        reason = unsupported_reason(self.model)
        if reason:
            progress(f"The owned engine loop cannot run this model ({reason}): using transformers' continuous batching")
            return "transformers"
        return "owned"

    def _new_transformers_manager(self):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=256,
            eos_token_id=self.eos_ids_list(),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        cb_config = ContinuousBatchingConfig(
            page_size=self.config.page_size,
            num_blocks=self.config.num_blocks,
            max_batch_tokens=self.config.max_batch_tokens,
            allow_block_sharing=self.config.prefix_sharing,
        )
        manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        manager.start()
        return manager

    # --- requests -------------------------------------------------------------------------------

    def eos_ids_list(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        generation_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif generation_eos:
            ids.update(generation_eos)
        return sorted(i for i in ids if i is not None)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages → prompt token ids, exactly as the model's chat template lays them out."""
        return encode_chat(self.tokenizer, messages)

    @property
    def token_capacity(self) -> int:
        return self.config.page_size * self.config.num_blocks

    def submit(
        self, request_id: str, input_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False,
        listener: Callable[[StreamEvent], None] | None = None, sampling: Sampling = GREEDY,
    ) -> RequestHandle:
        if not input_ids:
            raise EngineError("the prompt is empty")
        if max_new_tokens < 1:
            raise EngineError("max_new_tokens must be at least 1")
        needed = len(input_ids) + max_new_tokens
        if needed > self.token_capacity:
            raise EngineError(
                f"the request needs {needed} tokens of KV cache but the whole cache holds {self.token_capacity}"
            )
        if self.manager is None or not self.manager.is_running():
            raise EngineError("the engine is not running")
        if not sampling.plain and self.loop != "owned":
            raise EngineError("this engine runs transformers' loop, which decodes greedily without logprobs: "
                              "sampling parameters need CEILING_ENGINE_LOOP=owned")
        # A fresh engine id every time: Celery reuses a task id on retry, and a duplicate id would
        # kill the manager's loop.
        engine_id = f"{request_id}#{uuid.uuid4().hex[:8]}"
        eos_ids = set(self.eos_ids_list())
        handle = RequestHandle(self.cancel, request_id, engine_id, eos_ids, listener)
        handle.prompt_tokens = len(input_ids)
        handle.submitted_at = time.monotonic()
        with self._lock:
            self._handles[engine_id] = handle
            self._by_request[request_id] = engine_id
        try:
            added = self.manager.add_request(
                list(input_ids),
                request_id=engine_id,
                max_new_tokens=max_new_tokens,
                streaming=True,
                eos_token_id=-1 if ignore_eos else sorted(eos_ids),
                **({"sampling": sampling} if self.loop == "owned" else {}),
            )
        except queue.Full:
            self._forget(engine_id)
            raise EngineError("the engine's queue is full; try again in a moment") from None
        if added is None:
            self._forget(engine_id)
            raise EngineError("the engine refused the request (it is stopping or restarting)")
        return handle

    def cancel(self, request_id: str) -> bool:
        """Stop a request at the next decode step; its handle receives a 'cancelled' end."""
        with self._lock:
            engine_id = self._by_request.get(request_id)
            handle = self._handles.get(engine_id) if engine_id else None
        if handle is None:
            return False
        self.manager.cancel_request(engine_id)
        self._forget(engine_id)
        handle.outputs.put(CANCELLED)
        return True

    def _forget(self, engine_id: str) -> None:
        with self._lock:
            handle = self._handles.pop(engine_id, None)
            if handle is not None and self._by_request.get(handle.request_id) == engine_id:
                del self._by_request[handle.request_id]

    # --- the pump: the only reader of the manager's output queue --------------------------------

    def _pump(self) -> None:
        while not self._stopping.is_set():
            manager = self.manager
            if not manager.is_running():
                self._restart_after_crash()
                continue
            output = manager.get_result(timeout=0.1)
            self._sample_batch()
            if output is None:
                continue
            self._route(output)

    def _route(self, output) -> None:
        with self._lock:
            handle = self._handles.get(output.request_id)
        if handle is None:
            return  # cancelled or already failed: nobody is listening
        new = len(output.generated_tokens) - len(handle.tokens)
        now = time.monotonic()
        with self._lock:
            self._tokens_generated += max(new, 0)
            self._recent_tokens.append((now, max(new, 0)))
            if new > 0 and not handle.tokens:  # its first token: the prompt has been prefilled
                # Time in the queue counts too: under load the rate reads low, and a price from it high.
                rate = handle.prompt_tokens / max(now - handle.submitted_at, 1e-3)
                self._last_prefill_tokens_per_s = rate
                self._peak_prefill_tokens_per_s = max(self._peak_prefill_tokens_per_s, rate)
        handle.last_output_at = now
        if handle.listener is None:
            handle.outputs.put(output)
        else:
            self._tell_listener(handle, output)
        if output.is_finished():
            self._requests_finished += 1
            self._forget(output.request_id)

    @staticmethod
    def _tell_listener(handle: RequestHandle, output) -> None:
        event = handle._to_event(output)
        try:
            if event.new_tokens or event.finished:
                handle.listener(event)
        except Exception:  # noqa: BLE001 - one request's listener must not stop the pump for all
            log.exception("the listener of %s failed", handle.request_id)
        if event.finished:
            handle.outputs.put(event)

    def _restart_after_crash(self) -> None:
        if self._stopping.is_set():
            return
        log.error("The continuous-batching loop died; failing in-flight requests and restarting it")
        self._fail_all("the engine restarted after an internal error")
        self._restarts += 1
        try:
            self.manager.stop(block=True, timeout=2, hard_stop=True)
        except Exception:  # noqa: BLE001 - the dead manager may fail in any way; we replace it
            log.exception("stopping the dead manager failed")
        self.manager = self._new_manager()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._by_request.clear()
        for handle in handles:
            handle.outputs.put(FailedOutput(handle.engine_id, handle.tokens, reason))

    # --- stats ----------------------------------------------------------------------------------

    def _sample_batch(self) -> None:
        running, _ = scheduler_counts(self.manager)
        if running > self._peak_running:
            self._peak_running = running

    def stats(self) -> EngineStats:
        running, waiting = scheduler_counts(self.manager)
        used, total = kv_block_usage(self.manager, self.config.num_blocks)
        tokens_per_s, busy_tokens_per_s = self._rates()
        report, stack = self.compile_report(), self.stack_report()
        self._peak_tokens_per_s = max(self._peak_tokens_per_s, busy_tokens_per_s)
        return EngineStats(
            model=self.config.model_dir.name,
            device=self.config.device,
            running=running,
            waiting=waiting,
            kv_blocks_used=used,
            kv_blocks_total=total,
            tokens_generated=self._tokens_generated,
            tokens_per_s=round(tokens_per_s, 2),
            busy_tokens_per_s=round(busy_tokens_per_s, 2),
            prefill_tokens_per_s=round(self._last_prefill_tokens_per_s, 2),
            peak_tokens_per_s=round(self._peak_tokens_per_s, 2),
            peak_prefill_tokens_per_s=round(self._peak_prefill_tokens_per_s, 2),
            requests_finished=self._requests_finished,
            peak_running=self._peak_running,
            restarts=self._restarts,
            quantization=self.config.quantization,
            weights_bytes=self.weights_bytes,
            loop=self.loop,
            compiled_decode_state=report.state if report else "",
            compiled_decode=report.describe() if report else "",
            decode_stack_state=stack.state if stack else "",
            decode_stack=stack.describe() if stack else "",
            thread_backoffs=getattr(getattr(self.manager, "governor", None), "backoffs", 0),
            decode_step_ms_p50=self.manager.decode_step_ms_p50() if hasattr(self.manager, "decode_step_ms_p50") else {},
        )

    def compile_report(self):
        """The compiled decode steps' CompileReport (owned loop with compile_buckets), else None."""
        compiler = getattr(self.manager, "compiler", None)
        return compiler.report if compiler is not None else None

    def stack_report(self):
        """Whether decode steps run in one C++ call (the owned loop's stack.StackReport), else None."""
        return getattr(self.manager, "stack_report", None)

    def wait_for_compile(self, timeout: float) -> bool:
        """Block until every decode bucket's compile is decided (True at once when nothing compiles)."""
        compiler = getattr(self.manager, "compiler", None)
        return compiler is None or compiler.wait(timeout)

    def _rates(self, window_s: float = 10.0) -> tuple[float, float]:
        """(tokens/s over the last window_s, tokens/s over the busy part of it).

        The first is the load now (what the dashboard shows). The second leaves out the idle gaps,
        so one short answer on a quiet engine reads as the speed it ran at, not as 24 tokens / 10 s;
        it is 0 while the window holds fewer than BUSY_MIN_TOKENS: too few to tell.
        """
        now = time.monotonic()
        with self._lock:
            while self._recent_tokens and now - self._recent_tokens[0][0] > window_s:
                self._recent_tokens.popleft()
            events = list(self._recent_tokens)
        total = sum(n for _, n in events)
        busy_s = busy_tokens = 0.0
        for (before, _), (at, tokens) in itertools.pairwise(events):
            if at - before <= IDLE_GAP_S:
                busy_s += at - before
                busy_tokens += tokens
        return total / window_s, (busy_tokens / busy_s if busy_tokens >= BUSY_MIN_TOKENS and busy_s > 0 else 0.0)


def routed_step_ms(kept: dict, wide_min_rows: int) -> list[tuple[int, float]]:
    """(rows, ms) per pass over the block linears on the route each width takes, from the q4 routes'
    timings: the bf16 copy's from wide_min_rows on where it was timed, the 4-bit or fp32 route's below."""
    if kept.get("wide_timings"):
        return [(rows, bf16 if rows >= wide_min_rows else current) for rows, current, bf16 in kept["wide_timings"]]
    return [(rows, q4 if rows <= kept["q4_max_rows"] else fp32) for rows, fp32, q4 in kept.get("q4_timings", [])]


def describe_step_ms(step_ms: list[tuple[int, float]]) -> str:
    return ", ".join(f"{rows} rows {ms:.1f} ms" for rows, ms in step_ms)
