"""The engine: a model, continuous batching, kernels and weights — and nothing of Django or the apps.

It can be read, tested and benchmarked alone (`tests/test_layering.py` keeps it so). The worker's
side, which builds an EngineConfig from settings and keeps one engine per weight variant, is
inference/engines.py.

    engine = Engine(EngineConfig(model_dir=folder))
    engine.start()
    handle = engine.submit("r1", engine.encode_chat(messages), max_new_tokens=64)
    for event in handle.events(timeout=30): ...
"""

from __future__ import annotations

import importlib

# Lazy, so that a web process that needs only the chat template (engine/chat.py) or the finish
# reasons (engine/config.py) does not import torch and the patches with them.
_EXPORTS = {
    "encode_chat": "chat",
    "FINISH_CANCELLED": "config",
    "FINISH_ERROR": "config",
    "FINISH_LENGTH": "config",
    "FINISH_STOP": "config",
    "EngineConfig": "config",
    "EngineError": "config",
    "GREEDY": "config",
    "Sampling": "config",
    "default_device": "config",
    "IncrementalDecoder": "detokenizer",
    "Engine": "loop",
    "in_a_passing_thread": "loop",
    "EngineStats": "stream",
    "RequestHandle": "stream",
    "StreamEvent": "stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
