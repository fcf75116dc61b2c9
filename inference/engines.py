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
from .engine.config import EngineConfig, EngineError, default_device

if TYPE_CHECKING:  # the web tier imports model_dir from here, and must not import torch with it
    from .engine.loop import Engine

log = logging.getLogger(__name__)


def model_dir(progress=print) -> Path:
    """The folder the engine and the tokenizer load from: CEILING_MODEL, else the bundled model (converted once)."""
    return weights.model_dir(settings.CEILING_MODEL, Path(settings.VAR_DIR), progress=progress)


def engine_config_from_settings(folder: Path, quantization: str | None = None) -> EngineConfig:
    return EngineConfig(
        model_dir=folder,
        device=settings.CEILING_DEVICE or default_device(),
        torch_threads=settings.CEILING_TORCH_THREADS,
        page_size=settings.CEILING_KV_PAGE_SIZE,
        num_blocks=settings.CEILING_KV_BLOCKS,
        max_batch_tokens=settings.CEILING_MAX_BATCH_TOKENS,
        prefix_sharing=settings.CEILING_PREFIX_SHARING,
        loop=settings.CEILING_ENGINE_LOOP,
        attention=settings.CEILING_ATTENTION,
        skinny_linear=settings.CEILING_SKINNY_LINEAR,
        quantization=quantization or settings.CEILING_QUANTIZATION,
        compile_buckets=settings.CEILING_COMPILE_BUCKETS if settings.CEILING_COMPILE_DECODE else (),
        compile_cache_dir=Path(settings.VAR_DIR) / "inductor",
    )


# A worker hosts one engine per weight variant its features ask for (Feature.quantization): the
# CEILING_QUANTIZATION variant is loaded when the worker starts, another (int8 for a feature staff
# switched to it, or full precision in an int8 worker) the first time a request needs it (a few
# seconds: load + quantize). Each engine has its own KV cache, allocated at its first request, and
# they share the process's cores. One worker queue and one command line serve every variant, and a
# switch on the dashboard takes effect at the next request, with nothing to restart.

_engines: dict[str, Engine] = {}
_engine_lock = threading.Lock()  # guards the two dicts, never held while a model loads
_variant_locks: dict[str, threading.Lock] = {}


def _default_variant() -> str:
    return settings.CEILING_QUANTIZATION


def get_engine(quantization: str | None = None) -> Engine:
    """The process's engine for a weight variant (default: CEILING_QUANTIZATION), started on first use."""
    variant = quantization or _default_variant()
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
    """What a worker publishes: its default engine's stats, plus the other variants it loaded since."""
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
