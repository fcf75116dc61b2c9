"""The verdict shipped with the bundled model: `make run` serves the demo features with q4 from the first
chat, audited and announced; staff pins are kept; full precision where q4 cannot run here."""

from __future__ import annotations

import io

import pytest
from django.test import Client

from budgets.models import AuditEntry, Feature, Provider
from inference.actions import do_record_evaluation, switch_refusal
from inference.engine.evaluate import Run, Scores
from inference.shipped import adopt_shipped_verdict, q4_problem


@pytest.fixture
def demo_features(chat_feature) -> tuple[Feature, Feature]:
    docs = Feature.objects.create(name="docs", description="Questions about Ceiling", mode=Feature.Mode.DOCS)
    return chat_feature, docs


def test_a_first_start_serves_the_demo_features_with_q4_audited_and_announced(demo_features):
    lines: list[str] = []

    switched = adopt_shipped_verdict(q4_problem("cpu"), say=lines.append)  # builds the kernels here

    assert [f.name for f in switched] == ["chat", "docs"]
    for feature in demo_features:
        feature.refresh_from_db()
        assert feature.quantization == "q4" and not feature.quantization_pinned
        entry = AuditEntry.objects.get(target=f"feature {feature.name}", field="quantization")
        assert (entry.actor, entry.before, entry.after) == (None, "none", "q4")
    assert lines[0].startswith("Serving chat with q4 weights (the shipped verdict: the bundled model is a Q4_1 GGUF")
    assert adopt_shipped_verdict(None, say=lines.append) == []  # the next start changes nothing
    assert AuditEntry.objects.filter(field="quantization").count() == 2


def test_every_feature_the_demo_makes_is_served_with_q4_so_no_full_precision_worker_compiles(transactional_db):
    from django.core.management import call_command

    from inference.variants import variants_in_use

    quiet = io.StringIO()
    call_command("seed_demo", "--no-history", stdout=quiet)
    call_command("synth_logs", rows=50, users=5, days=3, stdout=quiet)  # the history seed_demo adds, smaller
    made = set(Feature.objects.filter(enabled=True).values_list("name", flat=True))
    assert made == {"chat", "docs", "summary", "extract"}

    adopt_shipped_verdict(None, say=lambda _: None)

    assert set(Feature.objects.filter(enabled=True).values_list("quantization", flat=True)) == {"q4"}
    assert variants_in_use() == ["none", "q4"]  # the default variant's worker stays (remote features, small jobs)


def test_it_never_switches_a_pinned_feature(demo_features):
    chat, docs = demo_features
    Feature.objects.filter(pk=chat.pk).update(quantization_pinned=True)
    lines: list[str] = []

    adopt_shipped_verdict(None, say=lines.append)

    chat.refresh_from_db()
    docs.refresh_from_db()
    assert (chat.quantization, docs.quantization) == ("none", "q4")
    assert "chat stays in full precision: staff pinned its weights." in lines


def test_a_staff_switch_on_the_feature_page_pins_the_feature(demo_features, staff):
    chat, _ = demo_features
    adopt_shipped_verdict(None, say=lambda line: None)
    client = Client()
    client.force_login(staff)

    client.post(f"/staff/features/{chat.pk}/", {"form": "quantization", "quantization": "none"})

    chat.refresh_from_db()
    assert chat.quantization == "none" and chat.quantization_pinned
    adopt_shipped_verdict(None, say=lambda line: None)
    chat.refresh_from_db()
    assert chat.quantization == "none"
    page = client.get(f"/staff/features/{chat.pk}/").content.decode()
    assert 'id="weights-pinned">pinned' in page


def test_without_a_compiler_the_features_go_back_to_full_precision_and_it_says_why(demo_features, settings, tmp_path,
                                                                                  monkeypatch):
    chat, docs = demo_features
    Feature.objects.filter(pk=chat.pk).update(quantization="q4")  # adopted on an earlier start
    settings.VAR_DIR = tmp_path  # no kernels built here yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    lines: list[str] = []

    problem = q4_problem("cpu")
    adopt_shipped_verdict(problem, say=lines.append)

    assert problem == "Ceiling's q4 kernels cannot be built here (no C++ compiler (g++ or c++) on the PATH)"
    chat.refresh_from_db()
    docs.refresh_from_db()
    assert (chat.quantization, docs.quantization) == ("none", "none")
    assert f"Serving chat in full precision instead of q4: {problem}." in lines
    assert f"docs stays in full precision: {problem}." in lines


def test_q4_is_not_adopted_on_a_gpu_or_without_own_kernels(settings):
    assert q4_problem("cuda") == "q4 runs on the CPU only, and this stack's engine runs on cuda"
    settings.CEILING_OWN_KERNELS = False
    assert "CEILING_OWN_KERNELS is off" in q4_problem("cpu")


def test_a_failed_evaluation_here_closes_the_gate_and_the_next_start_switches_back(demo_features):
    chat, _ = demo_features
    adopt_shipped_verdict(None, say=lambda line: None)
    _failed_q4_evaluation(chat)
    lines: list[str] = []

    adopt_shipped_verdict(None, say=lines.append)

    chat.refresh_from_db()
    assert chat.quantization == "none"
    assert lines[0].startswith("Serving chat in full precision instead of q4: The latest q4 evaluation of chat")


def test_another_model_and_remote_or_other_variants_are_left_alone(demo_features, settings):
    chat, docs = demo_features
    remote = Provider.objects.create(name="vllm", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1")
    Feature.objects.filter(pk=chat.pk).update(provider=remote)
    Feature.objects.filter(pk=docs.pk).update(quantization="bf16")
    assert adopt_shipped_verdict(None, say=lambda line: None) == []

    settings.CEILING_MODEL = "/models/some-other-model"
    Feature.objects.filter(pk=chat.pk).update(provider=None)
    assert adopt_shipped_verdict(None, say=lambda line: None) == []
    assert "No q4 evaluation of chat has been run yet" in switch_refusal(chat, "q4")


def test_the_overview_and_the_feature_page_show_the_switch_nobody_clicked(demo_features, staff):
    chat, _ = demo_features
    adopt_shipped_verdict(None, say=lambda line: None)
    client = Client()
    client.force_login(staff)

    overview = client.get("/staff/").content.decode()
    feature_page = client.get(f"/staff/features/{chat.pk}/").content.decode()

    assert 'id="weights-chat"' in overview
    chat_weights = overview.split('id="weights-chat">')[1].split("</span>")[0]
    assert "4-bit weights" in chat_weights and "by the start-up or a command" in chat_weights
    assert "the verdict shipped with the bundled model approves it" in feature_page


def _failed_q4_evaluation(feature: Feature) -> None:
    answers = [{"id": f"p{i}", "prompt": "", "accept": [], "baseline": "", "candidate": "", "baseline_ids": [],
                "candidate_ids": []} for i in range(60)]
    run = Run(answers=answers, scores=Scores(checkable=50, baseline_correct=42, candidate_correct=30, agreement=0.5),
              baseline_tokens_per_s=40.0, candidate_tokens_per_s=60.0, workload_requests=24,
              baseline_weights_bytes=538_000_000, candidate_weights_bytes=604_000_000)
    do_record_evaluation(feature, "q4", run, prompt_set_size=60)
