"""`manage.py bench_positions`: a lone request's time per token at several context positions, per KV cache dtype."""

from __future__ import annotations

import json as jsonlib
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.engine.bench.positions import DEFAULT_POSITIONS, PositionsError, measure_positions
from inference.engine.config import KV_DTYPE_NAMES
from inference.engine.patches.quantization import MODES
from inference.engines import model_dir

MAX_POSITION = 8000  # the rotary table and the default cache (512 blocks of 32) hold more; a prompt this long takes a while


class Command(BaseCommand):
    help = ("A lone request's ms per output token after prompts of several lengths, for each KV cache dtype, "
            "in alternating rounds (docs/benchmarks.md).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--positions", default=",".join(map(str, DEFAULT_POSITIONS)),
                            help="comma-separated context lengths (default %(default)s)")
        parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPE_NAMES),
                            help="comma-separated, of float32, float16 and int8 (default all three)")
        parser.add_argument("--tokens", type=int, default=32, help="output tokens timed per request")
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument("--quantization", choices=MODES, default="q4")
        parser.add_argument("--threads", type=int, default=settings.CEILING_TORCH_THREADS)
        parser.add_argument("--json", type=Path, help="also write the result as JSON here")

    def handle(self, *args, **options) -> None:
        positions = self._numbers(options["positions"])
        kv_dtypes = [name.strip() for name in options["kv_dtypes"].split(",") if name.strip()]
        unknown = sorted(set(kv_dtypes) - set(KV_DTYPE_NAMES))
        if unknown or not kv_dtypes:
            raise CommandError(f"unknown KV dtype(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(KV_DTYPE_NAMES)}")
        if options["tokens"] < 2 or options["rounds"] < 1:
            raise CommandError("--tokens must be at least 2 and --rounds at least 1")
        json_path = options["json"]
        if json_path is not None and not json_path.parent.exists():
            raise CommandError(f"{json_path.parent} does not exist")
        engine_options = {
            "quantization": options["quantization"],
            # Nothing compiled: the q4 stack or eager steps serve alike for each dtype, and a compile
            # would cost minutes per engine on 2 cores.
            "compile_buckets": (),
            "own_kernels": settings.CEILING_OWN_KERNELS,
            "kernel_cache_dir": Path(settings.VAR_DIR) / "kernels",
            "q4_wide_bf16": settings.CEILING_Q4_WIDE_BF16,
        }
        try:
            runs = measure_positions(model_dir(progress=self.stdout.write), kv_dtypes, positions, options["tokens"],
                                     options["rounds"], options["threads"], engine_options, progress=self.stdout.write)
        except PositionsError as exc:
            raise CommandError(str(exc)) from exc
        for run in runs:
            medians, ratios = run.medians(), run.ratios()
            figures = ", ".join(f"{p}: {medians[p]:.2f} ms ({ratios[p]:.2f}x)" for p in positions)
            self.stdout.write(f"{run.kv_dtype} cache, median of {options['rounds']}: {figures}")
            self.stdout.write(f"  decode steps: {run.decode_path}; dropped to one thread {run.thread_backoffs} time(s)")
        if json_path is not None:
            result = {"quantization": options["quantization"], "threads": options["threads"], "tokens": options["tokens"],
                      "rounds": options["rounds"], "runs": [run.as_dict() for run in runs]}
            json_path.write_text(jsonlib.dumps(result, indent=2))
            self.stdout.write(f"JSON: {json_path}")

    @staticmethod
    def _numbers(raw: str) -> tuple[int, ...]:
        try:
            numbers = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
        except ValueError:
            raise CommandError(f"--positions takes comma-separated whole numbers, not {raw!r}") from None
        if not numbers or numbers[0] < 0 or numbers[-1] > MAX_POSITION:
            raise CommandError(f"--positions must name positions from 0 to {MAX_POSITION}")
        return numbers
