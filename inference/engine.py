"""The continuous-batching engine: one per worker process, many requests in one running batch.

It wraps transformers' ContinuousBatchingManager (paged KV cache, block sharing for common
prefixes). Facts that shape this file (see shared/ENGINE_NOTES.md, checked on transformers 5.24):

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

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import attention
from .quantization import Q4, describe_q4, measure_q4_rows, quantize_model, weights_memory_bytes
from .skinny import describe, measure_row_buckets, plain_linears, use_skinny_linears

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


class EngineError(RuntimeError):
    """The engine cannot take or finish a request; the message is safe to show to a user."""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "cpu"
    torch_threads: int = 2
    page_size: int = 32
    num_blocks: int = 512
    max_batch_tokens: int = 512
    prefix_sharing: bool = True
    # "varlen": our per-request attention for CPU steps (inference/attention.py); "sdpa": transformers'
    # packed attention, which costs B × (all tokens of the batch) per step.
    attention: str = "varlen"
    # CPU decode steps' linear layers as W·xᵀ where that measures faster at load (inference/skinny.py).
    skinny_linear: bool = True
    # "none", "int8", "q4" or "bf16" (inference/quantization.py): how the weights are stored once loaded.
    quantization: str = "none"

    @classmethod
    def from_settings(cls, model_dir: Path, quantization: str | None = None) -> EngineConfig:
        from django.conf import settings

        return cls(
            model_dir=model_dir,
            device=settings.CEILING_DEVICE or ("cuda" if torch.cuda.is_available() else "cpu"),
            torch_threads=settings.CEILING_TORCH_THREADS,
            page_size=settings.CEILING_KV_PAGE_SIZE,
            num_blocks=settings.CEILING_KV_BLOCKS,
            max_batch_tokens=settings.CEILING_MAX_BATCH_TOKENS,
            prefix_sharing=settings.CEILING_PREFIX_SHARING,
            attention=settings.CEILING_ATTENTION,
            skinny_linear=settings.CEILING_SKINNY_LINEAR,
            quantization=quantization or settings.CEILING_QUANTIZATION,
        )


@dataclass
class StreamEvent:
    """What happened to one request since the last event: new tokens, and maybe its end."""

    new_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineStats:
    model: str
    device: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    tokens_per_s: float
    requests_finished: int
    peak_running: int
    restarts: int
    quantization: str = "none"
    weights_bytes: int = 0  # memory of the loaded weights (int8 layers counted at one byte per weight)
    updated_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return asdict(self)


_CANCELLED = object()  # marker pushed into a request's queue by cancel()


class RequestHandle:
    """One submitted request: iterate events() to read its stream.

    Or, for a request submitted with a listener: the pump calls the listener with every event (in
    the pump thread, one thread for all such requests, so an engine step wakes no thread per
    request), and the submitter only waits for the end with wait_end().
    """

    def __init__(self, engine: Engine, request_id: str, engine_id: str, eos_ids: set[int],
                 listener: Callable[[StreamEvent], None] | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.engine_id = engine_id
        self.eos_ids = eos_ids
        self.listener = listener
        self.outputs: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.last_output_at = time.monotonic()  # when the engine last produced something for it

    def events(self, timeout: float) -> Iterator[StreamEvent]:
        """Yield events until the request ends; raises EngineError if nothing arrives within timeout."""
        while True:
            try:
                item = self.outputs.get(timeout=timeout)
            except queue.Empty:
                self.engine.cancel(self.request_id)
                raise EngineError(f"the engine produced nothing for {timeout:.0f} s") from None
            event = self._to_event(item)
            if event.new_tokens or event.finished:
                yield event
            if event.finished:
                return

    def wait_end(self, timeout: float) -> StreamEvent | None:
        """A listened-to request's final event, or None if it has not ended within timeout."""
        try:
            return self._to_event(self.outputs.get(timeout=timeout))
        except queue.Empty:
            return None

    def _to_event(self, item) -> StreamEvent:
        if isinstance(item, StreamEvent):
            return item  # the pump made it already (a listened-to request's end)
        if item is _CANCELLED:
            return StreamEvent([], finished=True, finish_reason=FINISH_CANCELLED)
        # Only the step's new tokens are copied: the pump calls this for every running request
        # every step, and copying each whole answer so far made that quadratic in its length.
        new = list(item.generated_tokens[len(self.tokens) :])
        self.tokens.extend(new)
        if not item.is_finished():
            return StreamEvent(new)
        if item.error:
            return StreamEvent(new, finished=True, finish_reason=FINISH_ERROR, error=str(item.error))
        reason = FINISH_STOP if self.tokens and self.tokens[-1] in self.eos_ids else FINISH_LENGTH
        return StreamEvent(new, finished=True, finish_reason=reason)


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
        self.weights_bytes = 0
        self.skinny_buckets: list[int] = []  # decode row buckets computed as W·xᵀ (inference/skinny.py)
        self.q4_max_rows = 0  # steps of up to this many rows read the 4-bit weights (q4 variant only)

    # --- lifecycle ------------------------------------------------------------------------------

    def load(self, progress=print) -> None:
        from transformers import AutoTokenizer

        torch.set_num_threads(self.config.torch_threads)
        started = time.monotonic()
        progress(f"Loading tokenizer from {self.config.model_dir}…")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.config.model_dir))
        progress(f"Loading model weights ({self.config.device})…")
        # The caller's thread (a worker's main thread) lives on: its torch work must not.
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
        self.model = quantize_model(model, self.config.quantization)
        self.weights_bytes = weights_memory_bytes(self.model)
        on_cpu = not self.config.device.startswith("cuda")
        if self.config.attention == "varlen" and on_cpu:
            attention.enable(self.model)
        if self.config.skinny_linear and on_cpu:
            timings = measure_row_buckets(plain_linears(self.model))
            self.skinny_buckets = use_skinny_linears(self.model, [t.rows for t in timings if t.skinny_wins])
            progress(f"Decode linears, F.linear vs W·xᵀ per pass over the weights: {describe(timings)}")
        if self.config.quantization == Q4:
            # After the skinny routes: q4 competes with the route an fp32 step would really take.
            self.q4_max_rows, q4_timings = measure_q4_rows(self.model)
            progress(f"Decode linears, fp32 vs 4-bit weights per pass over the block linears: {describe_q4(self.q4_max_rows, q4_timings)}")

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
        listener: Callable[[StreamEvent], None] | None = None,
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
        # A fresh engine id every time: Celery reuses a task id on retry, and a duplicate id would
        # kill the manager's loop.
        engine_id = f"{request_id}#{uuid.uuid4().hex[:8]}"
        eos_ids = set(self.eos_ids_list())
        handle = RequestHandle(self, request_id, engine_id, eos_ids, listener)
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
        handle.outputs.put(_CANCELLED)
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
            handle.outputs.put(_FailedOutput(handle.engine_id, handle.tokens, reason))

    # --- stats ----------------------------------------------------------------------------------

    def _sample_batch(self) -> None:
        running, _ = scheduler_counts(self.manager)
        if running > self._peak_running:
            self._peak_running = running

    def stats(self) -> EngineStats:
        running, waiting = scheduler_counts(self.manager)
        used, total = kv_block_usage(self.manager, self.config.num_blocks)
        return EngineStats(
            model=self.config.model_dir.name,
            device=self.config.device,
            running=running,
            waiting=waiting,
            kv_blocks_used=used,
            kv_blocks_total=total,
            tokens_generated=self._tokens_generated,
            tokens_per_s=round(self._tokens_per_s(), 2),
            requests_finished=self._requests_finished,
            peak_running=self._peak_running,
            restarts=self._restarts,
            quantization=self.config.quantization,
            weights_bytes=self.weights_bytes,
        )

    def _tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent_tokens and now - self._recent_tokens[0][0] > window_s:
                self._recent_tokens.popleft()
            total = sum(n for _, n in self._recent_tokens)
        return total / window_s


