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
(docs/engine.md, "Prefill budget"). The other way round, a busy hour's answer must not be kept as the
machine's: a worker whose first start timed its steps while llama.cpp compiled beside it kept a
32-token prefill budget where a quiet start measures 64 (2-core AMD EPYC, Zen 3, 2026-12-07), and
every restart took it. So `measured` notes how much of the machine other processes (and the
hypervisor) used while it timed (`MachineUse`); a kept answer timed with more than CONTENDED_SHARE
of the machine elsewhere is timed again at the next start, and the quieter of the two is kept.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
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
# Other processes' share of the machine's CPU time above which a timing is not taken as the machine's
# own: a quarter of 2 cores is half a core taken from the 2 threads being timed. A quiet 2-core VM
# with PostgreSQL, Redis and an idle web tier beside the worker measures a few percent.
CONTENDED_SHARE = 0.25


@dataclass
class KeptMeasurements:
    """One engine's view of the kept file: `recall` what this key measured before, `keep` what it measured now.

    `path` None keeps nothing (every load measures: the bench, the evaluations, in-process tests).
    """

    path: Path | None
    key: str = ""
    remeasure: bool = False

    def recall(self, name: str) -> Any | None:
        return self._recall(name)[0]

    def keep(self, name: str, value: Any, others_share: float | None = None) -> None:
        """Keep `value` for the next start; `others_share`: the machine's share that went elsewhere while it was timed."""
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
                shares = entry.setdefault("others_share", {})
                if others_share is None:
                    shares.pop(name, None)
                else:
                    shares[name] = round(others_share, 3)
                entry["measured"] = _now()
                _write(self.path, kept)
        except OSError as exc:  # a read-only var/ costs the next start its timings, nothing more
            log.warning("could not keep the engine's %s measurement in %s: %s", name, self.path, exc)

    def measured(self, name: str, measure: Callable[[], Any]) -> tuple[Any, bool]:
        """(the kept value, True), or (measure() now, False), kept for the next start.

        A kept value timed on a busy machine is timed again; if this start is no quieter, the kept one
        stands (True) and the caller applies it, as it does any kept value.
        """
        kept_value, kept_share = self._recall(name)
        if kept_value is not None and not contended(kept_share):
            return kept_value, True
        with MachineUse() as use:
            value = measure()
        if kept_value is not None and not _quieter(use.others_share, kept_share):
            log.warning("timed the engine's %s again while %s of the machine went to other processes "
                        "(kept: %s); the kept measurement stands", name, _percent(use.others_share), _percent(kept_share))
            return kept_value, True
        if contended(use.others_share):
            log.warning("the engine's %s was timed while %s of the machine went to other processes: the next "
                        "start times it again", name, _percent(use.others_share))
        self.keep(name, value, use.others_share)
        return value, False

    def _recall(self, name: str) -> tuple[Any | None, float | None]:
        """(the kept value or None, the share of the machine that went elsewhere while it was timed, if noted)."""
        if self.path is None or self.remeasure:
            return None, None
        entry = self._entry(self._read())
        share = entry.get("others_share", {}).get(name) if isinstance(entry.get("others_share"), dict) else None
        return entry.get("values", {}).get(name), share if isinstance(share, (int, float)) else None

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


class MachineUse:
    """The share of the machine's CPU time that went to anything but this process while a `with` block
    ran: other processes and the hypervisor's steal, from /proc/stat's busy time less this process's
    own (all its threads). `others_share` stays None where /proc/stat cannot be read."""

    others_share: float | None = None

    def __enter__(self) -> MachineUse:
        self._start = (_machine_busy_s(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *_: object) -> None:
        busy, own, wall = _machine_busy_s(), time.process_time(), time.perf_counter()
        busy_before, own_before, wall_before = self._start
        if busy is None or busy_before is None or wall <= wall_before:
            return
        others = max(0.0, (busy - busy_before) - (own - own_before))
        self.others_share = min(1.0, others / ((wall - wall_before) * _machine_cpus()))


def contended(others_share: float | None) -> bool:
    """Whether a timing ran while other processes took enough of the machine to move it (None: not noted)."""
    return others_share is not None and others_share > CONTENDED_SHARE


def _quieter(share: float | None, than: float | None) -> bool:
    return share is not None and (than is None or share < than)


def _percent(share: float | None) -> str:
    return "an unknown share" if share is None else f"{share:.0%}"


def _machine_busy_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy since boot (steal included), or None."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _machine_cpus() -> int:
    """The CPUs /proc/stat counts (the whole machine's, not this process's affinity)."""
    try:
        with open("/proc/stat") as stat:
            count = sum(1 for line in stat if line.startswith("cpu") and line[3:4].isdigit())
    except OSError:
        count = 0
    return count or os.cpu_count() or 1


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
