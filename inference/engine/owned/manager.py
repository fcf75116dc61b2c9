"""The thread that runs the owned loop's steps, behind the interface the Engine already drives.

`OwnedManager` answers the calls inference/engine/loop.py makes of transformers'
ContinuousBatchingManager — add_request, cancel_request, get_result, is_running, start, stop — so
the Engine's pump, its listeners, cancellation and restart-after-crash work unchanged whichever
loop runs. Requests and cancellations reach the loop thread through queues; it is the only thread
that touches the scheduler, the blocks and the model, so none of them needs a lock.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import partial

import torch

from ..config import GREEDY, Sampling
from ..measured import KeptMeasurements
from .blocks import BlockManager
from .compiled import DecodeCompiler
from .runner import ModelRunner
from .sampler import pick_tokens
from .scheduler import Scheduler
from .sequence import Sequence
from .stack import StackReport, install_as_kept
from .stack import install as install_stack
from .threads import ThreadGovernor

log = logging.getLogger(__name__)

STEP_TIMES_KEPT = 64  # decode steps per row count that the stats' median reads


@dataclass
class StepOutput:
    """What one step did to one request, in the shape the Engine's pump reads."""

    request_id: str
    generated_tokens: list[int]  # the request's live list: the pump copies only what is new
    finished: bool = False
    error: str | None = None
    logprobs: list | None = None  # the request's live list of (logprob, top) entries, when it asked

    def is_finished(self) -> bool:
        return self.finished


