"""int8 weights: they serve through the engine, the evaluation's numbers hold together, and staff can
switch a feature to them only after the latest evaluation passed."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from django.core.management import call_command
from django.test import Client

from budgets.models import AuditEntry, Feature
from inference.actions import do_record_evaluation, switch_refusal
from inference.engine import Engine
from inference.engine.evaluate import compare, is_correct, load_prompts, score
from inference.engine.patches.quantization import BF16, INT8, NONE, mode_of, weights_memory_bytes
from inference.engines import engine_config_from_settings, model_dir, this_machine
from inference.models import QuantizationEvaluation, QuantizationPolicy


def _engine(quantization: str) -> Engine:
    engine = Engine(replace(engine_config_from_settings(model_dir()), num_blocks=64, quantization=quantization))
    engine.load(progress=lambda _: None)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def full_precision():
    engine = _engine(NONE)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def int8():
    engine = _engine(INT8)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def bf16():
    engine = _engine(BF16)
    yield engine
    engine.stop()


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def test_int8_weights_take_under_half_the_memory_and_answer_in_the_engine(full_precision, int8):
    assert mode_of(full_precision.model) == NONE and mode_of(int8.model) == INT8
    assert full_precision.weights_bytes == weights_memory_bytes(full_precision.model)
    # 135M parameters in fp32 ≈ 538 MB; int8 linear layers + the fp32 embedding ≈ 250 MB.
    assert int8.weights_bytes < 0.5 * full_precision.weights_bytes
    answers = compare(full_precision, int8, load_prompts("chat")[:1], workload_requests=1, max_new_tokens=12).answers
    assert answers[0]["candidate_ids"], "the int8 model produced no tokens in the continuous-batching engine"
    stats = int8.stats()
    assert (stats.quantization, stats.weights_bytes) == (INT8, int8.weights_bytes)


def test_bf16_weights_take_half_the_memory_and_answer_in_the_engine(full_precision, bf16):
    assert mode_of(bf16.model) == BF16
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.weights_bytes == full_precision.weights_bytes // 2  # every weight, 2 bytes instead of 4
    run = compare(full_precision, bf16, load_prompts("chat")[:2], workload_requests=2, max_new_tokens=12)
    for answer in run.answers:
        assert answer["candidate_ids"], "the bf16 model produced no tokens in the continuous-batching engine"
        assert answer["candidate"].strip()
    stats = bf16.stats()
    assert (stats.quantization, stats.weights_bytes) == (BF16, bf16.weights_bytes)


def test_an_evaluation_on_a_subset_stores_answers_its_numbers_can_be_recomputed_from(full_precision, int8, chat_feature):
    prompts = load_prompts("chat")
    assert len(prompts) >= 50 and sum(1 for p in prompts if p.get("accept")) >= 50
    run = compare(full_precision, int8, prompts[:4], workload_requests=2, max_new_tokens=16)
    row = do_record_evaluation(chat_feature, INT8, run, prompt_set_size=len(prompts))
    row.refresh_from_db()

    recomputed = score(row.answers)
    assert (recomputed.checkable, recomputed.baseline_correct, recomputed.candidate_correct) == (
        row.checkable, row.baseline_correct, row.candidate_correct)
    assert recomputed.agreement == row.agreement
    correct = sum(is_correct(a["candidate"], a["accept"]) for a in row.answers if a["accept"])
    assert row.candidate_accuracy == round(100 * correct / row.checkable, 2)
    assert row.candidate_weights_bytes < row.baseline_weights_bytes
    assert row.baseline_tokens_per_s > 0 and row.candidate_tokens_per_s > 0
    # 4 of 70 prompts: whatever the scores, a partial run approves nothing.
    assert not row.complete and not row.passed
    assert "4 of 70 prompts" in row.verdict


def test_agreement_is_total_when_both_sides_are_the_same_model(full_precision, chat_feature):
    run = compare(full_precision, full_precision, load_prompts("chat")[:3], workload_requests=1, max_new_tokens=16,
                  concurrency=1)
    assert run.scores.agreement == 1.0
    assert run.scores.baseline_correct == run.scores.candidate_correct
    assert all(a["baseline"] == a["candidate"] for a in run.answers)


def test_the_verdict_follows_the_staff_thresholds_of_the_day(chat_feature):
    policy = QuantizationPolicy.current()
    policy.max_accuracy_drop_points, policy.min_throughput_gain_pct = 2.0, 20.0
    policy.save()
    failed = _evaluation(chat_feature, baseline_correct=50, candidate_correct=47, tokens_per_s=(40.0, 60.0))
    assert not failed.passed and "drop 6.0 points" in failed.verdict
    slow = _evaluation(chat_feature, baseline_correct=50, candidate_correct=50, tokens_per_s=(40.0, 44.0))
    assert not slow.passed and "+10.0%" in slow.verdict
    good = _evaluation(chat_feature, baseline_correct=50, candidate_correct=49, tokens_per_s=(40.0, 60.0))
    assert good.passed and good.min_throughput_gain_pct == 20.0


# --- the switch on the feature page -----------------------------------------------------------------


def test_the_switch_refuses_a_feature_that_was_never_evaluated(staff_client, chat_feature):
    response = staff_client.post(_page(chat_feature), {"form": "quantization", "quantization": INT8}, follow=True)
    assert "Not switched: No int8 evaluation of chat has been run yet" in response.content.decode()
    assert "evaluate_quantization --feature chat" in response.content.decode()
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == NONE
    assert not AuditEntry.objects.filter(field="quantization").exists()


def test_the_switch_refuses_when_the_latest_evaluation_failed_even_if_an_older_one_passed(staff_client, chat_feature):
    _evaluation(chat_feature, baseline_correct=50, candidate_correct=50, tokens_per_s=(40.0, 60.0))
    _evaluation(chat_feature, baseline_correct=50, candidate_correct=40, tokens_per_s=(40.0, 60.0))
    response = staff_client.post(_page(chat_feature), {"form": "quantization", "quantization": INT8}, follow=True)
    page = response.content.decode()
    assert "Not switched: The latest int8 evaluation of chat" in page and "too much lost" in page
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == NONE


def test_the_feature_page_offers_each_variant_with_its_own_evaluation(staff_client, chat_feature):
    _evaluation(chat_feature, baseline_correct=50, candidate_correct=50, tokens_per_s=(40.0, 60.0))
    page = staff_client.get(_page(chat_feature)).content.decode()
    assert 'id="evaluation-verdict-int8">passed' in page
    assert "No bf16 evaluation yet" in page and "evaluate_quantization --feature chat --mode bf16" in page
    assert "Serve with int8 weights" in page and "Serve with bf16 weights" in page
    response = staff_client.post(_page(chat_feature), {"form": "quantization", "quantization": BF16}, follow=True)
    assert "Not switched: No bf16 evaluation of chat has been run yet" in response.content.decode()
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == NONE


def test_the_switch_refuses_a_partial_evaluation(chat_feature):
    _evaluation(chat_feature, baseline_correct=5, candidate_correct=5, tokens_per_s=(40.0, 60.0), answered=5)
    assert "answered only 5 of 60 prompts" in switch_refusal(chat_feature, INT8)


def test_after_a_passing_evaluation_staff_switch_and_the_change_is_audited(staff_client, staff, chat_feature):
    _evaluation(chat_feature, baseline_correct=50, candidate_correct=50, tokens_per_s=(40.0, 60.0))
    page = staff_client.get(_page(chat_feature)).content.decode()
    assert 'id="evaluation-verdict-int8">passed' in page and "60.0" in page

    response = staff_client.post(_page(chat_feature), {"form": "quantization", "quantization": INT8}, follow=True)
    assert "chat is now served with int8 weights." in response.content.decode()
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == INT8
    entry = AuditEntry.objects.get(field="quantization")
    assert (entry.actor, entry.target, entry.before, entry.after) == (staff, "feature chat", "none", "int8")

    staff_client.post(_page(chat_feature), {"form": "quantization", "quantization": NONE})
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == NONE  # going back never needs an evaluation


# --- through the whole stack: tests/test_variant_workers.py (a feature switched to int8 is answered by
# the int8 worker, on the int8 queue) ------------------------------------------------------------------


# --- helpers -----------------------------------------------------------------------------------------


def _page(feature: Feature) -> str:
    return f"/staff/features/{feature.pk}/"


def _evaluation(feature: Feature, *, baseline_correct: int, candidate_correct: int, tokens_per_s: tuple[float, float],
                answered: int = 60) -> QuantizationEvaluation:
    """A stored evaluation with these outcomes (the verdict is decided by do_record_evaluation, as for a real run)."""
    from inference.engine.evaluate import Run, Scores

    answers = [{"id": f"p{i}", "prompt": "", "accept": [], "baseline": "", "candidate": "", "baseline_ids": [],
                "candidate_ids": []} for i in range(answered)]
    run = Run(
        answers=answers,
        scores=Scores(checkable=min(answered, 50), baseline_correct=baseline_correct,
                      candidate_correct=candidate_correct, agreement=0.9),
        baseline_tokens_per_s=tokens_per_s[0],
        candidate_tokens_per_s=tokens_per_s[1],
        workload_requests=24,
        baseline_weights_bytes=538_000_000,
        candidate_weights_bytes=251_000_000,
    )
    return do_record_evaluation(feature, INT8, run, prompt_set_size=60)


def test_the_evaluation_command_measures_one_engine_at_a_time(chat_feature):
    # An idle engine keeps its OpenMP team, and two teams on 2 cores slowed both variants ~1.6× (docs):
    # the full-precision engine is measured and stopped before the candidate is loaded.
    from inference.models import QuantizationEvaluation

    printed, log = io.StringIO(), io.StringIO()
    call_command("evaluate_quantization", "--feature", "chat", "--mode", "bf16", "--limit", "2", "--workload", "2",
                 "--max-new-tokens", "8", stdout=printed, stderr=log)
    progress = log.getvalue()
    baseline_measured = progress.index("Measuring the none model's tokens/s")
    assert progress.index("(bf16, weights") > baseline_measured
    assert progress.index("Measuring the bf16 model's tokens/s") > baseline_measured
    row = QuantizationEvaluation.latest_for(chat_feature, "bf16")
    assert row.answered == 2 and not row.complete  # a --limit run is stored but approves nothing
    assert row.machine == this_machine()  # choose_variant trusts only evaluations measured where it runs
    assert row.baseline_tokens_per_s > 0 and row.candidate_tokens_per_s > 0
    assert "full precision" in printed.getvalue() and "bf16" in printed.getvalue()
