"""One interface for a generation in flight, whether the local engine or a remote server makes it.

    generation = open_generation(log_row)      # LocalGeneration or RemoteGeneration
    with running(generation):                  # the one cancel registry of this worker process
        generation.start(on_text)              # on_text(piece, new_tokens, tokens_so_far, logprobs), any thread
        outcome = generation.wait()            # the end, under the engine's idle and total limits

The worker's cancel listener calls cancel(request_id) for every broadcast cancel; whichever kind of
generation runs that request stops within a step (local) or at once (remote). generation.py turns
the pieces into frames and the outcome into the ledger row, the same way for both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from django.conf import settings
from django.db import DatabaseError, connection

from budgets import estimates, failover
from budgets.models import Provider, TokenLog
from inference.engine import FINISH_CANCELLED, FINISH_ERROR, FINISH_STOP, EngineError, Sampling
from inference.engine.detokenizer import IncrementalDecoder
from inference.engines import get_engine
from inference.web.tokenizer import count_text_tokens
from inference.worker import remote
from inference.worker.stops import StopMatcher

log = logging.getLogger(__name__)

# on_text(piece, new_tokens, tokens_so_far, logprobs): the text the new tokens added ("" while a
# character is incomplete), how many tokens that was, how many the answer has now (what the user has
# seen), and, when the request asked for them, OpenAI's logprobs entries of those tokens (else None).
OnText = Callable[[str, int, int, list | None], None]


class GenerationError(RuntimeError):
    """The generation could not start; the message is safe to show to a user."""


@dataclass
class Outcome:
    """How a generation ended. Token counts are None where ours stand (the local engine counts ids)."""

    finish_reason: str
    error: str = ""
    text: str = ""
    completion_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # a remote's own count of the prompt (tokenizers differ)
    completion_tokens: int | None = None  # a remote's own count of the answer
    tool_calls: list | None = None  # a remote's tool calls, as it sent them (finish_reason "tool_calls")


class Generation(Protocol):
    request_id: str

    def start(self, on_text: OnText) -> None: ...

    def wait(self) -> Outcome: ...

    def cancel(self) -> None: ...


def open_generation(log_row: TokenLog) -> Generation:
    """The generation that serves this ledger row: its provider's remote server, else the local engine."""
    if log_row.provider is not None and log_row.provider.kind == Provider.Kind.OPENAI_COMPATIBLE:
        return RemoteGeneration(log_row)
    return LocalGeneration(log_row)


# --- the one cancel registry ------------------------------------------------------------------------

_running: dict[str, Generation] = {}
_running_lock = threading.Lock()


@contextmanager
def running(generation: Generation) -> Iterator[Generation]:
    """Make the generation reachable by cancel() for as long as the block runs."""
    with _running_lock:
        _running[generation.request_id] = generation
    try:
        yield generation
    finally:
        with _running_lock:
            if _running.get(generation.request_id) is generation:
                del _running[generation.request_id]


def cancel(request_id: str) -> bool:
    """Stop a request this process is generating; False when it holds none with that id."""
    with _running_lock:
        generation = _running.get(request_id)
    if generation is None:
        return False
    generation.cancel()
    return True


# --- the local engine -------------------------------------------------------------------------------


