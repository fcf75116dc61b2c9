"""choose_variant: a feature's weights are chosen from the evaluations measured on this machine, by the
gate that already exists (do_switch_quantization), audited, and always with the reason printed."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from budgets.models import AuditEntry, Feature, Provider
from inference.actions import do_record_evaluation
from inference.engine.evaluate import Run, Scores
from inference.engine.machine import describe
from inference.engines import this_machine
from inference.evaluations import choose_variant
from inference.models import QuantizationEvaluation

ELSEWHERE = "AMD EPYC 7B13 · 2 threads · avx2"
PROMPTS = 60


# --- choosing ----------------------------------------------------------------------------------------


def test_it_switches_to_the_fastest_variant_that_passed_here(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=125.6)
    _evaluation(chat_feature, "bf16", tokens_per_s=131.3)
    _evaluation(chat_feature, "int8", tokens_per_s=160.0, candidate_correct=40)  # fastest, but lost answers

    printed = _choose("--feature", "chat")

    chat_feature.refresh_from_db()
    assert chat_feature.quantization == "bf16"
    assert "Switched chat from full precision to bf16 (recorded in the audit log)." in printed
    assert "bf16 is the fastest variant that passed its evaluation of chat on this machine: 131.3 tokens/s" in printed
    assert "also passed but slower: q4 (125.6 tokens/s)" in printed
    assert "too much lost" in printed  # int8's reason, under its row
    for mode, verdict in (("q4", "passed"), ("bf16", "passed"), ("int8", "failed")):
        assert _row(printed, mode).endswith(verdict)
    assert f"Machine: {this_machine()}" in printed


def test_it_ignores_evaluations_from_another_machine(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=300.0, machine=ELSEWHERE)  # passed there, never run here
    _evaluation(chat_feature, "bf16", tokens_per_s=131.3)

    choice = choose_variant(chat_feature, ["q4", "bf16"], this_machine())

    assert choice.chosen == "bf16"
    q4 = choice.candidates[0]
    assert q4.evaluation is None and not q4.eligible
    assert "no evaluation on this machine: run `python manage.py evaluate_quantization --feature chat --mode q4`" in q4.why


def test_a_failed_or_partial_latest_evaluation_is_not_chosen_even_after_a_pass(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=150.0)
    _evaluation(chat_feature, "q4", tokens_per_s=150.0, candidate_correct=40)  # the latest q4: failed
    _evaluation(chat_feature, "bf16", tokens_per_s=140.0)
    _evaluation(chat_feature, "bf16", tokens_per_s=140.0, answered=5)  # the latest bf16: a --limit run
    _evaluation(chat_feature, "int8", tokens_per_s=121.0)  # the slowest, yet the only one passing

    choice = choose_variant(chat_feature, ["q4", "bf16", "int8"], this_machine())

    assert choice.chosen == "int8" and choice.switches
    q4, bf16, _ = choice.candidates
    assert not q4.eligible and q4.why.startswith("failed here") and "too much lost" in q4.why
    assert not bf16.eligible and "answered only 5 of 60 prompts" in bf16.why
    printed = _choose("--feature", "chat", "--dry-run")
    assert _row(printed, "q4").endswith("failed") and _row(printed, "bf16").endswith("partial")


def test_a_newer_failure_on_another_machine_keeps_the_gate_closed(chat_feature):
    # The gate on the feature page judges a variant by its latest evaluation from anywhere; the
    # command goes through it and says so rather than switching around it.
    _evaluation(chat_feature, "bf16", tokens_per_s=131.3)
    _evaluation(chat_feature, "bf16", tokens_per_s=40.0, machine=ELSEWHERE)  # no gain there: failed

    printed = _choose("--feature", "chat", "--modes", "bf16")

    chat_feature.refresh_from_db()
    assert chat_feature.quantization == "none"
    assert _row(printed, "bf16").endswith("refused")
    assert "passed here" in printed and "but the gate refuses the switch: The latest bf16 evaluation of chat" in printed
    assert "chat keeps full precision" in printed


def test_with_nothing_evaluated_here_it_keeps_the_feature_and_names_the_command(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=300.0, machine=ELSEWHERE)

    printed = _choose("--feature", "chat")

    chat_feature.refresh_from_db()
    assert chat_feature.quantization == "none"
    assert "No complete evaluation of q4, bf16, int8 on chat was measured on this machine, so chat keeps full precision" in printed
    assert "run `python manage.py choose_variant --feature chat --modes q4,bf16,int8 --evaluate`" in printed
    assert not AuditEntry.objects.filter(field="quantization").exists()


def test_when_nothing_passed_it_keeps_the_current_variant_and_says_why(chat_feature):
    chat_feature.quantization = "q4"  # switched by hand earlier
    chat_feature.save(update_fields=["quantization"])
    _evaluation(chat_feature, "bf16", tokens_per_s=44.0, baseline_tokens_per_s=40.0)  # +10%: not enough

    printed = _choose("--feature", "chat", "--modes", "bf16,int8")

    chat_feature.refresh_from_db()
    assert chat_feature.quantization == "q4"  # never silently back to anything
    assert "bf16 did not qualify on this machine (the reason is above)" in printed and "so chat keeps 4-bit weights" in printed
    assert "not enough gained" in printed
    assert "int8 has no complete evaluation here: run `python manage.py choose_variant --feature chat --modes int8 --evaluate`" in printed


def test_a_dry_run_prints_the_choice_and_switches_nothing(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=125.6)

    printed = _choose("--feature", "chat", "--dry-run")

    assert "Dry run: would switch chat from full precision to q4; nothing was switched." in printed
    chat_feature.refresh_from_db()
    assert chat_feature.quantization == "none"
    assert not AuditEntry.objects.filter(field="quantization").exists()


def test_the_switch_is_audited_and_a_second_run_changes_nothing(chat_feature):
    _evaluation(chat_feature, "q4", tokens_per_s=125.6)
    _choose("--feature", "chat")

    entry = AuditEntry.objects.get(field="quantization")
    assert (entry.actor, entry.target, entry.before, entry.after) == (None, "feature chat", "none", "q4")

    again = _choose("--feature", "chat")
    assert "chat is already served with q4 weights; nothing to switch." in again
    assert AuditEntry.objects.filter(field="quantization").count() == 1


def test_evaluate_runs_nothing_when_every_variant_has_a_complete_evaluation_here(chat_feature):
    # A real --evaluate answers the whole prompt set twice per variant: minutes on a 2-core machine,
    # too long here. Its evaluation is evaluate_here, the one evaluate_quantization runs, tested with
    # a real run in tests/test_quantization.py (which checks the machine it stores).
    _evaluation(chat_feature, "q4", tokens_per_s=125.6)
    log = io.StringIO()
    printed = _choose("--feature", "chat", "--modes", "q4", "--evaluate", "--dry-run", stderr=log)
    assert "Evaluating" not in log.getvalue()
    assert "would switch chat from full precision to q4" in printed
    assert QuantizationEvaluation.objects.count() == 1


@pytest.mark.parametrize(("modes", "message"), [
    ("fp8", "--modes: 'fp8' is not a weight variant; choose from q4, bf16, int8."),
    ("q4,none", "--modes: 'none' is full precision"),
    (" , ", "--modes: name at least one variant to choose from"),
])
def test_bad_modes_are_refused_with_a_sentence(chat_feature, modes, message):
    with pytest.raises(CommandError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        _choose("--feature", "chat", "--modes", modes)


def test_an_unknown_or_remote_feature_is_refused_with_a_sentence(transactional_db):
    with pytest.raises(CommandError, match="There is no feature named 'nope'."):
        _choose("--feature", "nope")
    remote = Provider.objects.create(name="vllm", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://x.example/v1")
    Feature.objects.create(name="hosted", provider=remote)
    with pytest.raises(CommandError, match="hosted streams from the remote server vllm"):
        _choose("--feature", "hosted")


# --- the machine an evaluation remembers -----------------------------------------------------------


def test_the_machine_names_the_cpu_the_threads_and_the_instruction_sets_that_matter():
    cpuinfo = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
               "flags\t\t: fpu sse avx avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8\n"
               "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert describe(cpuinfo, 2) == "Intel(R) Xeon(R) Platinum 8480+ · 2 threads · avx2 avx512_vnni avx512_bf16 amx"
    epyc = "model name : AMD EPYC 7B13 64-Core Processor\nflags : fpu avx avx2 fma\n"
    assert describe(epyc, 1) == "AMD EPYC 7B13 64-Core Processor · 1 thread · avx2"
    assert describe(epyc, 4, gpu="NVIDIA H100 80GB HBM3").startswith("NVIDIA H100 80GB HBM3 · AMD EPYC")


def test_an_evaluation_is_stored_with_this_machine_and_the_feature_page_shows_it(chat_feature, staff):
    row = _evaluation(chat_feature, "q4", tokens_per_s=125.6, machine=None)  # as evaluate_quantization stores it
    assert row.machine == this_machine() and "thread" in row.machine
    client = Client()
    client.force_login(staff)
    page = client.get(f"/staff/features/{chat_feature.pk}/").content.decode()
    assert f'<td class="evaluation-machine" colspan="2">{row.machine}</td>' in page
    assert "choose_variant --feature chat" in page


# --- helpers -----------------------------------------------------------------------------------------


def _choose(*args: str, stderr: io.StringIO | None = None) -> str:
    printed = io.StringIO()
    call_command("choose_variant", *args, stdout=printed, stderr=stderr or io.StringIO())
    return printed.getvalue()


def _row(printed: str, mode: str) -> str:
    """The table's line for one variant."""
    return next(line for line in printed.splitlines() if line.startswith(f"{mode} "))


def _evaluation(feature: Feature, mode: str, *, tokens_per_s: float, baseline_tokens_per_s: float = 100.0,
                candidate_correct: int = 42, answered: int = PROMPTS, machine: str | None = "here") -> QuantizationEvaluation:
    """A stored evaluation with these outcomes, its verdict decided by do_record_evaluation as for a real run.

    machine: "here" is this machine; None lets do_record_evaluation fill it in (also this machine).
    """
    answers = [{"id": f"p{i}", "prompt": "", "accept": [], "baseline": "", "candidate": "", "baseline_ids": [],
                "candidate_ids": []} for i in range(answered)]
    run = Run(
        answers=answers,
        scores=Scores(checkable=(checkable := min(answered, 50)), baseline_correct=min(42, checkable),
                      candidate_correct=min(candidate_correct, checkable), agreement=0.9),
        baseline_tokens_per_s=baseline_tokens_per_s,
        candidate_tokens_per_s=tokens_per_s,
        workload_requests=24,
        baseline_weights_bytes=538_000_000,
        candidate_weights_bytes=257_000_000,
    )
    return do_record_evaluation(feature, mode, run, prompt_set_size=PROMPTS,
                                machine=this_machine() if machine == "here" else machine)
