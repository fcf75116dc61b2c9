"""The stream drops frames (it is at-most-once): the chat page notices the gap in `seq` and
shows the whole answer from the stored transcript; only the owner can read that transcript."""

from __future__ import annotations

import signal
import time

import pytest
from django.conf import settings
from django.test import Client

from budgets.models import TokenLog
from inference.actions import do_admit_request, do_finish_request
from inference.models import Transcript
from tests.conftest import session_cookie, wait_for
from tests.faults import PrivateRedis, start_private_stack

pytestmark = pytest.mark.django_db(transaction=True)

# Four bundles of frames fit in the web process's stream inbox; while it is paused, the worker's
# later sends are dropped by the worker's push itself, as they are under real overload.
CAPACITY = 4


def a_finished_request(user, feature, text: str) -> str:
    request_id = f"transcript-{user.pk}-{time.monotonic_ns()}"
    do_admit_request(request_id=request_id, user=user, feature=feature, model="m",
                     messages=[{"role": "user", "content": "Hi"}], prompt_ids=[1, 2], max_tokens=8)
    do_finish_request(request_id, status=TokenLog.Status.OK, prompt_tokens=2, completion_ids=[5, 6, 7],
                      text=text, finish_reason="stop", ttft_ms=10)
    return request_id


def tokens_streamed(private, request_id: str) -> int:
    """The worker's own count of tokens it streamed (inference/bus/ ChannelSender.send_frame)."""
    return int(private.redis.client().hget(f"ceiling:running:{request_id}", "tokens") or 0)


def test_only_the_owner_can_fetch_a_finished_transcript(alice, bob, chat_feature):
    request_id = a_finished_request(alice, chat_feature, "Hello <b>there</b>!")
    owner, other, anonymous = Client(), Client(), Client()
    owner.force_login(alice)
    other.force_login(bob)
    url = f"/chat/requests/{request_id}/"

    answer = owner.get(url)
    assert answer.status_code == 200 and answer["Content-Type"] == "application/json"
    assert answer.json() == {"request_id": request_id, "status": "ok", "text": "Hello <b>there</b>!",
                             "usage": {"prompt_tokens": 2, "completion_tokens": 3, "cached_tokens": 0}, "finish_reason": "stop"}
    assert other.get(url).status_code == 404
    assert owner.get("/chat/requests/no-such-request/").status_code == 404
    assert anonymous.get(url).status_code == 302  # to the login page
    assert owner.post(url).status_code == 405


@pytest.fixture
def small_channel_stack(django_db_setup):
    private_redis = PrivateRedis.start()
    private = start_private_stack("lost-frames", private_redis, CEILING_CHANNEL_CAPACITY=str(CAPACITY))
    try:
        yield private
    finally:
        private.daphne.send_signal(signal.SIGCONT)
        private.stop()
        private_redis.stop()


def test_the_chat_page_shows_the_whole_answer_after_frames_were_dropped(small_channel_stack, page, alice, chat_feature):
    live = small_channel_stack.live
    page.context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": session_cookie(alice), "url": live.http_url}])
    page.goto(f"{live.http_url}/chat/")
    page.wait_for_selector("text=Connected.")
    page.fill("#max-tokens", "64")
    page.fill("#prompt", "Write a long story about a lighthouse keeper and a storm, with many details.")
    page.click("#send")
    page.wait_for_function("() => (document.querySelector('li.assistant') || {}).textContent?.length > 0", timeout=90_000)

    # The web process stops reading its inbox (a stall) while the worker streams more tokens than
    # the inbox holds; then it reads on, and the rest of the answer arrives after a gap.
    request_id = TokenLog.objects.get(user=alice).request_id
    small_channel_stack.daphne.send_signal(signal.SIGSTOP)
    try:
        streamed_at_stop = tokens_streamed(small_channel_stack, request_id)
        wait_for(lambda: tokens_streamed(small_channel_stack, request_id) >= streamed_at_stop + CAPACITY + 4, timeout=120, every=0.2)
    finally:
        small_channel_stack.daphne.send_signal(signal.SIGCONT)

    page.wait_for_selector("li.assistant .meta", timeout=120_000)
    shown = page.evaluate("() => document.querySelector('li.assistant').firstChild.textContent")
    recovered = page.evaluate("() => document.querySelector('li.assistant').dataset.recovered")
    row = wait_for(lambda: TokenLog.objects.filter(user=alice).exclude(status=TokenLog.Status.RUNNING).first(), timeout=30)
    stored = Transcript.objects.get(log=row).response_text

    assert "its inbox is full" in small_channel_stack.worker_log(0)  # frames really were dropped
    assert row.status == TokenLog.Status.OK and row.completion_tokens > CAPACITY
    assert shown == stored and len(stored) > 0
    assert recovered == "true"  # the page saw the gap and fetched the transcript
