"""Does a quantized model still do the feature's job? Full precision and quantized, side by side.

Both models answer the feature's prompt set (inference/engine/evaluation/<feature>.json) greedily through
the real engine, then run the same mixed workload for output tokens/s. Scores:

- exact-answer accuracy: a checkable prompt is right when its answer matches one of its accepted
  regular expressions (case-insensitive);
- agreement: over all prompts, the greedy tokens the two answers share before they first differ,
  divided by the tokens of the longer answer (1.0 when the outputs are identical);
- verdict: the staff's QuantizationPolicy (accuracy drop at most N points, throughput gain at
  least P%), recorded with the run.

Everything needed to recompute the scores (prompts, accepted answers, both answers' token ids) is
stored with the evaluation row.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inference.engine import Engine

PROMPT_SETS = Path(__file__).resolve().parent / "evaluation"
MAX_NEW_TOKENS = 48
# The mixed workload: answers of very different lengths arriving together, as in the bench.
WORKLOAD_LENGTHS = (8, 16, 32, 64, 128)
ANSWER_TIMEOUT_S = 120.0


class EvaluationError(RuntimeError):
    pass


# --- the prompt set ------------------------------------------------------------------------------


def load_prompts(feature_name: str) -> list[dict]:
    path = PROMPT_SETS / f"{feature_name}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROMPT_SETS.glob("*.json")))
        raise EvaluationError(f"no prompt set for the feature {feature_name!r} (shipped: {shipped})")
    return json.loads(path.read_text())["prompts"]


# --- scores (read-only, recomputable from stored answers) -----------------------------------------


def is_correct(answer: str, accept: Sequence[str]) -> bool:
    return any(re.search(pattern, answer, re.IGNORECASE) for pattern in accept)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared


@dataclass(frozen=True)
class Scores:
    checkable: int
    baseline_correct: int
    candidate_correct: int
    agreement: float


def score(answers: Sequence[dict]) -> Scores:
    """Accuracy counts and agreement from stored answers (what the evaluation row keeps)."""
    checkable = [a for a in answers if a.get("accept")]
    shared = sum(common_prefix(a["baseline_ids"], a["candidate_ids"]) for a in answers)
    longest = sum(max(len(a["baseline_ids"]), len(a["candidate_ids"])) for a in answers)
    return Scores(
        checkable=len(checkable),
        baseline_correct=sum(is_correct(a["baseline"], a["accept"]) for a in checkable),
        candidate_correct=sum(is_correct(a["candidate"], a["accept"]) for a in checkable),
        agreement=round(shared / longest, 4) if longest else 1.0,
    )


def verdict(
    baseline_accuracy: float, candidate_accuracy: float, baseline_tps: float, candidate_tps: float,
    max_drop_points: float, min_gain_pct: float,
) -> tuple[bool, str]:
    """Pass or fail against the staff's thresholds, with sentences a person can check."""
    drop = round(baseline_accuracy - candidate_accuracy, 2)
    gain = round(100.0 * (candidate_tps / baseline_tps - 1.0), 1) if baseline_tps else 0.0
    accuracy_ok = drop <= max_drop_points
    speed_ok = gain >= min_gain_pct
    sentences = [
        f"Accuracy {baseline_accuracy:.1f}% → {candidate_accuracy:.1f}% (drop {drop:.1f} points; at most "
        f"{max_drop_points:g} allowed): {'ok' if accuracy_ok else 'too much lost'}.",
        f"Throughput {baseline_tps:.1f} → {candidate_tps:.1f} tokens/s ({gain:+.1f}%; at least "
        f"+{min_gain_pct:g}% required): {'ok' if speed_ok else 'not enough gained'}.",
    ]
    return accuracy_ok and speed_ok, " ".join(sentences)


# --- running the models -----------------------------------------------------------------------------


def answer_prompts(engine: Engine, prompts: Sequence[dict], *, max_new_tokens: int, concurrency: int) -> list[list[int]]:
    """Greedy answers (token ids, EOS dropped), at most `concurrency` requests in the engine at once."""
    results: list[list[int]] = []
    eos = set(engine.eos_ids_list())
    for start in range(0, len(prompts), concurrency):
        chunk = prompts[start : start + concurrency]
        handles = [
            engine.submit(f"eval-{start + i}", engine.encode_chat([{"role": "user", "content": p["prompt"]}]), max_new_tokens)
            for i, p in enumerate(chunk)
        ]
        for handle in handles:
            _drain(handle)
            results.append([t for t in handle.tokens if t not in eos])
    return results


