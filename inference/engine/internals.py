"""transformers' continuous-batching internals, read in one place so an upgrade breaks only here.

Checked on transformers 5.24 (docs/engine.md): the manager's `batch_processor` is None until the
first request; its scheduler's request maps may only be measured with len() from other threads.
"""

from __future__ import annotations


def scheduler_counts(manager) -> tuple[int, int]:
    """(requests running, requests waiting). len() only: other threads must never iterate these."""
    if hasattr(manager, "counts"):
        return manager.counts()  # the owned loop (inference/engine/owned/manager.py) says it itself
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return 0, 0
    scheduler = processor.scheduler
    return len(scheduler.active_requests), len(scheduler.waiting_requests)


def kv_block_usage(manager, configured_blocks: int) -> tuple[int, int]:
    """(KV blocks in use, KV blocks in total); before the first request the cache does not exist yet."""
    if hasattr(manager, "block_usage"):
        return manager.block_usage()
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return 0, configured_blocks
    cache = processor.cache
    total = int(cache.num_blocks)
    free_share = float(cache.compute_free_capacity(relative=True))
    return max(0, round(total * (1.0 - free_share))), total

