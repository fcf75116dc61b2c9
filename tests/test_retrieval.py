"""Docs features: chunking, retrieval with the semantic cache's embedding model, the retrieval cache
(scoped by who may read what, invalidated when a document changes), the retrieved tokens in the
ledger of a real chat, the staff request page's latency split, and uploads with their errors.

Real PostgreSQL, Redis, embedding model and tokenizer; the chat goes through the live stack.
"""

from __future__ import annotations

import asyncio
import html
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets.costmodel_data import initial_from_logs
from budgets.models import AuditEntry, Feature, TokenLog
from inference import retrieval
from inference.actions import do_delete_document, do_save_document
from inference.metrics import RETRIEVAL_CACHE, RETRIEVAL_SAVED, increments_for
from inference.models import Chunk, Document
from inference.retrieval import (
    CHUNK_MAX_TOKENS,
    chunk_markdown,
    docs_messages,
    model_token_counter,
    normalise_query,
    retrieve,
)
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

DOCS = Path(settings.BASE_DIR) / "docs"

GUARD_MD = """# The budget guard

## Reserving

Before a request reaches the model, the guard reserves its prompt tokens plus max_tokens on every
cap that applies, in one Redis Lua call.

## Settling

When the answer ends, the ledger row is costed at what the answer used, and the rest is released.
"""

GARDEN_MD = """# Gardening

Tomatoes need six hours of sun a day and water at the roots, never on the leaves.
"""

SECRET_MD = """# Staff runbook

The break-glass password for the billing console is kept in the red envelope in the server room safe.
"""


TEAM_MD = """# Billing runbook

To reopen a closed invoice in the billing console, open the invoice, choose Reopen, and give the
reason; the customer is emailed a corrected copy within the hour.
"""


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(autouse=True)
def clean_retrieval_cache(redis_db):
    for key in redis_db.scan_iter(match="ceiling:retrieval:*"):
        redis_db.delete(key)


@pytest.fixture
def docs_feature(transactional_db) -> Feature:
    return Feature.objects.create(name="docs", mode=Feature.Mode.DOCS, description="answers from documents")


@pytest.fixture
def corpus(docs_feature, staff) -> Feature:
    do_save_document(staff, docs_feature, "guard.md", GUARD_MD)
    do_save_document(staff, docs_feature, "garden.md", GARDEN_MD)
    do_save_document(staff, docs_feature, "runbook.md", SECRET_MD, Document.Audience.STAFF)
    return docs_feature


def documents_of(found) -> list[str]:
    return [chunk.document for chunk in found.chunks]


# --- chunking ------------------------------------------------------------------------------------


def test_chunks_follow_headings_and_keep_the_heading_path():
    passages = chunk_markdown(GUARD_MD, words, max_tokens=200)
    assert [p.heading for p in passages] == ["The budget guard › Reserving", "The budget guard › Settling"]
    assert passages[0].text.startswith("Before a request") and "Lua call." in passages[0].text


def test_paragraphs_are_packed_up_to_the_bound_and_never_over_it():
    text = "# Notes\n\n" + "\n\n".join(f"Paragraph {i} " + "word " * 30 for i in range(10))
    passages = chunk_markdown(text, words, max_tokens=100)
    assert len(passages) > 1
    assert all(words(p.text) <= 100 - words(p.heading) for p in passages)
    assert all(p.text.count("Paragraph") >= 2 for p in passages[:-1])  # packed, not one per chunk
    assert "".join(p.text for p in passages).count("Paragraph") == 10  # nothing lost


def test_an_oversized_paragraph_is_cut_at_sentences_then_words():
    sentence = "This sentence has exactly eight words in it. "
    passages = chunk_markdown(sentence * 40, words, max_tokens=50)
    assert len(passages) >= 7 and all(words(p.text) <= 50 for p in passages)
    assert all(p.text.endswith("in it.") for p in passages)  # cut between sentences
    one_run_on = "word " * 500
    assert all(words(p.text) <= 50 for p in chunk_markdown(one_run_on, words, max_tokens=50))


def test_a_code_fence_is_one_block_and_its_hash_lines_are_not_headings():
    text = "# Setup\n\nRun this:\n\n```sh\n# not a heading\n\nmake run\n```\n\nThen open the page.\n"
    passages = chunk_markdown(text, words, max_tokens=200)
    assert len(passages) == 1 and passages[0].heading == "Setup"
    assert "```sh\n# not a heading\n\nmake run\n```" in passages[0].text


