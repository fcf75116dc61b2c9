"""budgets/batching.py: what is added within a batch's interval goes in one send, a failed send is
logged and the next still goes, and an idle thread hands back what it holds (on_idle)."""

from __future__ import annotations

import logging
import threading

from budgets.batching import Batch


def test_items_added_together_go_in_one_send_and_a_failed_send_does_not_stop_the_next(caplog):
    sent, arrived = [], threading.Event()

    def send(items):
        if items == ["boom"]:
            raise RuntimeError("the receiver is down")
        sent.append(items)
        arrived.set()

    batch = Batch("test-batch", send, every_s=0.05, max_items=2)
    with caplog.at_level(logging.ERROR, logger="budgets.batching"):
        batch.add("boom")
        batch.flush()
        for item in ("a", "b", "c"):
            batch.add(item)
        assert arrived.wait(5)
        batch.flush()

    assert sent == [["a", "b"], ["c"]]  # max_items a send
    assert "test-batch: sending 1 item(s) failed" in caplog.text


def test_an_idle_batch_thread_calls_on_idle_once_until_items_come_again():
    idle, sent = threading.Semaphore(0), threading.Event()
    batch = Batch("test-idle", lambda items: sent.set(), every_s=0.01, max_items=10, on_idle=idle.release,
                  idle_s=0.05)
    batch.add("x")
    assert sent.wait(5)
    assert idle.acquire(timeout=5)
    assert not idle.acquire(timeout=0.3)  # once, not every idle_s
    sent.clear()
    batch.add("y")
    assert sent.wait(5) and idle.acquire(timeout=5)
