"""Ceiling's own CPU kernels for decode steps (lowbit.cpp), built on first use.

torch's CPU int4 kernel streamed the 4-bit weights at ~7 GB/s on an Intel Xeon with AMX, a third
of what the memory gives, and wants bf16 activations in its own tile layout; a lone request's
decode step spent most of its time there (docs/engine.md). lowbit.cpp reads the GGUF's Q4_1
blocks as they are, row by row, and multiplies them with the activations quantized to int8 per
32 values (AVX-512 VNNI, as llama.cpp does for Q4_1 × Q8_1), with a plain loop where the CPU lacks
those instructions. It also holds the lm_head's int8 product, and the decode attention that every
fp32 CPU engine's owned loop runs: each decode row's keys and values read where they sit in the
paged KV cache, nothing gathered first.

The library is compiled once per machine, CPU and torch (-march=native; the file name carries a
hash of all of them) into a cache folder, by the first process that needs it (written under a
temporary name and renamed, so processes starting together never load half a file), and loaded
with torch.ops.load_library: the ops are then `torch.ops.ceiling.q4_linear`,
`torch.ops.ceiling.q8_linear` and `torch.ops.ceiling.decode_attention`, with shape functions
registered so torch.compile traces them as opaque calls. Where it cannot be built (no C++ compiler), `load` says why: the q4 variant keeps
torch's kernels, and decode rows gather their keys and values for SDPA.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lowbit.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
Q4_CHUNK_GROUPS = 4  # groups of 32 weights per row of the scales tensor (lowbit.cpp's kChunk)

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "failure": None}


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here; the message says why."""


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"ceiling-kernels-{os.getuid()}"


def load(cache_dir: Path | None = None) -> str | None:
    """Build (once per machine) and load the kernels. Returns None when they are loaded, else why not.

    Idempotent and safe from several threads; a failure is remembered, so a process tries once.
    """
    with _lock:
        if _state["loaded"] or _state["failure"]:
            return _state["failure"]
        try:
            library = build(cache_dir or default_cache_dir())
            torch.ops.load_library(str(library))
            _register_shapes()
            _state["loaded"] = True
        except (KernelBuildError, OSError, RuntimeError) as exc:
            _state["failure"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("Ceiling's low-bit kernels are not available, torch's serve the q4 variant: %s", exc)
        return _state["failure"]


def build(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library for this machine, compiled now if the cache folder lacks it.

    `extra_flags` go after -march=native: the tests build with `-mno-avx512f` or `-mno-avx2` to
    run the instruction-set paths this CPU would not take by itself.
    """
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler (g++ or c++) on the PATH")
    command = _command(compiler, extra_flags)
    target = cache_dir / f"lowbit-{_fingerprint(compiler, command)}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        finished = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S, check=False)
        if finished.returncode != 0:
            raise KernelBuildError(f"{compiler} failed: {finished.stderr.strip()[-800:]}")
        os.replace(partial, target)  # atomic: a process starting now sees the whole file or none
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"compiling took more than {BUILD_TIMEOUT_S} s") from exc
    finally:
        partial.unlink(missing_ok=True)
    return target


def _command(compiler: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *FLAGS, *extra_flags, abi, *includes, str(SOURCE), *libraries, "-lc10", "-ltorch_cpu"]


def _fingerprint(compiler: str, command: list[str]) -> str:
    """What the library depends on: its source, the build command, the compiler, torch and the CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [SOURCE.read_text(), " ".join(command), version, torch.__version__, platform.machine(), _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for): a library built for another CPU is not reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _register_shapes() -> None:
    """Shape functions, so torch.compile can trace a decode step through the ops without running them."""

    @torch.library.register_fake("ceiling::q4_linear")
    def _(x, codes, scales_and_mins):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("ceiling::q8_linear")
    def _(x, codes, scales):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("ceiling::decode_attention")
    def _(q, k_cache, v_cache, slots, lengths):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# --- packing: the layouts lowbit.cpp reads ----------------------------------------------------------


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in/2] uint8, scales_and_mins [out, ⌈groups/4⌉, 8] float16) from 4-bit codes
    [out, groups, 32] (0…15) and each group's scale d and minimum m ([out, groups]): w = d·q + m.

    A group's 16 bytes hold weight j in the low nibble of byte j and weight j+16 in its high nibble
    (the GGUF's Q4_1 order); per 4 groups the scales row holds their 4 d, then their 4 m, zero past
    the last group.
    """
    out_features, groups, _ = codes.shape
    codes = codes.to(torch.uint8)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(out_features, groups * 16).contiguous()
    chunks = -(-groups // Q4_CHUNK_GROUPS)
    padded = torch.zeros(2, out_features, chunks * Q4_CHUNK_GROUPS, dtype=torch.float16)
    padded[0, :, :groups], padded[1, :, :groups] = scales, minima
    scales_and_mins = torch.cat(
        [padded[0].view(out_features, chunks, Q4_CHUNK_GROUPS), padded[1].view(out_features, chunks, Q4_CHUNK_GROUPS)],
        dim=-1,
    ).contiguous()
    return packed, scales_and_mins
