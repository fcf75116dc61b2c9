"""Serving modes: extract answers once with a parsed JSON object, batch features run as staff's jobs.

Extract and batch run end to end on the real stack (daphne, the Celery worker and its engine); the
JSON extraction itself is specified as a unit, since a 135M model's JSON is not always well formed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from django.test import Client
from django.urls import reverse

from accounts.actions import do_create_api_key
from budgets.models import Feature, Quota, TokenLog
from inference.batch_jobs import do_start_batch
from inference.models import BatchItem, BatchJob
from inference.web.modes import EXTRACT_SYSTEM_PROMPT, InvalidJSON, extract_json, extract_messages
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

PARIS = 'Return a JSON object with keys "city" and "country" for Paris.'
INPUTS = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a country.", "Name a planet."]


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def extract_feature(transactional_db) -> Feature:
    return Feature.objects.create(name="extract", mode=Feature.Mode.EXTRACT)


@pytest.fixture
def batch_feature(transactional_db) -> Feature:
    return Feature.objects.create(name="digest", mode=Feature.Mode.BATCH)


# --- extract_json: the whole answer, a fenced block, or the first {...} ---------------------------


def test_a_plain_json_answer_is_parsed():
    assert extract_json('{"city": "Paris", "country": "France"}') == {"city": "Paris", "country": "France"}
    assert extract_json('  \n{"n": 1, "ok": true, "none": null}\n') == {"n": 1, "ok": True, "none": None}


def test_json_inside_prose_is_found():
    answer = 'Sure! Here is the object: {"city": "Paris", "country": "France"}. Let me know if you need more.'
    assert extract_json(answer) == {"city": "Paris", "country": "France"}


def test_json_in_a_code_fence_is_found():
    assert extract_json('```json\n{"city": "Paris"}\n```') == {"city": "Paris"}
    assert extract_json('Here:\n```\n{"city": "Paris"}\n```\nDone.') == {"city": "Paris"}


def test_the_first_whole_object_wins_and_braces_in_strings_do_not_confuse_it():
    answer = 'Not this {city: Paris} but this {"a": {"b": "a } inside"}} and not {"c": 3}'
    assert extract_json(answer) == {"a": {"b": "a } inside"}}


def test_an_answer_without_an_object_is_invalid_json_with_a_sentence():
    for answer in ("The capital of France is Paris.", '{"city": "Par', "[1, 2, 3]", "42", "{city: Paris}"):
        with pytest.raises(InvalidJSON, match="is not a JSON object"):
            extract_json(answer)
    with pytest.raises(InvalidJSON, match="empty answer"):
        extract_json("   ")


def test_the_invalid_json_message_quotes_only_the_start_of_a_long_answer():
    with pytest.raises(InvalidJSON) as invalid:
        extract_json("word " * 100)
    assert "…" in str(invalid.value) and len(str(invalid.value)) < 250


def test_the_json_instruction_becomes_the_system_prompt():
    asked = [{"role": "user", "content": PARIS}]
    assert extract_messages(asked) == [{"role": "system", "content": EXTRACT_SYSTEM_PROMPT}, *asked]
    with_system = [{"role": "system", "content": "Be terse."}, *asked]
    assert extract_messages(with_system) == [
        {"role": "system", "content": f"{EXTRACT_SYSTEM_PROMPT}\n\nBe terse."}, *asked
    ]


# --- extract end to end -------------------------------------------------------------------------


def test_an_extract_feature_answers_once_with_a_parsed_object(live_stack, alice, extract_feature):
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame(PARIS, 48, feature="extract")))

    accepted, last = frames[0], frames[-1]
    assert accepted["type"] == "accepted"
    assert not [f for f in frames if f["type"] == "token"]  # collected, never streamed
    assert last["type"] in ("done", "error"), last
    if last["type"] == "done":
        assert isinstance(last["result"], dict) and last["result"]
    else:
        assert last["code"] == "invalid_json" and "not a JSON object" in last["message"]

    # Either way the request is in the ledger with the tokens it used.
    log = TokenLog.objects.get(request_id=accepted["request_id"])
    assert log.status == TokenLog.Status.OK and log.feature == extract_feature and log.user == alice
    assert log.prompt_tokens == accepted["prompt_tokens"] and 0 < log.completion_tokens <= 48
    assert log.transcript.messages[0] == {"role": "system", "content": EXTRACT_SYSTEM_PROMPT}
    if last["type"] == "done":
        assert last["usage"]["completion_tokens"] == log.completion_tokens
        assert extract_json(log.transcript.response_text) == last["result"]


def test_the_api_answers_an_extract_feature_without_streaming_even_when_asked_to(live_stack, alice, extract_feature):
    key = do_create_api_key(alice, "tests")[1]
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": PARIS}],
            "max_tokens": 48, "stream": True, "feature": "extract"}
    status, headers, answer = post_json(live_stack, key, body)

    assert headers["Content-Type"].startswith("application/json")  # not text/event-stream
    if status == 200:
        assert answer["object"] == "chat.completion"
        assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)
    else:
        assert status == 502 and answer["error"]["code"] == "invalid_json"
    log = TokenLog.objects.get(request_id=headers["X-Request-Id"])
    assert log.status == TokenLog.Status.OK and log.completion_tokens > 0 and log.feature == extract_feature


def post_json(live_stack, key: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        f"{live_stack.http_url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


# --- batch features ---------------------------------------------------------------------------


def test_a_batch_feature_refuses_interactive_chat(live_stack, alice, batch_feature):
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Hello", 8, feature="digest")))

    assert frames == [{
        "type": "error", "code": "batch_only",
        "message": "The feature 'digest' runs as a batch job; staff start it from the dashboard.",
    }]
    assert not TokenLog.objects.exists()  # refused before the guard, like an unknown feature

    status, _, answer = post_json(live_stack, do_create_api_key(alice, "tests")[1],
                                  {"messages": [{"role": "user", "content": "Hello"}], "feature": "digest"})
    assert status == 400 and answer["error"]["code"] == "batch_only" and answer["error"]["param"] == "feature"


def watch_job(job: BatchJob, timeout: float = 240) -> list[int]:
    """Poll the job as the staff page does until it finishes; every processed count seen, in order."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed, status = BatchJob.objects.values_list("done", "failed", "status").get(pk=job.pk)
        if not seen or seen[-1] != done + failed:
            seen.append(done + failed)
        if status in (BatchJob.Status.DONE, BatchJob.Status.FAILED):
            return seen
        time.sleep(0.05)
    pytest.fail(f"batch {job.pk} did not finish within {timeout} s (seen {seen})")