class LocalGeneration:
    """A request on this worker's engine for the feature's weight variant.

    The engine's pump thread calls on_text for every step (one thread for all requests: a step
    wakes no thread per request); the task thread only waits for the end.
    """

    def __init__(self, log_row: TokenLog) -> None:
        self.request_id = log_row.request_id
        self.prompt_ids = log_row.transcript.prompt_ids
        self.max_tokens = log_row.max_tokens
        self.variant = log_row.feature.quantization if log_row.feature else None
        self.params = log_row.transcript.params or {}
        self.engine = None
        self.handle = None
        self.decoder: IncrementalDecoder | None = None
        # Stop strings are matched here, on the text, not in the engine (which sees token ids only).
        self.stops = StopMatcher(self.params["stop"]) if self.params.get("stop") else None
        self.on_text: OnText | None = None

    def start(self, on_text: OnText) -> None:
        try:
            sampling = sampling_of(self.params)
            # A worker loads a weight variant at the first request that needs it.
            self.engine = get_engine(self.variant)
            self.decoder = IncrementalDecoder(self.engine.tokenizer)
            self.on_text = on_text
            self.handle = self.engine.submit(self.request_id, self.prompt_ids, self.max_tokens,
                                             ignore_eos=settings.CEILING_IGNORE_EOS, listener=self._on_event,
                                             sampling=sampling)
        except EngineError as exc:
            raise GenerationError(str(exc)) from exc

    def _on_event(self, event) -> None:
        """In the engine's pump thread: the step's new tokens → text (cut at a stop string) → on_text."""
        if not event.new_tokens or (self.stops is not None and self.stops.stopped):
            return  # after a stop string, the steps before the cancel lands are not the answer's
        piece = self.decoder.push(event.new_tokens)
        logprobs = openai_logprobs(self.engine.tokenizer, event.new_tokens, event.new_logprobs)
        if self.stops is not None:
            piece = self.stops.feed(piece)
            if self.stops.stopped:
                self.engine.cancel(self.request_id)  # no more steps for it; its end arrives as cancelled
        self.on_text(piece, len(event.new_tokens), len(self.decoder.ids), logprobs)

    def wait(self) -> Outcome:
        finish_reason, error = wait_for_the_end(self.engine, self.handle)
        text = self.decoder.text()
        if self.stops is not None:
            if self.stops.stopped:
                finish_reason, error = FINISH_STOP, ""  # our own cancel, for the stop string
            else:
                rest = self.stops.flush()  # held back as a maybe-stop; it was not one
                if rest:
                    self.on_text(rest, 0, len(self.decoder.ids), None)
            text = self.stops.released
        return Outcome(finish_reason, error, text=text, completion_ids=self.handle.tokens)

    def cancel(self) -> None:
        if self.engine is not None:
            self.engine.cancel(self.request_id)


def sampling_of(params: dict) -> Sampling:
    """The engine's Sampling from a request's stored params (validated already by the API)."""
    return Sampling(
        temperature=params.get("temperature", 0.0),
        top_p=params.get("top_p", 1.0),
        seed=params.get("seed"),
        presence_penalty=params.get("presence_penalty", 0.0),
        frequency_penalty=params.get("frequency_penalty", 0.0),
        logprobs=bool(params.get("logprobs")),
        top_logprobs=params.get("top_logprobs") or 0,
    )


def openai_logprobs(tokenizer, token_ids: list[int], entries: list | None) -> list | None:
    """The engine's (logprob, [(id, logprob), …]) per token as OpenAI's logprobs.content entries."""
    if not entries:
        return None
    return [
        {**_token_entry(tokenizer, token_id, logprob),
         "top_logprobs": [_token_entry(tokenizer, other, other_logprob) for other, other_logprob in top]}
        for token_id, (logprob, top) in zip(token_ids, entries, strict=False)
    ]


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def wait_for_the_end(engine, handle) -> tuple[str, str]:
    """(finish reason, error) of a listened-to request, enforcing the engine's idle and total limits."""
    idle_limit = settings.CEILING_ENGINE_FIRST_TOKEN_S
    deadline = time.monotonic() + settings.CEILING_ENGINE_DEADLINE_S
    error = ""
    while True:
        now = time.monotonic()
        idle_left = idle_limit - (now - handle.last_output_at)
        if idle_left <= 0:
            engine.cancel(handle.request_id)
            return FINISH_ERROR, f"the engine produced nothing for {idle_limit:.0f} s"
        if not error and now > deadline:
            engine.cancel(handle.request_id)  # its cancelled end follows at once
            error = f"the answer took longer than {settings.CEILING_ENGINE_DEADLINE_S:.0f} s"
        wait = idle_left if error else min(idle_left, deadline - now)
        end = handle.wait_end(timeout=max(wait, 0.01))
        if end is None:
            continue
        if error and end.finish_reason == FINISH_CANCELLED:
            return FINISH_ERROR, error  # our own deadline cancelled it: a failure, not the user's cancel
        return end.finish_reason, end.error or error


# --- a remote OpenAI-compatible server ----------------------------------------------------------------


