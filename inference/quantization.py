"""Serving the model with quantized weights: int8 linear layers on CPU.

What works with the pinned stack (torch 2.13.0 CPU, transformers 5.24), checked by hand and by
tests/test_quantization.py:

- `torch.ao.quantization.quantize_dynamic` still works on torch 2.13 (it warns that it is
  deprecated in favour of torchao) and the quantized model runs inside transformers'
  ContinuousBatchingManager unchanged: every nn.Linear (attention and MLP projections and the
  lm_head) becomes a dynamically quantized Linear whose weights are int8, one scale per output
  channel; activations are quantized on the fly per batch. The token embedding stays fp32 (it is
  a lookup, not a matmul). We use it rather than torchao so that no extra dependency is pinned;
  torchao 0.18 installs from PyPI for torch 2.13 without CUDA if a later change needs int4.
- On a GPU the installed stack has no int8 path: quantize_dynamic's kernels (fbgemm/qnnpack) are
  CPU only, and neither torchao nor bitsandbytes is installed. A GPU worker serves bf16 and
  refuses "int8" at load with a sentence saying so.
"""

from __future__ import annotations

import warnings

import torch

NONE = "none"
INT8 = "int8"
MODES = (NONE, INT8)


class QuantizationError(RuntimeError):
    """The requested quantization cannot run here; the message says why."""


def check_mode(mode: str, device: str) -> None:
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    if mode == INT8 and not device.startswith("cpu"):
        raise QuantizationError(
            "int8 weights run on CPU only with the installed stack (torch.ao dynamic quantization); "
            f"this engine runs on {device}"
        )


def quantize_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The model with its weights stored as `mode` asks; "none" returns it unchanged."""
    device = str(next(model.parameters()).device)
    check_mode(mode, device)
    if mode == NONE:
        return model
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        # torch 2.13 says torch.ao.quantization is deprecated (for torchao); it still works, and the
        # warning would be printed at every worker start.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization is deprecated.*")
        warnings.filterwarnings("ignore", message=".*are deprecated and will be removed.*")
        quantized = torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear: qconfig}, dtype=torch.qint8, inplace=False
        )
    return quantized.eval()


def weights_memory_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights and buffers, each storage counted once (tied weights share one).

    A dynamically quantized Linear keeps its int8 weight in packed params, which are not
    parameters, so it is read through the module's weight() accessor.
    """
    seen: set[int] = set()
    kept: list[torch.Tensor] = []  # weight() unpacks a fresh tensor: keep it alive so no address is reused
    total = 0

    def count(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is None:
            return
        pointer = tensor.data_ptr()
        if pointer in seen:
            return
        seen.add(pointer)
        kept.append(tensor)
        total += tensor.nelement() * tensor.element_size()
        if tensor.is_quantized and tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            count(tensor.q_per_channel_scales())
            count(tensor.q_per_channel_zero_points())

    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            count(module.weight())
            count(module.bias())
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            count(tensor)
    return total


def mode_of(model: torch.nn.Module) -> str:
    """Which quantization a loaded model carries (read back from its layers, not from a setting)."""
    if any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules()):
        return INT8
    return NONE