def test_a_batch_job_answers_every_item_in_the_worker_and_shows_progress(live_stack, alice, batch_feature):
    job = do_start_batch(feature=batch_feature, user=alice, max_tokens=12, prompts=INPUTS)  # run_batch.delay on commit

    seen = watch_job(job)
    job.refresh_from_db()
    assert job.status == BatchJob.Status.DONE and job.finished_at is not None
    assert (job.total, job.done, job.failed) == (5, 5, 0)
    assert seen == sorted(seen) and seen[-1] == 5
    assert any(0 < count < 5 for count in seen)  # progress was visible while the job ran

    items = list(job.items.all())
    assert [item.prompt for item in items] == INPUTS
    for item in items:
        assert item.status == TokenLog.Status.OK and item.output and not item.error
        log = TokenLog.objects.get(request_id=item.request_id)
        assert log.status == TokenLog.Status.OK and log.user == alice and log.feature == batch_feature
        assert 0 < log.completion_tokens <= 12
        assert log.transcript.response_text == item.output


def test_items_the_guard_refuses_are_recorded_and_the_job_goes_on(live_stack, alice, batch_feature):
    Quota.objects.create(user=alice, period="day", max_requests=3)
    job = do_start_batch(feature=batch_feature, user=alice, max_tokens=8, prompts=INPUTS)

    watch_job(job)
    job.refresh_from_db()
    assert job.status == BatchJob.Status.DONE
    assert (job.done, job.failed) == (3, 2)
    statuses = sorted(job.items.values_list("status", flat=True))
    assert statuses == ["ok", "ok", "ok", "refused", "refused"]
    for item in job.items.filter(status="refused"):
        assert item.error.startswith("You have made 3 of your 3 requests for today")
        log = TokenLog.objects.get(request_id=item.request_id)
        assert log.refusal_code == "user_requests_per_day" and log.user == alice and log.feature == batch_feature
    assert TokenLog.objects.filter(user=alice, status=TokenLog.Status.OK).count() == 3