def test_every_chunk_of_a_real_doc_fits_the_model_token_bound():
    count = model_token_counter()
    text = (DOCS / "budgets.md").read_text()
    passages = chunk_markdown(text, count)
    assert len(passages) > 5
    assert max(count(p.text) for p in passages) <= CHUNK_MAX_TOKENS
    assert all(p.heading for p in passages)


def test_queries_normalise_case_spacing_and_end_punctuation():
    assert normalise_query("  How does the   GUARD work?? ") == normalise_query("how does the guard work")
    assert normalise_query("how does the guard work") != normalise_query("how does the cache work")


# --- retrieval -----------------------------------------------------------------------------------


def test_retrieval_finds_the_chunk_that_answers_a_question_about_a_known_doc(docs_feature, staff, alice):
    for name in ("metrics.md", "alerts.md"):
        do_save_document(staff, docs_feature, name, (DOCS / name).read_text())

    found = retrieve(docs_feature, alice, "Which token must a Prometheus scrape send in its Authorization header?")

    top = found.chunks[0]
    assert top.document == "metrics.md" and "CEILING_METRICS_TOKEN" in top.text
    assert found.cache == "miss" and found.embedded and found.ms > 0


def test_documents_are_stored_as_chunks_with_unit_embeddings_and_token_counts(corpus):
    chunks = list(Chunk.objects.filter(document__feature=corpus).select_related("document"))
    assert {c.document.name for c in chunks} == {"guard.md", "garden.md", "runbook.md"}
    import numpy as np

    vectors = np.stack([np.frombuffer(bytes(c.embedding), dtype=np.float32) for c in chunks])
    assert vectors.shape[1] == 384 and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert all(c.tokens > 0 for c in chunks)


def test_the_passages_go_into_the_system_prompt_before_a_clients_own(corpus, alice):
    found = retrieve(corpus, alice, "How does the guard reserve tokens?")
    messages = docs_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How?"}], found.chunks)
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert system.startswith(retrieval.DOCS_SYSTEM_PROMPT) and "[1] guard.md › The budget guard › Reserving" in system
    assert system.endswith("Be brief.")


# --- the retrieval cache ---------------------------------------------------------------------------


def test_a_normalised_repeat_hits_the_cache_without_embedding(corpus, alice):
    first = retrieve(corpus, alice, "How does the guard reserve tokens?")
    again = retrieve(corpus, alice, "  how DOES the guard   reserve tokens ")

    assert first.cache == "miss" and again.cache == "hit"
    assert not again.embedded
    assert [c.chunk_id for c in again.chunks] == [c.chunk_id for c in first.chunks]
    assert again.ms <= first.ms and again.saved_ms == first.ms - again.ms


def test_a_user_who_may_not_read_a_staff_document_misses_the_staffs_cached_search(corpus, staff, alice):
    question = "Where is the break-glass password for the billing console?"
    staff_found = retrieve(corpus, staff, question)
    assert staff_found.chunks[0].document == "runbook.md"

    alice_found = retrieve(corpus, alice, question)
    assert alice_found.cache == "miss"  # another scope: the staff's entry is not hers
    assert "runbook.md" not in documents_of(alice_found)
    again = retrieve(corpus, alice, question)
    assert again.cache == "hit" and "runbook.md" not in documents_of(again)


def test_a_team_document_reaches_its_members_and_staff_and_nobody_else_cached_or_not(corpus, staff, alice, bob):
    from budgets.actions import do_create_team

    team, _ = do_create_team(None, "Billing", [bob])
    do_save_document(staff, corpus, "billing-runbook.md", TEAM_MD, Document.team_audience(team.pk))
    question = "How do I reopen a closed invoice in the billing console?"

    member = retrieve(corpus, bob, question)
    assert member.chunks and member.chunks[0].document == "billing-runbook.md"
    assert retrieve(corpus, staff, question).chunks[0].document == "billing-runbook.md"
    for attempt in ("miss", "hit"):  # a user outside the team: not found fresh, not leaked by the members' cache entry
        outsider = retrieve(corpus, alice, question)
        assert outsider.cache == attempt and "billing-runbook.md" not in documents_of(outsider)
    assert retrieve(corpus, bob, question).cache == "hit"