@dataclass
class _FailedOutput:
    """Stands in for a GenerationOutput when the engine itself fails a request."""

    request_id: str
    generated_tokens: list[int]
    error: str

    def is_finished(self) -> bool:
        return True


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- transformers internals, read in one place so an upgrade breaks only here --------------------


def scheduler_counts(manager) -> tuple[int, int]:
    """(requests running, requests waiting). len() only: other threads must never iterate these."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return 0, 0
    scheduler = processor.scheduler
    return len(scheduler.active_requests), len(scheduler.waiting_requests)


def kv_block_usage(manager, configured_blocks: int) -> tuple[int, int]:
    """(KV blocks in use, KV blocks in total); before the first request the cache does not exist yet."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return 0, configured_blocks
    cache = processor.cache
    total = int(cache.num_blocks)
    free_share = float(cache.compute_free_capacity(relative=True))
    return max(0, round(total * (1.0 - free_share))), total


# --- the engines of this process ------------------------------------------------------------------
#
# A worker hosts one engine per weight variant its features ask for (Feature.quantization): the
# CEILING_QUANTIZATION variant is loaded when the worker starts, another (int8 for a feature staff
# switched to it, or full precision in an int8 worker) the first time a request needs it (a few
# seconds: load + quantize). Each engine has its own KV cache, allocated at its first request, and
# they share the process's cores. One worker queue and one command line serve every variant, and a
# switch on the dashboard takes effect at the next request, with nothing to restart.

