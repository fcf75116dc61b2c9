"""What an engine is built from, how a request can end, and the one error it raises.

Plain values only: the Django side (inference/engines.py) builds an EngineConfig from settings,
the bench and the evaluation build their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


class EngineError(RuntimeError):
    """The engine cannot take or finish a request; the message is safe to show to a user."""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "cpu"
    torch_threads: int = 2
    page_size: int = 32
    num_blocks: int = 512
    max_batch_tokens: int = 512
    prefix_sharing: bool = True
    # "owned": Ceiling's decode loop (inference/engine/owned/); "transformers": transformers'
    # ContinuousBatchingManager, also used when the owned loop cannot run the model.
    loop: str = "owned"
    # "varlen": our per-request attention for CPU steps (inference/engine/patches/attention.py); "sdpa": transformers'
    # packed attention, which costs B × (all tokens of the batch) per step.
    attention: str = "varlen"
    # CPU decode steps' linear layers as W·xᵀ where that measures faster at load (inference/engine/patches/linears.py).
    skinny_linear: bool = True
    # "none", "int8", "q4" or "bf16" (inference/engine/patches/quantization.py): how the weights are stored once loaded.
    quantization: str = "none"


def default_device() -> str:
    """CUDA when this machine has a GPU, else the CPU."""
    import torch  # here, not at the top: the web tier reads this module's names without torch

    return "cuda" if torch.cuda.is_available() else "cpu"