def test_staff_upload_a_document_for_one_team(staff_client, docs_feature, bob):
    from budgets.actions import do_create_team

    team, _ = do_create_team(None, "Billing", [bob])
    response = upload(staff_client, docs_feature, "billing.md", TEAM_MD.encode(), audience=Document.team_audience(team.pk))
    assert "billing.md is loaded: 1 chunks, readable by the team 'Billing'." in html.unescape(response.content.decode())
    assert Document.objects.get(name="billing.md").audience == f"team:{team.pk}"
    refused = upload(staff_client, docs_feature, "other.md", TEAM_MD.encode(), audience="team:999999")
    assert "Select a valid choice" in refused.content.decode() and not Document.objects.filter(name="other.md").exists()


def test_a_cached_hit_is_filtered_again_when_a_document_becomes_staff_only(corpus, staff, alice):
    question = "How much sun do tomatoes need?"
    assert retrieve(corpus, alice, question).chunks[0].document == "garden.md"
    document = Document.objects.get(feature=corpus, name="garden.md")
    # Written straight to the row, so no version bump: even then the cache cannot leak it.
    Document.objects.filter(pk=document.pk).update(audience=Document.Audience.STAFF)
    stale = retrieve(corpus, alice, question)
    assert stale.cache == "hit" and "garden.md" not in documents_of(stale)


def test_changing_a_document_invalidates_the_cached_searches(corpus, staff, alice):
    question = "How much sun do tomatoes need?"
    before = retrieve(corpus, alice, question)
    assert retrieve(corpus, alice, question).cache == "hit"

    changed = GARDEN_MD.replace("six hours", "eight hours")
    do_save_document(staff, corpus, "garden.md", changed)

    after = retrieve(corpus, alice, question)
    assert after.cache == "miss" and after.embedded
    assert "eight hours" in after.chunks[0].text and after.chunks[0].chunk_id != before.chunks[0].chunk_id


def test_deleting_a_document_invalidates_the_cached_searches_too(corpus, staff, alice):
    question = "How much sun do tomatoes need?"
    retrieve(corpus, alice, question)
    do_delete_document(staff, Document.objects.get(feature=corpus, name="garden.md"))
    after = retrieve(corpus, alice, question)
    assert after.cache == "miss" and "garden.md" not in documents_of(after)


def test_saving_the_same_text_again_changes_nothing(corpus, staff, alice):
    retrieve(corpus, alice, "How much sun do tomatoes need?")
    _, changed = do_save_document(staff, corpus, "garden.md", GARDEN_MD)
    assert not changed
    assert retrieve(corpus, alice, "How much sun do tomatoes need?").cache == "hit"


# --- the ledger, the metrics, the overview and the cost model -------------------------------------


def test_a_docs_chat_records_its_retrieved_tokens_and_retrieval_time_on_the_ledger_row(live_stack, corpus, alice, staff):
    question = "How does the guard reserve tokens before a request reaches the model?"
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame(question, 8, feature="docs")))

    accepted, last = frames[0], frames[-1]
    assert accepted["type"] == "accepted" and last["type"] == "done", frames
    sources = accepted["retrieval"]["sources"]
    assert sources[0]["document"] == "guard.md" and sources[0]["heading"] == "The budget guard › Reserving"
    assert all(s["document"] != "runbook.md" for s in sources)

    row = TokenLog.objects.select_related("transcript").get(request_id=accepted["request_id"])
    assert row.status == TokenLog.Status.OK and row.feature == corpus
    assert row.retrieved_tokens == accepted["retrieval"]["retrieved_tokens"] > 0
    assert row.prompt_tokens == accepted["prompt_tokens"] > row.retrieved_tokens  # counted in the prompt
    assert row.retrieval_ms is not None and row.retrieval_cache == "miss"
    system = row.transcript.messages[0]["content"]
    assert "one Redis Lua call" in system and "break-glass" not in system

    # The same question again: the retrieval cache answers, and the ledger says so.
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame(question.upper(), 8, feature="docs")))
    repeat = TokenLog.objects.get(request_id=frames[0]["request_id"])
    assert repeat.retrieval_cache == "hit" and repeat.retrieved_tokens == row.retrieved_tokens

    # The staff's page for the request splits its time into retrieval, prefill and decode.
    client = Client()
    client.force_login(staff)
    page = client.get(reverse("staff-request", args=[row.request_id])).content.decode()
    for part in ("latency-retrieval", "latency-prefill", "latency-decode"):
        assert f'id="{part}"' in page
    assert f'<span id="retrieved-tokens">{row.retrieved_tokens}</span>' in page