_engines: dict[str, Engine] = {}
_engine_lock = threading.Lock()  # guards the two dicts, never held while a model loads
_variant_locks: dict[str, threading.Lock] = {}


def _default_variant() -> str:
    from django.conf import settings

    return settings.CEILING_QUANTIZATION


def get_engine(quantization: str | None = None) -> Engine:
    """The process's engine for a weight variant (default: CEILING_QUANTIZATION), started on first use."""
    variant = quantization or _default_variant()
    with _engine_lock:
        engine = _engines.get(variant)
        if engine is not None:
            return engine
        variant_lock = _variant_locks.setdefault(variant, threading.Lock())
    # Loading one variant must not stall requests to another, hence a lock per variant.
    with variant_lock:
        if variant in _engines:
            return _engines[variant]
        from .modelfiles import model_dir
        from .quantization import QuantizationError

        engine = Engine(EngineConfig.from_settings(model_dir(progress=log.info), quantization=variant))
        try:
            engine.load(progress=log.info)
        except QuantizationError as exc:
            raise EngineError(f"this worker cannot serve {variant} weights: {exc}") from exc
        engine.start()
        with _engine_lock:
            if not _engines:
                _stop_engine_at_exit()
            _engines[variant] = engine
        return engine


def _stop_engine_at_exit() -> None:
    # The manager's generation thread is not a daemon, so a plain atexit hook would never run:
    # Python joins non-daemon threads first. threading's own pre-join hook (what
    # concurrent.futures uses) lets the process exit cleanly.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(shutdown_engine)


def engine_if_started() -> Engine | None:
    """The default variant's engine if it runs (else any running one)."""
    with _engine_lock:
        return _engines.get(_default_variant()) or next(iter(_engines.values()), None)


def cancel_everywhere(request_id: str) -> bool:
    """Cancel a request in whichever of this process's engines runs it (a broadcast cancel names no variant)."""
    with _engine_lock:
        engines = list(_engines.values())
    return any([engine.cancel(request_id) for engine in engines])


def process_stats() -> dict:
    """What a worker publishes: its default engine's stats, plus the other variants it loaded since."""
    main = engine_if_started()
    if main is None:
        return {}
    with _engine_lock:
        others = [engine for engine in _engines.values() if engine is not main]
    return main.stats().as_dict() | {"variants": [engine.stats().as_dict() for engine in others]}


def shutdown_engine() -> None:
    with _engine_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.stop()
