"""Serve a feature with the fastest weight variant that passed its evaluation on this machine; print why."""

from __future__ import annotations

from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from budgets.models import Feature, Provider
from inference.actions import SwitchRefused, do_switch_quantization
from inference.engine.evaluate import EvaluationError
from inference.engine.patches.quantization import QuantizationError
from inference.engines import this_machine
from inference.evaluations import (
    CANDIDATES,
    VariantChoice,
    choose_variant,
    evaluate_here,
    needs_evaluation,
    parse_modes,
)
from inference.models import QuantizationEvaluation


class Command(DatabaseCommand):
    help = ("Switch a feature to the fastest weight variant whose latest evaluation on this machine passed "
            "(through the gate, audited), or say why it keeps its own; prints every candidate.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--feature", required=True, help="the feature to choose weights for")
        parser.add_argument("--modes", default=",".join(CANDIDATES),
                            help=f"the variants to choose from, comma-separated (default: {','.join(CANDIDATES)})")
        parser.add_argument("--evaluate", action="store_true",
                            help="first evaluate, on the whole prompt set, each variant with no complete evaluation on "
                                 "this machine (minutes each)")
        parser.add_argument("--dry-run", action="store_true", help="print the choice without switching")

    def handle(self, *args, feature: str, modes: str, evaluate: bool, dry_run: bool, **options) -> None:
        try:
            candidates = parse_modes(modes)
        except ValueError as exc:
            raise CommandError(f"--modes: {exc}") from None
        target = _local_feature(feature)
        machine = this_machine()
        if evaluate:
            self._evaluate_missing(target, candidates, machine)
        choice = choose_variant(target, candidates, machine)
        self.stdout.write(render_choice(choice))
        self.stdout.write(self._carry_out(choice, dry_run))

    def _evaluate_missing(self, feature: Feature, modes: tuple[str, ...], machine: str) -> None:
        for mode in modes:
            if not needs_evaluation(QuantizationEvaluation.latest_for(feature, mode, machine)):
                continue
            self.stderr.write(f"Evaluating {mode} on {feature.name}: no complete evaluation on this machine yet…")
            try:
                evaluate_here(feature, mode, progress=self.stderr.write)
            except (EvaluationError, QuantizationError) as exc:
                raise CommandError(f"The {mode} evaluation of {feature.name} failed: {exc}") from None

    def _carry_out(self, choice: VariantChoice, dry_run: bool) -> str:
        """The closing sentence, after the switch (audited, through the gate) unless it is a dry run."""
        feature = choice.feature
        if not choice.switches:
            if choice.chosen:
                return f"{feature.name} is already served with {choice.chosen} weights; nothing to switch. {choice.reason}"
            return choice.reason
        before = feature.get_quantization_display()
        if dry_run:
            return f"Dry run: would switch {feature.name} from {before} to {choice.chosen}; nothing was switched. {choice.reason}"
        try:
            do_switch_quantization(None, feature, choice.chosen)
        except SwitchRefused as exc:  # an evaluation stored meanwhile changed the gate's mind
            raise CommandError(f"Not switched: {exc}") from None
        return f"Switched {feature.name} from {before} to {choice.chosen} (recorded in the audit log). {choice.reason}"


def _local_feature(name: str) -> Feature:
    feature = Feature.objects.select_related("provider").filter(name=name).first()
    if feature is None:
        raise CommandError(f"There is no feature named {name!r}.")
    if feature.provider is not None and feature.provider.kind == Provider.Kind.OPENAI_COMPATIBLE:
        raise CommandError(f"{name} streams from the remote server {feature.provider.name}; its weights are "
                           f"not chosen here (only features served by the local engine have variants).")
    return feature


def render_choice(choice: VariantChoice) -> str:
    """Every candidate with its numbers and verdict on this machine, each one's reason under it."""
    lines = [f"Machine: {choice.machine}",
             f"{choice.feature.name} is served with {choice.feature.get_quantization_display()} now.", "",
             f"{'variant':<9}{'evaluated':<18}{'accuracy (fp32 → it)':<24}{'tokens/s (fp32 → it)':<24}verdict"]
    for candidate in choice.candidates:
        row = candidate.evaluation
        if row is None:
            lines.append(f"{candidate.mode:<9}{'never here':<18}{'':<24}{'':<24}-")
        else:
            verdict = "passed" if candidate.eligible else ("partial" if not row.complete else
                                                           "failed" if not row.passed else "refused")
            lines.append(f"{candidate.mode:<9}{row.created_at:%Y-%m-%d %H:%M}  "
                         f"{f'{row.baseline_accuracy:.1f}% → {row.candidate_accuracy:.1f}%':<24}"
                         f"{f'{row.baseline_tokens_per_s:.1f} → {row.candidate_tokens_per_s:.1f}':<24}{verdict}")
        lines.append(f"    {candidate.why}")
    lines.append("")
    return "\n".join(lines)
