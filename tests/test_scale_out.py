"""Two daphne processes and two Celery workers sharing one Redis: a cap still holds exactly."""

from __future__ import annotations

import asyncio

import pytest

from budgets.models import Quota, TokenLog
from tests.conftest import engine_stats, session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def second_stack(live_stack, shared_stack):
    """The second web server and worker: the shared stack's (tests/conftest.py), on the same Redis and
    database as live_stack's, its chats on a queue of its own."""
    return shared_stack


def test_a_daily_cap_holds_across_two_web_servers_and_two_workers(live_stack, second_stack, redis_db, alice, chat_feature):
    assert len(engine_stats(redis_db)) >= 2
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)
    Quota.objects.create(period="day", max_requests=8)
    cookie = session_cookie(alice)

    async def scenario():
        servers = [live_stack, second_stack] * 10
        return await asyncio.gather(*(chat(server, cookie, chat_frame(f"Say {i}.", 2)) for i, server in enumerate(servers)))

    results = asyncio.run(scenario())
    ends = [frames[-1] for frames in results]
    assert sum(end["type"] == "done" for end in ends) == 8
    refused = [end for end in ends if end["type"] == "refused"]
    assert len(refused) == 12 and {end["code"] for end in refused} == {"user_requests_per_day"}
    assert TokenLog.objects.filter(status=TokenLog.Status.OK).count() == 8
    assert TokenLog.objects.filter(status=TokenLog.Status.REFUSED).count() == 12
