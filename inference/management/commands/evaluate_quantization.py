"""Full precision vs quantized weights (int8, q4 or bf16) on a feature's own prompts; stores the run and prints it side by side."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from budgets.models import Feature
from inference.engine.evaluate import MAX_NEW_TOKENS, EvaluationError
from inference.engine.patches.quantization import BF16, INT8, Q4, QuantizationError
from inference.evaluations import evaluate_here


class Command(DatabaseCommand):
    help = "Answer the feature's prompt set with the full-precision and the quantized model; store and print the verdict."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--feature", required=True, help="a feature with a prompt set in inference/engine/evaluation/")
        parser.add_argument("--mode", default=INT8, choices=[INT8, Q4, BF16], help="the quantization to evaluate")
        parser.add_argument("--limit", type=int, help="answer only the first N prompts (a partial run approves nothing)")
        parser.add_argument("--json", dest="json_path", help="also write the results as JSON to this path ('-' = stdout)")
        parser.add_argument("--workload", type=int, default=24, help="requests in the mixed throughput workload")
        parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
        parser.add_argument("--concurrency", type=int, default=8, help="prompts in the engine at once while answering")

    def handle(self, *args, feature: str, mode: str, limit: int | None, json_path: str | None, workload: int,
               max_new_tokens: int, concurrency: int, **options) -> None:
        for name, value in (("--limit", limit), ("--workload", workload), ("--max-new-tokens", max_new_tokens),
                            ("--concurrency", concurrency)):
            if value is not None and value < 1:
                raise CommandError(f"{name} must be at least 1")
        target = Feature.objects.filter(name=feature).first()
        if target is None:
            raise CommandError(f"There is no feature named {feature!r}.")
        try:
            row = evaluate_here(target, mode, limit=limit, workload=workload, max_new_tokens=max_new_tokens,
                                concurrency=concurrency, progress=self.stderr.write)
        except (EvaluationError, QuantizationError) as exc:
            raise CommandError(str(exc)) from None
        report = as_report(row)
        self.stdout.write(render_table(report))
        if json_path:
            text = json.dumps(report | {"answers": row.answers}, indent=1, ensure_ascii=False)
            if json_path == "-":
                self.stdout.write(text)
            else:
                Path(json_path).write_text(text)


def as_report(row) -> dict:
    return {
        "evaluation_id": row.pk,
        "feature": row.feature.name,
        "mode": row.mode,
        "torch_threads": torch.get_num_threads(),
        "machine": row.machine,
        "prompts": {"answered": row.answered, "in_set": row.prompt_set_size, "checkable": row.checkable},
        "accuracy_pct": {"none": row.baseline_accuracy, row.mode: row.candidate_accuracy},
        "correct": {"none": row.baseline_correct, row.mode: row.candidate_correct},
        "agreement": row.agreement,
        "tokens_per_s": {"none": row.baseline_tokens_per_s, row.mode: row.candidate_tokens_per_s},
        "workload_requests": row.workload_requests,
        "weights_bytes": {"none": row.baseline_weights_bytes, row.mode: row.candidate_weights_bytes},
        "thresholds": {"max_accuracy_drop_points": row.max_accuracy_drop_points,
                       "min_throughput_gain_pct": row.min_throughput_gain_pct},
        "passed": row.passed,
        "verdict": row.verdict,
    }


def render_table(report: dict) -> str:
    mode = report["mode"]
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in report["weights_bytes"].items()}
    rows = [
        ("", "full precision", mode),
        ("exact-answer accuracy", f"{report['accuracy_pct']['none']:.1f}%", f"{report['accuracy_pct'][mode]:.1f}%"),
        ("correct / checkable", f"{report['correct']['none']}/{report['prompts']['checkable']}",
         f"{report['correct'][mode]}/{report['prompts']['checkable']}"),
        ("output tokens/s (mixed)", f"{report['tokens_per_s']['none']:.1f}", f"{report['tokens_per_s'][mode]:.1f}"),
        ("weights", mib["none"], mib[mode]),
    ]
    lines = [f"{a:<26}{b:>16}{c:>16}" for a, b, c in rows]
    lines.append(f"token agreement: {100 * report['agreement']:.1f}% · prompts: {report['prompts']['answered']} of "
                 f"{report['prompts']['in_set']}")
    lines.append(f"{'PASSED' if report['passed'] else 'FAILED'}: {report['verdict']}")
    lines.append(f"Measured on: {report['machine']}")
    lines.append(f"Stored as evaluation #{report['evaluation_id']}.")
    return "\n".join(lines)
