"""The owned loop's thread count under a busy neighbour (inference/engine/owned/threads.py): all threads
while decode steps keep near their best, one thread for a while once they keep waiting, then all again."""

from __future__ import annotations

from inference.engine.owned import threads
from inference.engine.owned.threads import ThreadGovernor


class Host:
    """The clock and the thread setting the governor is given: the test moves time and reads the setting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.threads: list[int] = []

    def governor(self, count: int = 2) -> ThreadGovernor:
        return ThreadGovernor(count, clock=lambda: self.now, set_threads=self.threads.append)


def steps(governor: ThreadGovernor, host: Host, times_ms: list[float], rows: int = 1, positions: int = 0) -> None:
    for elapsed in times_ms:
        governor.before_step()
        governor.after_decode_step(rows, elapsed, positions)
        host.now += elapsed / 1000


def test_steps_near_their_best_keep_every_thread():
    host = Host()
    governor = host.governor()
    steps(governor, host, [5.0, 5.2, 9.0, 5.1, 11.0, 5.0] * 5)  # one step in three at ~2× its best: noise
    assert host.threads == [] and governor.backoffs == 0 and governor.best_ms == {(1, 0): 5.0}


def test_a_neighbour_holding_a_core_drops_the_loop_to_one_thread_then_all_are_tried_again():
    host = Host()
    governor = host.governor()
    steps(governor, host, [5.0] * 3)
    steps(governor, host, [40.0, 5.0, 90.0])  # two of the last four waited for a descheduled thread
    assert governor.backoffs == 1
    steps(governor, host, [9.0] * 10)  # one thread: slower than the best, and never read as waiting
    assert host.threads == [1] and governor.backoffs == 1
    host.now += threads.BACKOFF_S
    steps(governor, host, [5.0] * 4)  # the neighbour left: all threads again, and they stay
    assert host.threads == [1, 2] and governor.current == 2 and governor.backoffs == 1


def test_the_best_time_is_kept_per_row_count():
    host = Host()
    governor = host.governor()
    steps(governor, host, [5.0, 5.0], rows=1)
    steps(governor, host, [20.0, 21.0, 20.5, 20.0], rows=8)  # 4× a lone row's time, but 8 rows' own best
    assert governor.backoffs == 0 and governor.best_ms == {(1, 0): 5.0, (8, 0): 20.0}


def test_a_long_context_is_not_read_as_a_neighbour():
    # A lone q4 row at 2,000 positions of an fp32 cache steps ~3× slower than at position 0, with
    # nobody else on the machine: compared by rows alone, that dropped the loop to one thread.
    host = Host()
    governor = host.governor()
    steps(governor, host, [5.0] * 4, positions=10)
    steps(governor, host, [15.0] * 8, positions=2000)
    assert governor.backoffs == 0 and host.threads == []
    assert governor.best_ms == {(1, 0): 5.0, (1, 2000 // threads.POSITIONS_PER_BUCKET): 15.0}
    steps(governor, host, [40.0, 45.0], positions=2010)  # and 2.5× of that context's own best still is one
    assert governor.backoffs == 1 and host.threads == []
    steps(governor, host, [15.0], positions=2020)
    assert host.threads == [1]


def test_a_one_thread_engine_has_nothing_to_drop():
    host = Host()
    governor = host.governor(count=1)
    steps(governor, host, [5.0, 50.0, 60.0, 70.0])
    assert host.threads == [] and governor.backoffs == 0


def test_a_neighbour_that_stays_doubles_each_spell_up_to_the_most():
    host = Host()
    governor = host.governor()
    steps(governor, host, [5.0] * 3)
    spells = []
    for _ in range(6):  # every retry of two threads meets the neighbour again
        steps(governor, host, [40.0, 40.0])
        spells.append(governor.spell_s)
        host.now = governor.single_until
    assert spells == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0] and governor.backoffs == 6
    host.now += 60  # long after: a new neighbour starts from the shortest spell
    steps(governor, host, [40.0, 40.0])
    assert governor.spell_s == threads.BACKOFF_S


def test_delays_that_still_leave_all_threads_faster_than_one_keep_every_thread():
    # The stack's web tier wakes for every streamed token and now and then delays a step 2.5× without
    # holding a core: once a spell has shown one thread slower than all threads with those delays,
    # they no longer drop the loop; a neighbour that makes all threads slower than one still does.
    host = Host()
    governor = host.governor()
    steps(governor, host, [4.0] * 4)
    steps(governor, host, [11.0, 4.0, 11.0])  # not yet known whether one thread would do better: tried
    assert governor.backoffs == 1
    steps(governor, host, [8.0] * 6)  # one thread: 8 ms a step
    host.now = governor.single_until
    steps(governor, host, [4.0, 11.0] * 8)  # all threads, delays included: 7.5 ms on average
    assert governor.backoffs == 1 and governor.current == 2
    steps(governor, host, [40.0, 40.0])  # a neighbour: now all threads take longer than one would
    assert governor.backoffs == 2
    steps(governor, host, [8.0])
    assert governor.current == 1
