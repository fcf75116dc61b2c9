"""Each worker reports its engine's measured throughput, so the local provider's price follows it.

The engine keeps the highest 10-second decode and prefill rates it has reached (Engine.stats); every
CEILING_THROUGHPUT_EVERY_S this thread hands them to budgets.actions.do_record_throughput, which
keeps the best rates seen and re-prices local tokens from them (budgets/selfhosted.py).
"""

from __future__ import annotations

import logging
import threading

from django.db import close_old_connections

from budgets.actions import do_record_throughput, do_record_variant_throughput

from ..engine import Engine
from ..engines import engine_if_started
from ..variants import variant_model_name

log = logging.getLogger(__name__)


def report_throughput(engine: Engine | None = None) -> int:
    """Record the peak rates of this worker's engine now; returns how many local prices changed.

    A worker hosts one weight variant: full precision prices the provider's own model (and keeps its
    rates on the provider); another variant prices its own model, "<model>@<variant>".
    """
    engine = engine or engine_if_started()
    if engine is None:
        return 0
    stats = engine.stats()
    record = do_record_throughput if stats.quantization in ("", "none") else do_record_variant_throughput
    prices = record(stats.peak_tokens_per_s, stats.peak_prefill_tokens_per_s, model=variant_model_name(stats.quantization))
    for price in prices:
        log.info("local tokens re-priced from measured throughput: %s (%s)", price, price.basis)
    return len(prices)


def report_throughput_forever(stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            close_old_connections()
            report_throughput()
        except Exception:  # noqa: BLE001 - a price report must never take the worker down
            log.exception("reporting the engine's throughput failed")
