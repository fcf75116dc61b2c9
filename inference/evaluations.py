"""The quantization evaluations of this machine: run one here, and choose a feature's variant from them.

`evaluate_quantization` runs one evaluation (evaluate_here); `choose_variant` reads the latest
evaluation of each candidate variant measured on this machine and picks the fastest that passed
(choose_variant, a read-only decision the command then carries out through do_switch_quantization,
so the gate is enforced and the switch audited). Evaluations from other machines are ignored: a
variant's speed depends on the CPU's instruction sets and the threads torch uses there
(inference/engine/machine.py). Only the management commands import this module (it loads torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from budgets.models import Feature

from .actions import do_record_evaluation, switch_refusal
from .engine import Engine
from .engine.evaluate import MAX_NEW_TOKENS, combine, load_prompts, mixed_workload, run_variant
from .engine.patches.quantization import NONE
from .engines import engine_config_from_settings, model_dir
from .models import QuantizationEvaluation

CANDIDATES = ("q4", "bf16", "int8")  # every quantized variant; full precision needs no evaluation


# --- running an evaluation ------------------------------------------------------------------------


def evaluate_here(
    feature: Feature, mode: str, *, limit: int | None = None, workload: int = 24, max_new_tokens: int = MAX_NEW_TOKENS,
    concurrency: int = 8, progress: Callable[[str], object] = print,
) -> QuantizationEvaluation:
    """Full precision, then `mode`, on the feature's prompt set and mixed workload; stored with this machine.

    Raises EvaluationError (no prompt set, an engine failed a prompt) or QuantizationError (the
    variant cannot load here).
    """
    prompts = load_prompts(feature.name)
    chosen = prompts[:limit] if limit else prompts
    requests = mixed_workload(chosen, workload, seed=0)
    runs = []
    for variant in (NONE, mode):
        # One engine at a time: an idle engine's OpenMP team would slow the other's (evaluate.compare).
        engine = _started_engine(variant, progress)
        try:
            runs.append(run_variant(engine, chosen, requests, max_new_tokens=max_new_tokens,
                                    concurrency=concurrency, progress=progress))
        finally:
            engine.stop()
    run = combine(chosen, *runs, workload_requests=workload)
    return do_record_evaluation(feature, mode, run, prompt_set_size=len(prompts))


def _started_engine(variant: str, progress: Callable[[str], object]) -> Engine:
    engine = Engine(engine_config_from_settings(model_dir(progress=progress), quantization=variant))
    engine.load(progress=progress)
    engine.start()
    return engine


# --- choosing a variant from them -----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One variant as this machine's latest evaluation of it judged it."""

    mode: str
    evaluation: QuantizationEvaluation | None  # the latest measured on this machine
    eligible: bool  # passed here on the whole prompt set, and the gate allows the switch
    why: str


@dataclass(frozen=True)
class VariantChoice:
    """What choose_variant decided for a feature on one machine, with the reasons to print."""

    feature: Feature
    machine: str
    current: str  # the variant the feature is served with now
    candidates: tuple[Candidate, ...]
    chosen: str | None  # the variant to serve with; None keeps the current one
    reason: str  # a sentence: why this variant, or why the feature keeps its own

    @property
    def switches(self) -> bool:
        return self.chosen is not None and self.chosen != self.current


def parse_modes(text: str) -> tuple[str, ...]:
    """"q4,bf16" → ("q4", "bf16"); ValueError with a sentence for anything else."""
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes:
        raise ValueError(f"name at least one variant to choose from: {', '.join(CANDIDATES)}.")
    if NONE in modes:
        raise ValueError(f"'none' is full precision, the variant kept when nothing passes; name quantized "
                         f"variants only: {', '.join(CANDIDATES)}.")
    unknown = [m for m in modes if m not in CANDIDATES]
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} is not a weight variant; choose from {', '.join(CANDIDATES)}.")
    return modes


