"""`manage.py bench_prefix [--requests N] [--json PATH]`: time to first token with prefix sharing on and off."""

from __future__ import annotations

import json as jsonlib
from dataclasses import asdict
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from inference.engine.bench.prefix import prefix_sharing
from inference.engines import model_dir


class Command(BaseCommand):
    help = "Requests sharing a long system prompt, one after another: TTFT with KV block sharing on, then off."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--requests", type=int, default=8)
        parser.add_argument("--json", type=Path, help="also write the result as JSON here")

    def handle(self, *args, requests: int, json: Path | None = None, **options) -> None:
        if requests < 2:
            raise CommandError("--requests must be at least 2 (the first request fills the cache)")
        if json is not None and not json.parent.exists():
            raise CommandError(f"{json.parent} does not exist")
        result = prefix_sharing(model_dir(progress=self.stdout.write), requests, progress=self.stdout.write)
        self.stdout.write(
            f"{result.requests} requests of ~{result.prompt_tokens} tokens sharing {result.shared_prefix_tokens}: "
            f"TTFT p50 {result.ttft_p50_ms_on:.0f} ms with sharing, {result.ttft_p50_ms_off:.0f} ms without "
            f"({result.speedup:.1f}x)"
        )
        if json is not None:
            json.write_text(_dumps({**asdict(result), "speedup": round(result.speedup, 2)}))


def _dumps(data: dict) -> str:
    return jsonlib.dumps(data, indent=2)
