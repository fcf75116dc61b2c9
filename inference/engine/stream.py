"""One request's stream: the events a caller reads, the handle it holds, and the engine's stats."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from .config import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, EngineError


@dataclass
class StreamEvent:
    """What happened to one request since the last event: new tokens, and maybe its end."""

    new_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # One (logprob, [(token id, logprob), …]) per new token, when the request asked for logprobs.
    new_logprobs: list | None = None


@dataclass
class EngineStats:
    model: str
    device: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    tokens_per_s: float  # decode: output tokens per second over the last 10 s
    requests_finished: int
    peak_running: int
    restarts: int
    quantization: str = "none"
    loop: str = "transformers"  # which decode loop runs: "owned" (inference/engine/owned/) or "transformers"
    weights_bytes: int = 0  # memory of the loaded weights (int8 layers counted at one byte per weight)
    busy_tokens_per_s: float = 0.0  # decode over the last 10 s, idle gaps left out (0: too few tokens to tell)
    prefill_tokens_per_s: float = 0.0  # the last request's prompt tokens ÷ its time to first token
    peak_tokens_per_s: float = 0.0  # the highest busy decode rate since the engine started
    peak_prefill_tokens_per_s: float = 0.0  # the highest prefill rate of one request since it started
    # The compiled decode steps (inference/engine/owned/compiled.py): "" when nothing compiles,
    # else compiling | used | slower | failed, and the sentence that says what was measured.
    compiled_decode_state: str = ""
    compiled_decode: str = ""
    decode_stack_state: str = ""  # used | slower | unavailable (owned loop), "" for transformers' loop
    decode_stack: str = ""
    # Times the owned loop dropped to one thread because another process held a core (owned/threads.py).
    thread_backoffs: int = 0
    # The median ms of the owned loop's recent decode-only steps by row count ({"1": 3.4, "12": 28.1}):
    # the same step in a worker beside the web tier and alone in a bench process.
    decode_step_ms_p50: dict = field(default_factory=dict)
    updated_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return asdict(self)


CANCELLED = object()  # marker pushed into a request's queue by cancel()


class RequestHandle:
    """One submitted request: iterate events() to read its stream.

    Or, for a request submitted with a listener: the pump calls the listener with every event (in
    the pump thread, one thread for all such requests, so an engine step wakes no thread per
    request), and the submitter only waits for the end with wait_end().
    """

    def __init__(self, cancel: Callable[[str], object], request_id: str, engine_id: str, eos_ids: set[int],
                 listener: Callable[[StreamEvent], None] | None = None) -> None:
        # The engine's cancel (Engine.cancel), for a reader that gives up waiting: the stream needs
        # nothing else of the engine, which builds it (loop.py imports this module, not the reverse).
        self.cancel = cancel
        self.request_id = request_id
        self.engine_id = engine_id
        self.eos_ids = eos_ids
        self.listener = listener
        self.outputs: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.prompt_tokens = 0  # set by Engine.submit; counted as prefilled when the first token comes
        self.submitted_at = time.monotonic()
        self.last_output_at = time.monotonic()  # when the engine last produced something for it

    def events(self, timeout: float) -> Iterator[StreamEvent]:
        """Yield events until the request ends; raises EngineError if nothing arrives within timeout."""
        while True:
            try:
                item = self.outputs.get(timeout=timeout)
            except queue.Empty:
                self.cancel(self.request_id)
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
        if item is CANCELLED:
            return StreamEvent([], finished=True, finish_reason=FINISH_CANCELLED)
        # Only the step's new tokens are copied: the pump calls this for every running request
        # every step, and copying each whole answer so far made that quadratic in its length.
        seen = len(self.tokens)
        new = list(item.generated_tokens[seen:])
        self.tokens.extend(new)
        all_logprobs = getattr(item, "logprobs", None)
        logprobs = list(all_logprobs[seen : seen + len(new)]) if all_logprobs is not None else None
        if not item.is_finished():
            return StreamEvent(new, new_logprobs=logprobs)
        if item.error:
            return StreamEvent(new, finished=True, finish_reason=FINISH_ERROR, error=str(item.error), new_logprobs=logprobs)
        reason = FINISH_STOP if self.tokens and self.tokens[-1] in self.eos_ids else FINISH_LENGTH
        return StreamEvent(new, finished=True, finish_reason=reason, new_logprobs=logprobs)



@dataclass
class FailedOutput:
    """Stands in for a GenerationOutput when the engine itself fails a request."""

    request_id: str
    generated_tokens: list[int]
    error: str

    def is_finished(self) -> bool:
        return True

