"""Which tokens the next step computes.

Every step first carries each running request one token further (decode rows), then spends what is
left of the step's token budget on prompt chunks (chunked prefill): a long prompt never stalls the
answers already streaming, and a burst of new prompts is absorbed a budget at a time. Requests are
admitted in arrival order when their blocks fit (blocks.py reserves them), except one whose prompt
starts with blocks a running request is computing: it waits for them and shares them (blocks.py).

While any request is decoding, a step prefills at most `prefill_budget` prompt tokens (vLLM's
chunked-prefill token budget, llama.cpp's batch size): each decode row waits for the whole step it
rides in, so a 512-token chunk beside them made every streaming answer's next token as slow as the
chunk. With nothing decoding, nobody waits on the chunk and the step takes the whole max_batch_tokens.

Prompt chunks go shortest remaining prompt first: in a burst, the short questions get their first
token after a step or two instead of queueing behind every long prompt that arrived a moment
earlier (shortest-job-first minimises the mean wait). A prompt that has waited PREFILL_AGING_S
goes first whatever its length, oldest first, so a stream of short prompts never starves a long one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .blocks import BlockManager
from .sequence import FINISHED, RUNNING, Sequence

PREFILL_AGING_S = 2.0

# The measured prefill budget (measured_prefill_budget): the largest of these chunks that keeps a
# step of a full running batch plus the chunk within PREFILL_STEP_STRETCH × the batch's own step.
PREFILL_CHUNKS = (32, 64, 128, 256, 512)
PREFILL_STEP_STRETCH = 3.0


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position computed by this step
    end: int  # one past the last

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.seq.prompt)


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(chunk.end - chunk.start for chunk in self.prefill)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, clock=time.monotonic,
                 prefill_budget: int = 0, max_running: int = 0) -> None:
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.prefill_budget = prefill_budget  # 0: no limit beyond max_batch_tokens
        # Requests in the running batch at once (vLLM's max_num_seqs, llama.cpp's slots); 0: as many as
        # max_batch_tokens. Every decode row waits for the whole step, and past ~16 rows a CPU step's
        # time grows with its rows about as fast as the tokens it makes: a cap keeps each stream fast.
        self.max_running = min(max_running or max_batch_tokens, max_batch_tokens)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.arrived = self.clock()
        self.waiting.append(seq)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan(decode=[seq for seq in self.running if not seq.in_prefill][: self.max_batch_tokens])
        budget = self._prompt_tokens_allowed(len(plan.decode))
        for seq in self._prefill_order():
            if budget <= 0:
                break
            take = min(budget, len(seq.prompt) - seq.computed)
            plan.prefill.append(PrefillChunk(seq, seq.computed, seq.computed + take))
            budget -= take
        return plan

    def _prompt_tokens_allowed(self, decode_rows: int) -> int:
        """Prompt tokens this step may compute: what max_batch_tokens leaves beside the decode rows,
        and no more than the prefill budget while any request is decoding."""
        left = self.max_batch_tokens - decode_rows
        if decode_rows and self.prefill_budget:
            return min(left, self.prefill_budget)
        return left

    def _prefill_order(self) -> list[Sequence]:
        """Running requests still in their prompt: those waiting PREFILL_AGING_S or more first, oldest
        first; then the rest by what is left of their prompt, shortest first (arrival breaks ties)."""
        overdue_before = self.clock() - PREFILL_AGING_S

        def order(seq: Sequence) -> tuple[int, int, float]:
            if seq.arrived <= overdue_before:
                return (0, 0, seq.arrived)
            return (1, len(seq.prompt) - seq.computed, seq.arrived)

        return sorted((seq for seq in self.running if seq.in_prefill), key=order)

    def finish(self, seq: Sequence) -> None:
        """Take a request out (it ended, was cancelled or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = FINISHED

    def _admit(self) -> None:
        held_back: list[Sequence] = []  # wait for a prefix that a running request is computing
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self.blocks.awaits_shared_prefix(seq):
                held_back.append(self.waiting.popleft())
                continue
            if not self.blocks.allocate(seq):
                break  # in order: a large request is not overtaken forever by small ones
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(held_back))


def measured_prefill_budget(step_ms: list[tuple[int, float]], decode_rows: int) -> int | None:
    """The prompt tokens a step may prefill beside `decode_rows` decoding requests, from how long this
    machine's steps take by rows (`step_ms`: (rows, ms) of a pass over the block linears on the
    route each width takes, measured at load; None without timings).

    The largest of PREFILL_CHUNKS whose step stays within PREFILL_STEP_STRETCH × the decode rows' own
    step, and at least the smallest. A fixed token budget meant different stalls on different CPUs:
    where a wide step runs on bf16 matrix units (an Intel Xeon with AMX: 256 rows 75 ms, 16 rows
    28) a chunk of 128 costs each decoding row less than 32 did on a CPU without them (a Zen 4 EPYC:
    256 rows 162 ms, 16 rows 24), and on the Xeon a prompt token took ~0.39 ms of step time in
    32-token chunks against ~0.25 in 128-token ones. 3× is what the 32-token budget tuned on that
    Zen 4 (docs/engine.md, "Requests in the running batch") allowed a step of its 12 running requests.
    """
    points = sorted(dict(step_ms).items())  # one time per width
    if len(points) < 2 or decode_rows < 1:
        return None
    alone = _interpolated_ms(points, decode_rows)
    fitting = [chunk for chunk in PREFILL_CHUNKS
               if _interpolated_ms(points, decode_rows + chunk) <= PREFILL_STEP_STRETCH * alone]
    return max(fitting, default=PREFILL_CHUNKS[0])


def _interpolated_ms(points: list[tuple[int, float]], rows: int) -> float:
    """A step's time at `rows`, on straight lines between the measured widths (and past the ends, the
    nearest line extended)."""
    line = next((index for index in range(1, len(points) - 1) if rows <= points[index][0]), len(points) - 1)
    (rows_a, ms_a), (rows_b, ms_b) = points[line - 1], points[line]
    return ms_a + (ms_b - ms_a) * (rows - rows_a) / (rows_b - rows_a)