def test_a_staff_document_never_reaches_an_end_users_prompt_from_cache_or_not(live_stack, corpus, alice, staff):
    question = "Where is the break-glass password for the billing console kept?"
    assert retrieve(corpus, staff, question).chunks[0].document == "runbook.md"  # the staff's search is cached
    for _ in range(2):  # a miss, then a hit of alice's own scope
        frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame(question, 4, feature="docs")))
        row = TokenLog.objects.select_related("transcript").get(request_id=frames[0]["request_id"])
        assert "red envelope" not in row.transcript.messages[0]["content"]
        assert all(s["document"] != "runbook.md" for s in frames[0]["retrieval"]["sources"])
    assert row.retrieval_cache == "hit"


def docs_row(feature, user, **fields) -> TokenLog:
    now = timezone.now()
    values = {"status": TokenLog.Status.OK, "prompt_tokens": 700, "completion_tokens": 50, "ttft_ms": 300,
              "total_ms": 2300, "retrieved_tokens": 500, "retrieval_ms": 40, "retrieval_cache": "miss"} | fields
    return TokenLog.objects.create(request_id=f"r{TokenLog.objects.count()}", user=user, feature=feature,
                                   model="m", created_at=now, finished_at=now, **values)


def test_the_metrics_count_retrieval_cache_hits_and_the_time_they_saved(docs_feature, alice):
    row = docs_row(docs_feature, alice, retrieval_cache="hit", retrieval_ms=3, retrieval_saved_ms=250)
    increments = {(i.spec, tuple(sorted(i.labels.items()))): i.amount for i in increments_for(row) if i.part == "value"}
    assert increments[(RETRIEVAL_CACHE, (("result", "hit"),))] == 1
    assert increments[(RETRIEVAL_SAVED, ())] == 0.25


def test_the_overview_shows_the_retrieval_cache_hit_rate_and_saved_milliseconds(docs_feature, alice, staff):
    docs_row(docs_feature, alice)
    docs_row(docs_feature, alice, retrieval_cache="hit", retrieval_ms=2, retrieval_saved_ms=180)
    client = Client()
    client.force_login(staff)
    page = client.get(reverse("staff-overview")).content.decode()
    assert '<strong id="retrieval-hit-rate">50%</strong>' in page
    assert '<strong id="retrieval-saved-ms">180 ms</strong>' in page


def test_the_cost_model_takes_the_real_retrieved_length_from_the_logs(docs_feature, alice):
    for _ in range(3):
        docs_row(docs_feature, alice, prompt_tokens=620, retrieved_tokens=500, retrieval_ms=40)
    initial, _ = initial_from_logs(docs_feature)
    assert initial["retrieved_tokens"] == 500 and initial["retrieval_ms"] == 40
    assert initial["prompt_median"] == pytest.approx(120, rel=0.01)  # the rest of the prompt, not 620


# --- uploads ---------------------------------------------------------------------------------------


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def upload(client, feature, name: str, content: bytes, content_type: str = "text/markdown", audience: str = "everyone"):
    file = SimpleUploadedFile(name, content, content_type=content_type)
    return client.post(reverse("staff-feature", args=[feature.pk]), {"form": "document", "file": file, "audience": audience},
                       follow=True)


def test_staff_upload_a_markdown_file_and_it_is_chunked_audited_and_listed(staff_client, docs_feature):
    response = upload(staff_client, docs_feature, "guard.md", GUARD_MD.encode(), audience="staff")
    page = response.content.decode()
    assert response.status_code == 200 and "guard.md is loaded: 2 chunks, readable by staff only." in page
    document = Document.objects.get(feature=docs_feature, name="guard.md")
    assert document.audience == "staff" and document.chunks.count() == 2
    assert AuditEntry.objects.filter(target="feature docs", field="document", action="create").exists()
    assert 'id="document-list"' in page