class OwnedManager:
    def __init__(self, model, *, num_blocks: int, page_size: int, max_batch_tokens: int, prefix_sharing: bool,
                 compile_buckets: tuple[int, ...] = (), compile_cache_dir=None, paged_attention: bool = False,
                 prefill_budget: int = 0, kv_dtype: torch.dtype | None = None,
                 kept: KeptMeasurements | None = None, max_running: int = 0) -> None:
        self.model = model
        self.kept = kept or KeptMeasurements(None)  # the stack's and the compile's verdicts, per machine
        self.paged_attention = paged_attention
        self.kv_dtype = kv_dtype
        self.compile_buckets = compile_buckets  # () : no compiled steps
        self.compile_cache_dir = compile_cache_dir
        self.compiler: DecodeCompiler | None = None
        self.stack_report: StackReport | None = None  # decided in the loop thread before it serves
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.prefix_sharing = prefix_sharing
        self.blocks = BlockManager(num_blocks, page_size, prefix_sharing)
        self.scheduler = Scheduler(self.blocks, max_batch_tokens, prefill_budget=prefill_budget, max_running=max_running)
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._alive = False
        self.steps = 0
        self.step_seconds = 0.0
        # rows → the last STEP_TIMES_KEPT decode-only steps' ms (the step and the pick): the engine's own
        # speed where it serves, beside whatever shares its cores (EngineStats.decode_step_ms_p50).
        self.decode_step_ms: defaultdict[int, deque[float]] = defaultdict(partial(deque, maxlen=STEP_TIMES_KEPT))
        self.governor: ThreadGovernor | None = None  # made in the loop thread, whose thread count it sets

    # --- the interface the Engine drives ---------------------------------------------------------

    def start(self) -> None:
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="engine-owned-loop", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=120)

    def is_running(self) -> bool:
        return self._alive and self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = True) -> None:
        self._stopping.set()
        self._wake.set()
        if block and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def add_request(self, input_ids: list[int], request_id: str, max_new_tokens: int, streaming: bool = True,
                    eos_token_id=None, sampling: Sampling = GREEDY) -> str | None:
        if self._stopping.is_set() or not self.is_running():
            return None
        if eos_token_id is None or eos_token_id == -1:
            eos_ids = frozenset()
        else:
            eos_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        seq = Sequence(request_id, list(input_ids), max_new_tokens, eos_ids, sampling=sampling)
        self._incoming.put(("add", seq))
        self._wake.set()
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self._incoming.put(("cancel", request_id))
        self._wake.set()

    def get_result(self, timeout: float | None = None) -> StepOutput | None:
        try:
            return self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None

    def counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting) + self._incoming.qsize()

    def block_usage(self) -> tuple[int, int]:
        return self.blocks.used, self.num_blocks

    # --- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.runner = ModelRunner(self.model, self.num_blocks, self.page_size, paged_attention=self.paged_attention,
                                      kv_dtype=self.kv_dtype)
        except Exception:
            log.exception("the owned engine loop could not build its KV cache")
            self._alive = False
            self._ready.set()
            return
        try:
            self.stack_report = self._install_stack()
        except Exception as exc:  # a kernel refusing these weights leaves the other paths, and says why
            log.warning("the decode stack could not be used: %s", exc, exc_info=True)
            self.stack_report = StackReport("unavailable", f"{type(exc).__name__}: {exc}"[:300])
        log.info(self.stack_report.describe())
        if self.compile_buckets and not self._stack_serves(self.compile_buckets):
            # serves eagerly until the compiled steps are built and measured faster
            self.compiler = DecodeCompiler(self.runner, torch.get_num_threads(), self.compile_cache_dir,
                                           self.compile_buckets, kept=self.kept)
            self.compiler.start()
        self.governor = ThreadGovernor(torch.get_num_threads())
        self._ready.set()
        by_id: dict[str, Sequence] = {}
        try:
            while not self._stopping.is_set():
                self._take_incoming(by_id)
                if not self.scheduler:
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                self._step(by_id)
        except Exception as exc:  # the Engine sees is_running() False, fails its requests and rebuilds us
            log.exception("the owned engine loop failed")
            for seq in by_id.values():
                self._outputs.put(StepOutput(seq.request_id, seq.generated, finished=True, error=str(exc)))
        finally:
            self._alive = False

    def _install_stack(self) -> StackReport:
        """The decode stack where it measured faster: at an earlier start on this machine, else now."""
        kept = self.kept.recall("decode_stack")
        if kept is not None:
            return install_as_kept(self.runner, kept)
        report = install_stack(self.runner, (1, max(self.compile_buckets, default=8)))
        if report.state != "unavailable":
            self.kept.keep("decode_stack", report.as_dict())
        return report

    def _stack_serves(self, buckets: tuple[int, ...]) -> bool:
        """Whether the stack takes every decode step the compiled graphs would (then none are compiled)."""
        stacked = self.runner.stacked
        return stacked is not None and stacked.max_rows >= max(buckets)

    def decode_step_ms_p50(self) -> dict[str, float]:
        """The median of the recent decode-only steps' ms by row count ({"1": 3.4, "12": 28.1}; JSON keys)."""
        recent = list(self.decode_step_ms.items())  # one copy under the GIL: the loop thread adds to it
        return {str(rows): round(statistics.median(list(times)), 2) for rows, times in sorted(recent) if times}

    def _take_incoming(self, by_id: dict[str, Sequence]) -> None:
        while True:
            try:
                kind, item = self._incoming.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                by_id[item.request_id] = item
                self.scheduler.add(item)
            else:
                seq = by_id.pop(item, None)
                if seq is not None:
                    self.scheduler.finish(seq)  # the Engine already told the request's handle

    def _step(self, by_id: dict[str, Sequence]) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            self._wake.wait(timeout=0.01)  # everything waits for blocks held by nobody running: none
            return
        self.governor.before_step()
        started = time.perf_counter()
        logits = self.runner.step(plan)
        if not plan.prefill:
            self.governor.after_decode_step(len(plan.decode), (time.perf_counter() - started) * 1000,
                                            positions=sum(seq.computed for seq in plan.decode))
        self.steps += 1
        yielding = list(plan.decode)
        for chunk in plan.prefill:
            chunk.seq.computed = chunk.end
            self.blocks.register_computed_blocks(chunk.seq)
            if chunk.completes_prompt:
                yielding.append(chunk.seq)
        for seq in plan.decode:
            seq.computed = len(seq)
        tokens, entries = pick_tokens(logits, yielding) if yielding else ([], [])
        elapsed = time.perf_counter() - started
        self.step_seconds += elapsed
        if not plan.prefill:
            self.decode_step_ms[len(plan.decode)].append(elapsed * 1000)
        for seq, token, entry in zip(yielding, tokens, entries, strict=True):
            seq.append(token)
            if entry is not None:
                seq.logprobs.append(entry)
            finished = seq.done
            if finished:
                self.scheduler.finish(seq)
                by_id.pop(seq.request_id, None)
            logprobs = seq.logprobs if seq.sampling.logprobs else None
            self._outputs.put(StepOutput(seq.request_id, seq.generated, finished=finished, logprobs=logprobs))