# --- staff pages ---------------------------------------------------------------------------------


def client_for(user=None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def test_the_batch_pages_are_for_staff_only(alice, staff, batch_feature):
    job = BatchJob.objects.create(feature=batch_feature, user=alice, total=0)  # never dispatched
    urls = [reverse("staff-batches"), reverse("staff-batch", args=[job.pk]), reverse("staff-batch-progress", args=[job.pk])]
    for url in urls:
        anonymous = client_for().get(url)
        assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/?next=")
        assert client_for(alice).get(url).status_code == 403
        assert client_for(staff).get(url).status_code == 200
    assert client_for(staff).get(reverse("staff-batch", args=[job.pk + 1])).status_code == 404


def test_an_invalid_batch_form_shows_its_errors_and_starts_nothing(alice, staff, batch_feature, chat_feature):
    client = client_for(staff)
    good = {"feature": batch_feature.pk, "username": "alice", "max_tokens": 16, "inputs": "one\ntwo"}
    cases = [
        ({"inputs": " \n\n  \n"}, "Give at least one input"),
        ({"feature": 99_999}, "Choose one of the listed features"),
        ({"feature": chat_feature.pk}, "Choose one of the listed features"),  # a chat-mode feature
        ({"username": "nobody"}, "There is no active user named &#x27;nobody&#x27;"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
    ]
    for change, error in cases:
        response = client.post(reverse("staff-batches"), {**good, **change})
        assert response.status_code == 200, change
        assert error in response.content.decode(), change
        assert "No job was started" in response.content.decode()
    assert not BatchJob.objects.exists() and not BatchItem.objects.exists()


def test_the_start_form_lists_batch_features_and_runs_as_the_staff_user_by_default(staff, batch_feature, chat_feature):
    response = client_for(staff).get(reverse("staff-batches"))
    form = response.context["form"]
    assert list(form.fields["feature"].queryset) == [batch_feature]
    assert form["username"].value() == "staff"


def test_staff_start_a_job_from_the_form(live_stack, staff, batch_feature):
    response = client_for(staff).post(
        reverse("staff-batches"),
        {"feature": batch_feature.pk, "username": "staff", "max_tokens": 8, "inputs": "Say hi.\n\n  Say bye.  \n"},
    )
    job = BatchJob.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse("staff-batch", args=[job.pk])
    assert job.user == staff and job.max_tokens == 8 and job.total == 2
    assert list(job.items.values_list("index", "prompt")) == [(0, "Say hi."), (1, "Say bye.")]  # blank lines skipped

    watch_job(job)
    progress = client_for(staff).get(reverse("staff-batch-progress", args=[job.pk])).json()
    assert progress["finished"] and progress["processed"] == progress["done"] == 2 and progress["status"] == "done"
    assert [item["status"] for item in progress["items"]] == ["ok", "ok"]


def test_model_output_is_escaped_on_the_detail_page(alice, staff, batch_feature):
    job = BatchJob.objects.create(feature=batch_feature, user=alice, total=1, done=1, status=BatchJob.Status.DONE)
    BatchItem.objects.create(job=job, index=0, prompt="<i>hi</i>", output='<img src=x onerror="alert(1)">', status="ok")
    page = client_for(staff).get(reverse("staff-batch", args=[job.pk])).content.decode()
    assert "<img src=x" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert "<i>hi</i>" not in page

