"""Which machine a measurement was taken on, in one short line.

An evaluation's throughput verdict holds only where it was measured: bf16 gains on a CPU with bf16
matrix units (AMX, AVX512-BF16) and is emulated without them, q4's own kernels lean on AVX-512
VNNI, and every figure scales with the cores torch uses. So an evaluation keeps this line, and
`choose_variant` trusts only those taken on a machine with the same one.
"""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The instruction sets the variants' speed depends on, as /proc/cpuinfo names them. AMX has several
# flags (amx_tile, amx_bf16, amx_int8); amx_bf16 is the one bf16 steps use.
ISA_FLAGS = {"avx2": "avx2", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx"}


def machine_signature(torch_threads: int, device: str = "cpu") -> str:
    """e.g. "Intel(R) Xeon(R) Processor · 2 threads · avx2 avx512_vnni avx512_bf16 amx"."""
    cpuinfo = CPUINFO.read_text(errors="replace") if CPUINFO.exists() else ""
    return describe(cpuinfo, torch_threads, gpu=_gpu_name(device))


def describe(cpuinfo: str, torch_threads: int, gpu: str = "") -> str:
    """The signature from /proc/cpuinfo's text (empty where there is none, e.g. macOS)."""
    model = _first_value(cpuinfo, "model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(_first_value(cpuinfo, "flags").split())
    isa = " ".join(name for flag, name in ISA_FLAGS.items() if flag in flags) or "no avx2"
    parts = [model, f"{torch_threads} thread{'s' if torch_threads != 1 else ''}", isa]
    if gpu:
        parts.insert(0, gpu)  # on a GPU the card decides the speed; the CPU still feeds it
    return " · ".join(parts)[:200]


def _first_value(cpuinfo: str, key: str) -> str:
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return " ".join(value.split())
    return ""


def _gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch  # here: a CPU-only caller needs no torch to describe its machine

    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else ""