def needs_evaluation(evaluation: QuantizationEvaluation | None) -> bool:
    """No evaluation here that could approve a switch: none at all, or only a partial (--limit) run."""
    return evaluation is None or not evaluation.complete


def choose_variant(feature: Feature, modes: Sequence[str], machine: str) -> VariantChoice:
    """The qualifying variant with the highest candidate tokens/s among `modes`, judged by each one's
    latest evaluation on `machine` (and the gate); None (keep the feature as it is) when none qualifies."""
    candidates = tuple(_judge(feature, mode, QuantizationEvaluation.latest_for(feature, mode, machine))
                       for mode in modes)
    eligible = sorted((c for c in candidates if c.eligible), key=lambda c: -c.evaluation.candidate_tokens_per_s)
    chosen = eligible[0] if eligible else None
    reason = _why_chosen(feature, chosen, eligible[1:]) if chosen else _why_kept(feature, candidates)
    return VariantChoice(feature=feature, machine=machine, current=feature.quantization, candidates=candidates,
                         chosen=chosen.mode if chosen else None, reason=reason)


def _judge(feature: Feature, mode: str, latest: QuantizationEvaluation | None) -> Candidate:
    if latest is None:
        return Candidate(mode, None, False, f"no evaluation on this machine: run `{_evaluate_command(feature, mode)}`.")
    when = f"{latest.created_at:%Y-%m-%d %H:%M}"
    if not latest.complete:
        return Candidate(mode, latest, False, f"the latest here ({when}) answered only {latest.answered} of "
                                              f"{latest.prompt_set_size} prompts, and a partial run approves nothing.")
    if not latest.passed:
        return Candidate(mode, latest, False, f"failed here ({when}). {latest.verdict}")
    # The gate reads the latest evaluation from any machine: a newer failure elsewhere still blocks it.
    refusal = switch_refusal(feature, mode)
    if refusal:
        return Candidate(mode, latest, False, f"passed here ({when}), but the gate refuses the switch: {refusal}")
    return Candidate(mode, latest, True, f"passed here ({when}). {latest.verdict}")


def _why_chosen(feature: Feature, chosen: Candidate, slower: list[Candidate]) -> str:
    evaluation = chosen.evaluation
    sentence = (f"{chosen.mode} is the fastest variant that passed its evaluation of {feature.name} on this machine: "
                f"{evaluation.candidate_tokens_per_s:.1f} tokens/s against {evaluation.baseline_tokens_per_s:.1f} in "
                f"full precision, accuracy {evaluation.baseline_accuracy:.1f}% → {evaluation.candidate_accuracy:.1f}%")
    if slower:
        sentence += "; also passed but slower: " + ", ".join(
            f"{c.mode} ({c.evaluation.candidate_tokens_per_s:.1f} tokens/s)" for c in slower)
    return sentence + "."


def _why_kept(feature: Feature, candidates: tuple[Candidate, ...]) -> str:
    keeps = f"{feature.name} keeps {feature.get_quantization_display()}"
    missing = [c.mode for c in candidates if needs_evaluation(c.evaluation)]
    judged = [c.mode for c in candidates if c.mode not in missing]
    command = f"python manage.py choose_variant --feature {feature.name} --modes {','.join(missing)} --evaluate"
    if not judged:
        return (f"No complete evaluation of {', '.join(missing)} on {feature.name} was measured on this machine, so "
                f"{keeps}: run `{command}` to evaluate them here and choose.")
    # "qualified", not "passed": a variant may have passed here and still be refused by the gate.
    if len(judged) == 1:
        sentence = f"{judged[0]} did not qualify on this machine (the reason is above), so {keeps}."
    else:
        sentence = f"None of {', '.join(judged)} qualified on this machine (each one's reason is above), so {keeps}."
    if missing:
        sentence += f" {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no complete evaluation here: run `{command}`."
    return sentence


def _evaluate_command(feature: Feature, mode: str) -> str:
    return f"python manage.py evaluate_quantization --feature {feature.name} --mode {mode}"