@pytest.mark.parametrize(("name", "content", "content_type", "error"), [
    ("notes.pdf", b"%PDF-1.7", "application/pdf", "is not a Markdown or text file: use a .md, .markdown or .txt file."),
    ("notes.md", b"\x89PNG\r\n", "image/png", "was sent as &#x27;image/png&#x27;, not as text"),
    ("notes.md", b"caf\xe9 au lait", "text/markdown", "is not UTF-8 text (byte 3 cannot be read): save it as UTF-8."),
    ("notes.md", b"text\x00\x01binary", "text/markdown", "holds binary data (NUL bytes), not text."),
    ("notes.md", b"   \n\n  ", "text/markdown", "is empty: there is nothing to answer from."),
    ("notes.md", b"x" * (retrieval.MAX_DOCUMENT_BYTES + 1), "text/markdown", "a document may be at most 512 KiB. Split it into several files."),
])
def test_an_upload_that_is_not_a_usable_text_file_is_refused_with_a_sentence(staff_client, docs_feature, name, content, content_type, error):
    response = upload(staff_client, docs_feature, name, content, content_type)
    assert response.status_code == 400
    assert error in response.content.decode()
    assert not Document.objects.exists()


def test_an_upload_without_a_file_says_so(staff_client, docs_feature):
    response = staff_client.post(reverse("staff-feature", args=[docs_feature.pk]), {"form": "document", "audience": "everyone"})
    assert response.status_code == 400 and "Choose a file to upload." in response.content.decode()


def test_a_feature_not_in_docs_mode_takes_no_documents(staff_client, chat_feature):
    response = upload(staff_client, chat_feature, "guard.md", GUARD_MD.encode())
    assert "documents serve a feature in docs mode" in response.content.decode()
    assert not Document.objects.exists()


def test_end_users_cannot_upload(alice, docs_feature):
    client = Client()
    client.force_login(alice)
    response = upload(client, docs_feature, "guard.md", GUARD_MD.encode())
    assert response.status_code == 403 and not Document.objects.exists()


# --- the demo corpus ---------------------------------------------------------------------------------


def test_seed_demo_creates_the_docs_feature_once_and_load_docs_loads_files_once(transactional_db, tmp_path):
    import io

    from django.core.management import CommandError, call_command

    call_command("seed_demo", "--no-history", stdout=io.StringIO())
    call_command("seed_demo", "--no-history", stdout=io.StringIO())
    docs = Feature.objects.get(name="docs")
    assert docs.mode == Feature.Mode.DOCS and Feature.objects.filter(mode=Feature.Mode.DOCS).count() == 1

    guide = tmp_path / "guard.md"
    guide.write_text(GUARD_MD)
    first, second = io.StringIO(), io.StringIO()
    call_command("load_docs", str(guide), stdout=first)
    call_command("load_docs", str(guide), stdout=second)
    assert "guard.md: 2 chunks" in first.getvalue()
    assert "1 documents, 0 loaded or changed now" in second.getvalue()
    with pytest.raises(CommandError, match="The feature 'chat' is in chat mode; documents serve a feature in docs mode."):
        call_command("load_docs", str(guide), "--feature", "chat", stdout=io.StringIO())
    (tmp_path / "slides.pdf").write_bytes(b"%PDF")
    with pytest.raises(CommandError, match="is not a Markdown or text file"):
        call_command("load_docs", str(tmp_path / "slides.pdf"), stdout=io.StringIO())


def test_load_docs_restricts_files_to_a_team_by_name(docs_feature, bob, tmp_path):
    import io

    from django.core.management import CommandError, call_command

    from budgets.actions import do_create_team

    team, _ = do_create_team(None, "Billing", [bob])
    with pytest.raises(CommandError, match="There is no team named 'Nobody'"):
        call_command("load_docs", "--team", "Nobody", stdout=io.StringIO())
    assert not Document.objects.exists()
    runbook = tmp_path / "billing.md"
    runbook.write_text(TEAM_MD)
    call_command("load_docs", str(runbook), "--team", "Billing", stdout=io.StringIO())
    assert list(Document.objects.values_list("name", "audience")) == [("billing.md", Document.team_audience(team.pk))]


def test_a_redis_that_does_not_answer_is_said_once_when_documents_change(docs_feature, staff, settings, caplog):
    """`make run` loads the docs before its private Redis starts: one warning, not one per file."""
    import logging

    from inference import retrieval

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    retrieval._unreachable_said.clear()
    with caplog.at_level(logging.DEBUG, logger="inference.retrieval"):
        for _ in range(3):  # three documents loaded
            retrieval.bump_version(docs_feature.pk)
    said = [r for r in caplog.records if "could not bump the version" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
