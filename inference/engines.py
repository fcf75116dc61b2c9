"""The engines of this worker process, and the engine's configuration from Django settings.

The engine package (inference/engine/) knows nothing of Django; this module is its one door to
settings: where the model's files are (CEILING_MODEL, VAR_DIR), how the engine is sized
(CEILING_KV_*, CEILING_ATTENTION, …), and which weight variant each request gets.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from .engine import weights
from .engine.config import EngineConfig, EngineError, default_device, step_limits
from .engine.machine import machine_signature
from .engine.measured import FILE_NAME as MEASUREMENTS_FILE
from .variants import variant_queue, worker_variants

if TYPE_CHECKING:  # the web tier imports model_dir from here, and must not import torch with it
    from .engine.loop import Engine

log = logging.getLogger(__name__)


def model_dir(progress=print) -> Path:
    """The folder the engine and the tokenizer load from: CEILING_MODEL, else the bundled model (converted once)."""
    return weights.model_dir(settings.CEILING_MODEL, Path(settings.VAR_DIR), progress=progress)


def engine_config_from_settings(folder: Path, quantization: str | None = None) -> EngineConfig:
    device = settings.CEILING_DEVICE or default_device()
    prefill_budget, max_running = step_limits(device, settings.CEILING_PREFILL_BUDGET, settings.CEILING_MAX_RUNNING)
    return EngineConfig(
        model_dir=folder,
        device=device,
        torch_threads=settings.CEILING_TORCH_THREADS,
        page_size=settings.CEILING_KV_PAGE_SIZE,
        num_blocks=settings.CEILING_KV_BLOCKS,
        max_batch_tokens=settings.CEILING_MAX_BATCH_TOKENS,
        prefill_budget=prefill_budget,
        max_running=max_running,
        kv_dtype=settings.CEILING_KV_DTYPE,
        prefix_sharing=settings.CEILING_PREFIX_SHARING,
        loop=settings.CEILING_ENGINE_LOOP,
        attention=settings.CEILING_ATTENTION,
        skinny_linear=settings.CEILING_SKINNY_LINEAR,
        quantization=quantization or settings.CEILING_QUANTIZATION,
        compile_buckets=settings.CEILING_COMPILE_BUCKETS if settings.CEILING_COMPILE_DECODE else (),
        compile_cache_dir=Path(settings.VAR_DIR) / "inductor",
        own_kernels=settings.CEILING_OWN_KERNELS,
        kernel_cache_dir=Path(settings.VAR_DIR) / "kernels",
        q4_wide_bf16=settings.CEILING_Q4_WIDE_BF16,
        measurements_file=Path(settings.VAR_DIR) / MEASUREMENTS_FILE,
        remeasure=settings.CEILING_REMEASURE,
    )


def this_machine() -> str:
    """This machine as an evaluation records it: the engines of engine_config_from_settings run here."""
    return machine_signature(settings.CEILING_TORCH_THREADS, settings.CEILING_DEVICE or default_device())


# A worker process hosts the engine of one weight variant (inference/variants.py): CEILING_QUANTIZATION,
# or what CEILING_WORKER_VARIANTS names, loaded when the worker starts. Two engines in one process are
# two OpenMP teams on the same cores, and an idle bf16 engine beside the fp32 one slowed every fp32
# answer ~1.6×; so a feature switched to another variant is served by that variant's own worker, on
# its own queue, and this process refuses a variant it was not started for rather than load it
# beside its own. (CEILING_WORKER_VARIANTS may name several, each loaded at its first request, where
# that slowdown is acceptable: one small machine, rare use of the second variant.)

_engines: dict[str, Engine] = {}
_engine_lock = threading.Lock()  # guards the two dicts, never held while a model loads
_variant_locks: dict[str, threading.Lock] = {}


def _default_variant() -> str:
    """The variant this worker loads at start: the first it serves."""
    return worker_variants()[0]


def get_engine(quantization: str | None = None) -> Engine:
    """The process's engine for a weight variant (default: CEILING_QUANTIZATION), started on first use."""
    variant = quantization or _default_variant()
    served = worker_variants()
    if variant not in served:
        raise EngineError(f"this worker serves {', '.join(served)} weights, not {variant}; "
                          f"{variant} requests belong on the queue {variant_queue(variant)}")
    with _engine_lock:
        engine = _engines.get(variant)
        if engine is not None:
            return engine
        variant_lock = _variant_locks.setdefault(variant, threading.Lock())
    # Loading one variant must not stall requests to another, hence a lock per variant.
    with variant_lock:
        if variant in _engines:
            return _engines[variant]
        from .engine.loop import Engine
        from .engine.patches.quantization import QuantizationError

        engine = Engine(engine_config_from_settings(model_dir(progress=log.info), quantization=variant))
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


def process_stats() -> dict:
    """What a worker publishes: its engine's stats (with its variant as `quantization`), plus those of
    the other variants it loaded since, if CEILING_WORKER_VARIANTS names several."""
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
