"""What an engine measures when it loads, kept per machine so that a restart serves within seconds.

Loading an engine times its routes on this machine: the skinny products per row bucket, the 4-bit
route against fp32, the bf16 copy for wide steps, the decode stack against eager steps, and each
compiled decode bucket against an eager one (after a minute a bucket of compiling, on 2 cores).
The q4 variant's timings took ~11 s of an 18 s worker start, the fp32 variant's compile and timing
36 s from inductor's cache and 165 s without it (2-core AMD EPYC, Zen 4, 2026-12-07). Their answers
depend on the CPU, the threads, torch, the model, the variant and the code that is timed, not on the
hour: they are kept in one JSON file (`var/engine-measurements.json`) under a key made of exactly
those, and a start with the same key takes them without timing anything. A key that differs
(another CPU, another torch, an edited kernel or route) measures again. `CEILING_REMEASURE=1`
measures again and replaces what was kept; so does deleting the file.

A kept answer also keeps a busy hour from re-deciding a quiet one's: on a 2-core machine loaded to
5-9 by other processes, a start timed the 4-bit route slower than fp32 at every row count
(docs/engine.md, "Prefill budget").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "engine-measurements.json"
# The code whose speed is measured: an edit to any of these measures again.
_TIMED_CODE = ("patches/linears.py", "patches/quantization.py", "owned/runner.py", "owned/stack.py",
               "owned/compiled.py", "kernels")
_ENGINE_DIR = Path(__file__).resolve().parent


@dataclass
class KeptMeasurements:
    """One engine's view of the kept file: `recall` what this key measured before, `keep` what it measured now.

    `path` None keeps nothing (every load measures: the bench, the evaluations, in-process tests).
    """

    path: Path | None
    key: str = ""
    remeasure: bool = False

    def recall(self, name: str) -> Any | None:
        if self.path is None or self.remeasure:
            return None
        return self._entry(self._read()).get("values", {}).get(name)

    def keep(self, name: str, value: Any) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path):
                kept = self._read()
                entry = self._entry(kept)
                if not entry:
                    entry = kept[self.key] = {"first_measured": _now(), "values": {}}
                entry["values"][name] = value
                entry["measured"] = _now()
                _write(self.path, kept)
        except OSError as exc:  # a read-only var/ costs the next start its timings, nothing more
            log.warning("could not keep the engine's %s measurement in %s: %s", name, self.path, exc)

    def measured(self, name: str, measure: Callable[[], Any]) -> tuple[Any, bool]:
        """(the kept value, True), or (measure() now, kept for the next start; False)."""
        value = self.recall(name)
        if value is not None:
            return value, True
        value = measure()
        self.keep(name, value)
        return value, False

    def _entry(self, kept: dict) -> dict:
        entry = kept.get(self.key)
        return entry if isinstance(entry, dict) and isinstance(entry.get("values"), dict) else {}

    def _read(self) -> dict:
        try:
            kept = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a torn or hand-edited file: measure again and rewrite it
            log.warning("ignoring the kept engine measurements in %s: %s", self.path, exc)
            return {}
        return kept if isinstance(kept, dict) else {}


def kept_measurements(config) -> KeptMeasurements:
    """The kept measurements of engines built from `config` on this machine (config.measurements_file)."""
    if config.measurements_file is None:
        return KeptMeasurements(None)
    return KeptMeasurements(Path(config.measurements_file), measurement_key(config), config.remeasure)


def kept_note(kept: bool) -> str:
    """What a log line of timings adds when they were not timed at this start."""
    return f" (kept from an earlier start on this machine in var/{FILE_NAME}; CEILING_REMEASURE=1 times again)" if kept else ""


def measurement_key(config) -> str:
    """A digest of everything a load-time timing depends on, and nothing it does not (the hour, the port)."""
    import torch

    parts = {
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "threads": config.torch_threads,
        "device": config.device,
        "model": _model_identity(Path(config.model_dir)),
        "quantization": config.quantization,
        "kv_dtype": config.kv_dtype,
        "page_size": config.page_size,
        "num_blocks": config.num_blocks,
        "compile_buckets": list(config.compile_buckets),
        "skinny_linear": config.skinny_linear,
        "q4_wide_bf16": config.q4_wide_bf16,
        "own_kernels": config.own_kernels,
        "code": _code_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cpu_identity() -> str:
    """The CPU's model name, its feature flags and the cores this process may use."""
    name, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name.strip():
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} | {cores} cores | {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def _model_identity(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.suffix == ".json" else str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def _code_identity() -> str:
    digest = hashlib.sha256()
    for name in _TIMED_CODE:
        path = _ENGINE_DIR / name
        for source in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if source.is_file() and source.suffix in (".py", ".cpp", ".h"):
                digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


class _locked:
    """An exclusive lock beside the file: two workers starting at once must not lose each other's entry."""

    def __init__(self, path: Path) -> None:
        self.lock_path = path.with_name(path.name + ".lock")

    def __enter__(self) -> None:
        self.handle = open(self.lock_path, "a")
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def _write(path: Path, kept: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(kept, out, indent=1, sort_keys=True)
    os.replace(temporary, path)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