class RemoteGeneration:
    """A request streamed from the feature's remote provider; the task thread reads the stream.

    The remote's own token counts go to the ledger; a server that reports none is counted one
    token per streamed chunk (remote.py). When the provider cannot take the request (429, 5xx, no
    connection, no first token in time) before any text reached the client, the request moves to
    the feature's next eligible backup provider under the same reservation (budgets/failover.py).
    """

    def __init__(self, log_row: TokenLog) -> None:
        self.request_id = log_row.request_id
        self.log_row = log_row
        self.reserved_at = log_row.price  # the price the guard reserved at: no backup may be dearer
        self.stream: remote.RemoteStream | None = None
        self.on_text: OnText | None = None
        self.failed_over: list[str] = []  # the ledger's "provider: why", in order
        self.reasons: list[str] = []  # the same as sentences, for the user's message when all failed

    def start(self, on_text: OnText) -> None:
        self.on_text = on_text
        self.stream = self._open(self.log_row.provider)

    def _open(self, provider: Provider) -> remote.RemoteStream:
        row = self.log_row
        try:
            stream = remote.open_stream(row.request_id, provider, row.model, row.transcript.messages, row.max_tokens,
                                        params=row.transcript.params)
        except remote.RemoteConfigError as exc:
            raise GenerationError(str(exc)) from exc
        stream.start(read_timeout_s=settings.CEILING_ENGINE_DEADLINE_S)
        return stream

    def wait(self) -> Outcome:
        event, shown = self._read(self.stream)
        row = self.log_row
        if event.retryable and not shown and row.feature_id and row.feature.backup_providers:
            try:
                event = self._fail_over(event)
            except DatabaseError as exc:  # the ledger cannot say who serves: end as the last try ended
                log.warning("could not fail over %s: %s", self.request_id, exc)
        stream = self.stream
        self._learn_prompt_ratio(stream)
        error = event.error or ""
        if self.failed_over and event.finish_reason == FINISH_ERROR:
            error = "; ".join(self.reasons)  # every provider tried failed or was passed over: it names each
        # Tokenizers differ: the guard admitted on our estimate of the prompt; the ledger keeps the remote's count.
        return Outcome(event.finish_reason, error, text=stream.text, prompt_tokens=stream.prompt_tokens,
                       completion_tokens=stream.completion_tokens, tool_calls=stream.tool_calls())

    def _read(self, stream: remote.RemoteStream) -> tuple[remote.RemoteEvent, bool]:
        """Stream to the client until the end: (the end, whether any text reached the client)."""
        end = remote.RemoteEvent("", finished=True, finish_reason=FINISH_ERROR)
        pieces = 0  # the remote's own count comes at the end; until then, one token per piece shown
        try:
            for event in stream.events(settings.CEILING_ENGINE_FIRST_TOKEN_S, settings.CEILING_ENGINE_DEADLINE_S):
                if event.text or event.logprobs:
                    pieces += 1
                    self.on_text(event.text, 1, pieces, event.logprobs)
                if event.finished:
                    end = event
                    break
        finally:
            stream.stop.set()  # the reader hangs up, so the remote stops generating
        return end, pieces > 0

    def _fail_over(self, event: remote.RemoteEvent) -> remote.RemoteEvent:
        """Try the feature's backups in order while each fails before its first token; the last end."""
        row = self.log_row
        self._failed(row.provider, event.error or "")
        with database_access():
            listed = failover.backups(row, self.reserved_at)
        for name, backup, why_not in listed:
            if backup is None:
                self.failed_over.append(f"{name}: {why_not}")
                self.reasons.append(f"the provider {name!r} {why_not}")
                continue
            if remote.cancel_requested(self.request_id):
                event = remote.RemoteEvent("", finished=True, finish_reason=FINISH_CANCELLED)
                break
            with database_access():
                if not failover.do_switch_provider(row, backup, self.failed_over):
                    return event  # settled meanwhile (its worker was presumed lost): nothing more to try
            log.info("failing over to the provider %s after: %s", backup.provider.name, self.failed_over[-1])
            try:
                self.stream = self._open(backup.provider)
            except GenerationError as exc:
                self._failed(backup.provider, str(exc))
                continue
            event, shown = self._read(self.stream)
            if not (event.retryable and not shown):
                break
            self._failed(backup.provider, event.error or "")
        with database_access():
            failover.do_note_failed_over(row, self.failed_over)
        return event

    def _failed(self, provider: Provider, error: str) -> None:
        self.failed_over.append(f"{provider.name}: {error}")
        self.reasons.append(error)

    def _learn_prompt_ratio(self, stream: remote.RemoteStream) -> None:
        """Teach the provider's estimate what this prompt was really billed (budgets/estimates.py), so a
        remote that counts more than the estimate overshoots once, not on every request."""
        row = self.log_row
        if stream.prompt_tokens is None or row.provider_id is None:
            return
        base = estimates.base_estimate(row.transcript.messages, row.transcript.params, count_text_tokens)
        estimates.learn_ratio(row.provider_id, row.model, stream.prompt_tokens, base)

    def cancel(self) -> None:
        if self.stream is not None:
            self.stream.cancel()


@contextmanager
def database_access() -> Iterator[None]:
    """A ledger read or write in the middle of a stream: the connection goes back at once, as the
    worker's was before the stream began (generation.release_database_connection)."""
    try:
        yield
    finally:
        connection.close()
