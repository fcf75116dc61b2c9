"""The staff overview, the live charts and the /ws/dashboard/ feed."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.test import Client
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

STAFF_PAGES = ["/staff/", "/staff/charts/", "/staff/charts/?range=30d"]


@pytest.mark.django_db
@pytest.mark.parametrize("url", STAFF_PAGES)
def test_staff_pages_send_anonymous_users_to_log_in(url):
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/?next=")


@pytest.mark.django_db
@pytest.mark.parametrize("url", STAFF_PAGES)
def test_staff_pages_refuse_end_users(alice, url):
    client = Client()
    client.force_login(alice)
    assert client.get(url).status_code == 403


@pytest.mark.django_db
@pytest.mark.parametrize("url", STAFF_PAGES)
def test_staff_pages_render_with_a_bounded_number_of_queries(staff, chat_feature, url, django_assert_max_num_queries):
    client = Client()
    client.force_login(staff)
    with django_assert_max_num_queries(15):
        response = client.get(url)
    assert response.status_code == 200
    assert b"plotly.min.js" in response.content


async def _dashboard(live_stack, cookie: str | None):
    headers = {"Cookie": f"sessionid={cookie}"} if cookie else {}
    return await connect(live_stack.ws_url.replace("/ws/chat/", "/ws/dashboard/"), origin=live_stack.http_url, additional_headers=headers)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("who", ["anonymous", "alice"])
def test_the_dashboard_socket_refuses_non_staff(live_stack, alice, who):
    cookie = session_cookie(alice) if who == "alice" else None

    async def attempt():
        ws = await _dashboard(live_stack, cookie)
        await ws.close()

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(attempt())
    assert refused.value.response.status_code == 403


@pytest.mark.django_db(transaction=True)
def test_a_settled_chat_reaches_the_dashboard_within_a_second(live_stack, staff, alice, chat_feature):
    staff_cookie, alice_cookie = session_cookie(staff), session_cookie(alice)

    async def scenario():
        ws = await _dashboard(live_stack, staff_cookie)
        try:
            frames = await chat(live_stack, alice_cookie, chat_frame("Say hi.", 4))
            loop = asyncio.get_running_loop()
            done_at = loop.time()
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), timeout=5))
                if event["type"] == "point":
                    return frames, event, loop.time() - done_at
        finally:
            await ws.close()

    frames, point, delay = asyncio.run(scenario())
    done = frames[-1]
    assert point["feature"] == "chat" and point["status"] == "ok"
    assert point["tokens"] == done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
    assert delay < 1.0


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_socket_pushes_engine_stats(live_stack, staff):
    cookie = session_cookie(staff)

    async def scenario():
        ws = await _dashboard(live_stack, cookie)
        try:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), timeout=5))
                if event["type"] == "engine":
                    return event
        except ConnectionClosed:
            return None
        finally:
            await ws.close()

    event = asyncio.run(scenario())
    assert event and event["workers"]
    worker = event["workers"][0]
    assert worker["kv_blocks_total"] > 0 and "running" in worker and "tokens_per_s" in worker


@pytest.mark.django_db
def test_the_charts_split_docs_answers_into_retrieval_prefill_and_decode(staff, chat_feature):
    """The latency budget of a docs answer, bucket by bucket: the means of the answered requests
    that retrieved, split as one request's page splits it; refused and non-docs rows stay out."""
    from django.utils import timezone

    from budgets import charts
    from budgets.models import TokenLog

    now = timezone.now()

    def row(status=TokenLog.Status.OK, **fields):
        return TokenLog.objects.create(request_id=f"split-{TokenLog.objects.count()}", feature=chat_feature,
                                       model="m", status=status, created_at=now, finished_at=now, **fields)

    row(retrieval_ms=80, ttft_ms=300, total_ms=1300)
    row(retrieval_ms=20, ttft_ms=500, total_ms=900)
    row(ttft_ms=9000, total_ms=9999)  # no retrieval: a chat, not a docs answer
    row(status=TokenLog.Status.REFUSED, retrieval_ms=5000)  # refused: never answered
    series = charts.retrieval_latency_series(now, "24h")
    assert len(series.x) == 1
    assert series.traces == {"retrieval": [50.0], "prefill": [400.0], "decode": [700.0]}

    client = Client()
    client.force_login(staff)
    page = client.get("/staff/charts/")
    data = json.loads(page.content.decode().split('id="charts-data" type="application/json">')[1].split("</script>")[0])
    assert data["retrieval_latency"]["traces"]["decode"] == [700.0]
    assert b'id="retrieval-latency-chart"' in page.content


@pytest.mark.django_db
def test_the_charts_can_show_only_one_tags_requests(staff, chat_feature):
    from django.utils import timezone

    from budgets.models import TokenLog

    now = timezone.now()
    for index, (tags, tokens) in enumerate([(",support,", 10), (",support,beta,", 5), (",beta,", 1000), ("", 7)]):
        TokenLog.objects.create(request_id=f"tagged-{index}", feature=chat_feature, model="m", status=TokenLog.Status.OK,
                                tags=tags, prompt_tokens=tokens, created_at=now, finished_at=now)
    client = Client()
    client.force_login(staff)

    def tokens_shown(query: str) -> float:
        page = client.get(f"/staff/charts/{query}").content.decode()
        data = json.loads(page.split('id="charts-data" type="application/json">')[1].split("</script>")[0])
        return sum(sum(y) for y in data["series"]["tokens"]["traces"].values())

    assert tokens_shown("") == 1022
    assert tokens_shown("?tag=support") == 15
    assert tokens_shown("?tag=beta&range=30d") == 1005
    bad = client.get("/staff/charts/?tag=Not%20A%20Tag").content.decode()
    assert "is not a tag" in bad and tokens_shown("?tag=Not%20A%20Tag") == 1022