def _drain(handle) -> None:
    for event in handle.events(timeout=ANSWER_TIMEOUT_S):
        if event.finished and event.error:
            raise EvaluationError(f"the engine failed a prompt: {event.error}")


def mixed_workload(prompts: Sequence[dict], n: int, seed: int) -> list[tuple[str, int]]:
    """n (prompt, answer length) pairs: prompts of the set with lengths from WORKLOAD_LENGTHS, reproducible."""
    rng = random.Random(seed)
    return [(rng.choice(prompts)["prompt"], rng.choice(WORKLOAD_LENGTHS)) for _ in range(n)]


def tokens_per_s(engine: Engine, workload: Sequence[tuple[str, int]]) -> float:
    """Output tokens/s with the whole workload submitted at once, EOS ignored so every length is exact."""
    warm = engine.submit("warmup", engine.encode_chat([{"role": "user", "content": "Hi"}]), 4, ignore_eos=True)
    _drain(warm)
    started = time.monotonic()
    handles = [
        engine.submit(f"bench-{i}", engine.encode_chat([{"role": "user", "content": text}]), length, ignore_eos=True)
        for i, (text, length) in enumerate(workload)
    ]
    for handle in handles:
        _drain(handle)
    elapsed = time.monotonic() - started
    return round(sum(len(h.tokens) for h in handles) / elapsed, 2)


@dataclass
class Run:
    """What one evaluation measured, before it is stored."""

    answers: list[dict]
    scores: Scores
    baseline_tokens_per_s: float
    candidate_tokens_per_s: float
    workload_requests: int
    baseline_weights_bytes: int
    candidate_weights_bytes: int


@dataclass
class VariantRun:
    """One variant's answers and throughput, measured while it was the only engine computing."""

    answer_ids: list[list[int]]
    answer_texts: list[str]
    tokens_per_s: float
    weights_bytes: int


def run_variant(
    engine: Engine, prompts: Sequence[dict], workload: Sequence[tuple[str, int]], *,
    max_new_tokens: int = MAX_NEW_TOKENS, concurrency: int = 8, progress=print,
) -> VariantRun:
    progress(f"Answering {len(prompts)} prompts with the {engine.config.quantization} model…")
    ids = answer_prompts(engine, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency)
    progress(f"Measuring the {engine.config.quantization} model's tokens/s on a mixed workload of {len(workload)} requests…")
    return VariantRun(
        answer_ids=ids,
        answer_texts=[engine.tokenizer.decode(i, skip_special_tokens=True) for i in ids],
        tokens_per_s=tokens_per_s(engine, workload),
        weights_bytes=engine.weights_bytes,
    )


def combine(prompts: Sequence[dict], baseline: VariantRun, candidate: VariantRun, workload_requests: int) -> Run:
    answers = [
        {
            "id": prompt["id"],
            "prompt": prompt["prompt"],
            "accept": prompt.get("accept", []),
            "baseline": b_text,
            "candidate": c_text,
            "baseline_ids": b,
            "candidate_ids": c,
        }
        for prompt, b, c, b_text, c_text in zip(
            prompts, baseline.answer_ids, candidate.answer_ids, baseline.answer_texts, candidate.answer_texts, strict=True
        )
    ]
    return Run(
        answers=answers,
        scores=score(answers),
        baseline_tokens_per_s=baseline.tokens_per_s,
        candidate_tokens_per_s=candidate.tokens_per_s,
        workload_requests=workload_requests,
        baseline_weights_bytes=baseline.weights_bytes,
        candidate_weights_bytes=candidate.weights_bytes,
    )


def compare(
    baseline: Engine, candidate: Engine, prompts: Sequence[dict], *, workload_requests: int = 24, seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS, concurrency: int = 8, progress=print,
) -> Run:
    """Both variants on the same prompts and workload, with both engines already running.

    manage.py evaluate_quantization runs one engine at a time instead (run_variant, then combine):
    an idle engine keeps its OpenMP team, and two teams on 2 cores throttle each other's barriers,
    which made both variants' throughput ~1.6× slower there (measured on a 2-core VM with both engines in one process) and the comparison unfair.
    """
    workload = mixed_workload(prompts, workload_requests, seed)
    options = dict(max_new_tokens=max_new_tokens, concurrency=concurrency, progress=progress)
    return combine(
        prompts, run_variant(baseline, prompts, workload, **options), run_variant(candidate, prompts, workload, **options),
        workload_requests,
    )
