"""How many threads the loop's steps use while another process holds one of the cores.

A decode step wakes its threads ~150 times (every 4-bit product, every layer's attention) and waits
at each join for the slowest. When another process runs on one of the cores, the thread that shares
it is descheduled for a time slice now and then, and every join waits for it: on a 2-core AMD EPYC
with a busy neighbour a lone stacked step went from ~5 ms to p50 14, p90 84-104 and max 390-820 ms
with 2 threads, against p50 10, p90 13-17 with 1 (docs/engine.md). One thread is slower on a quiet
machine (one core's share of the memory bandwidth) and several times faster at the tail on a busy
one, so the loop takes whichever the steps show:

- every decode-only step's time is compared with the best time seen with all threads for steps of
  its row count and about its cached positions (a step of 2.5× its best waited for a thread). The
  positions count because a long context is slow by itself: a lone q4 row's step at 2,000 positions
  of an fp32 cache takes ~3× its step at position 0, which, compared by rows alone, read as a
  neighbour and dropped the loop to one thread;
- two such steps among the last four drop the loop to one thread for `BACKOFF_S`; after that it
  tries all its threads again, and stays with them while their steps keep near their best. A
  neighbour still there when they are tried doubles the next spell (up to `MAX_BACKOFF_S`), so a
  long-running one costs a few slow steps every 8 s, not every second;
- once a spell has shown what one thread does for steps of a row count, slow steps drop the loop
  only while all threads' recent steps of that count take longer on average than one thread's did.
  The stack's own web tier (daphne, Redis, the worker's streaming thread) wakes for every token and
  now and then delays a step 2.5×, without holding a core: a lone chat through `make run` spent most
  of its time on one thread (its two compute threads at 87% and 32% of a core, 8-11 ms a token on
  a 2-core Intel Xeon where the engine alone takes ~4), though two threads with those delays were
  still the faster.

The loop thread calls it around each step; nothing else sets its thread count. (torch also passes the
count to MKL, whose setting is process-wide: a second engine in the same process would see its
GEMMs follow it, one more reason for one variant per worker process.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

SLOW = 2.5  # a step this many times the best at its row count waited for a descheduled thread
SLOW_OF_RECENT = (2, 4)  # this many slow steps among the last that many: a neighbour holds a core
BACKOFF_S = 1.0  # one thread for this long, then all threads are tried again
MAX_BACKOFF_S = 8.0
POSITIONS_PER_BUCKET = 256  # steps whose rows' cached positions add up to the same 256 share a best time
COMPARED_STEPS = 16  # the recent steps per row count whose mean time compares one thread with all


class ThreadGovernor:
    def __init__(self, threads: int, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.threads = threads
        self.clock = clock
        self.set_threads = set_threads
        # (rows, cached positions ÷ POSITIONS_PER_BUCKET) → the fastest decode step with all threads
        self.best_ms: dict[tuple[int, int], float] = {}
        self.recent: deque[bool] = deque(maxlen=SLOW_OF_RECENT[1])
        self.single_until = 0.0
        self.spell_s = BACKOFF_S
        self.current = threads
        self.backoffs = 0  # times the loop dropped to one thread (the engine's stats could show it)
        # rows → the recent decode steps' times with all threads, and with one (seen during spells)
        self.all_threads_ms: dict[int, deque[float]] = {}
        self.one_thread_ms: dict[int, deque[float]] = {}

    def before_step(self) -> None:
        wanted = 1 if self.clock() < self.single_until else self.threads
        if wanted != self.current:
            self.set_threads(wanted)
            self.current = wanted
            self.recent.clear()

    def after_decode_step(self, rows: int, elapsed_ms: float, positions: int = 0) -> None:
        """A decode-only step of `rows` rows that attended over `positions` cached positions in all."""
        if self.threads == 1:
            return
        if self.current != self.threads:  # one thread's times say nothing about waiting for the other,
            _window(self.one_thread_ms, rows).append(elapsed_ms)  # but what one thread does
            return
        _window(self.all_threads_ms, rows).append(elapsed_ms)
        kind = (rows, positions // POSITIONS_PER_BUCKET)
        best = self.best_ms.get(kind)
        if best is None or elapsed_ms < best:
            self.best_ms[kind] = elapsed_ms
        self.recent.append(best is not None and elapsed_ms > SLOW * best)
        if sum(self.recent) >= SLOW_OF_RECENT[0] and not self._all_threads_still_faster(rows):
            now = self.clock()
            # Slow again within a spell's length of the last one ending: the neighbour stayed.
            stayed = self.backoffs and now - self.single_until < self.spell_s
            self.spell_s = min(2 * self.spell_s, MAX_BACKOFF_S) if stayed else BACKOFF_S
            self.single_until = now + self.spell_s
            self.backoffs += 1

    def _all_threads_still_faster(self, rows: int) -> bool:
        """Whether all threads' recent steps of `rows` rows, waits included, took no longer on average
        than one thread's did in a spell (unknown before the first spell: not shown faster)."""
        one, every = self.one_thread_ms.get(rows), self.all_threads_ms.get(rows)
        if not one or len(one) < SLOW_OF_RECENT[1] or len(every) < SLOW_OF_RECENT[1]:
            return False
        return sum(every) / len(every) <= sum(one) / len(one)


def _window(windows: dict[int, deque[float]], rows: int) -> deque[float]:
    return windows.setdefault(rows, deque(maxlen=COMPARED_STEPS))
