"""Staff in a real browser (Debian's chromium via Playwright): start a batch job and watch it finish.

Screenshots of the finished job (var/screenshots/staff-batches.png) and of the list
(staff-batches-list.png) are saved for a person to look at.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings

from budgets.models import Feature, TokenLog
from inference.models import BatchJob

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "screenshots"


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)



def test_staff_start_a_three_item_job_and_watch_it_reach_3_of_3(live_stack, page, staff):
    feature = Feature.objects.create(name="digest", description="Nightly digest", mode=Feature.Mode.BATCH)
    Feature.objects.create(name="chat")  # a chat-mode feature is not offered for jobs

    page.goto(f"{live_stack.http_url}/staff/batches/")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", "staff")
    page.fill("#id_password", "staff-password-1")
    page.click("button[type=submit]")
    page.wait_for_url("**/staff/batches/")
    assert page.locator("nav.staff-nav a", has_text="Batch jobs").count() == 1
    assert page.locator("#id_feature option").all_inner_texts() == ["digest"]
    assert page.input_value("#batch-form #id_username") == "staff"  # runs as the staff user by default

    page.fill("#id_max_tokens", "16")
    page.fill("#id_inputs", "Name a colour.\nName a fruit.\nSay <b>hello</b> in French.")
    page.click("#batch-form button[type=submit]")
    page.wait_for_url("**/staff/batches/*/")
    job = BatchJob.objects.get()
    assert page.url.endswith(f"/staff/batches/{job.pk}/")

    # batch.js polls the progress endpoint every second and fills the rows in as items finish.
    page.wait_for_function("document.getElementById('job-processed').textContent === '3/3'", timeout=240_000)
    page.wait_for_function("document.getElementById('job-status').textContent === 'done'", timeout=10_000)
    assert page.locator("#job-done").inner_text() == "3"
    assert page.locator("#batch-items .item-status").all_inner_texts() == ["ok", "ok", "ok"]
    outputs = page.locator("#batch-items .item-output").all_inner_texts()
    assert all(outputs)
    assert page.locator("#batch-items b").count() == 0  # inputs and outputs are text, never HTML

    job.refresh_from_db()
    assert (job.status, job.done, job.failed) == (BatchJob.Status.DONE, 3, 0)
    for item in job.items.all():
        log = TokenLog.objects.get(request_id=item.request_id)
        assert log.status == TokenLog.Status.OK and log.user == staff and log.feature == feature
        assert item.output.strip() in outputs[item.index]

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "staff-batches.png"), full_page=True)

    page.click(".crumbs a")  # back to the list
    page.wait_for_url("**/staff/batches/")
    row = page.locator("#batch-jobs tbody tr").first
    assert "3/3" in row.inner_text() and "done" in row.inner_text()
    page.screenshot(path=str(SCREENSHOTS / "staff-batches-list.png"), full_page=True)
