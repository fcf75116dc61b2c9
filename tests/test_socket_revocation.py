"""Open websockets follow their user's rights: a logout, a deactivation or lost staff rights close them
(before: a socket authenticated at its handshake stayed open and usable until the client closed it)."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings
from django.test import Client
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.wsclient import chat_socket, next_frame, send

pytestmark = pytest.mark.django_db(transaction=True)


def logged_in(user) -> tuple[Client, str]:
    client = Client()
    client.force_login(user)
    return client, client.cookies[settings.SESSION_COOKIE_NAME].value


async def close_code(ws, timeout: float = 15) -> int | None:
    """The code the server closes the socket with (every frame before it is read and dropped)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else None


async def still_answers(ws) -> bool:
    await send(ws, "not json")
    return (await next_frame(ws, timeout=15))["code"] == "bad_json"


def test_logging_out_closes_the_users_chat_socket(live_stack, alice):
    client, cookie = logged_in(alice)

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            assert await still_answers(ws)
            await asyncio.to_thread(client.logout)
            return await close_code(ws)

    assert asyncio.run(scenario()) == 4401


def test_deactivating_a_user_closes_their_chat_socket_and_another_users_change_does_not(live_stack, alice, bob):
    _, cookie = logged_in(alice)

    def save(user, **fields):
        for name, value in fields.items():
            setattr(user, name, value)
        user.save()

    async def scenario():
        async with chat_socket(live_stack, cookie) as ws:
            await asyncio.to_thread(save, bob, first_name="Bob")  # someone else's row: nothing happens here
            await asyncio.sleep(0.5)
            assert await still_answers(ws)
            await asyncio.to_thread(save, alice, is_active=False)
            return await close_code(ws)

    assert asyncio.run(scenario()) == 4401


def test_losing_staff_rights_closes_the_dashboard_socket(live_stack, staff):
    _, cookie = logged_in(staff)

    async def scenario():
        async with connect(live_stack.ws_url.replace("/ws/chat/", "/ws/dashboard/"), origin=live_stack.http_url,
                           additional_headers={"Cookie": f"sessionid={cookie}"}, open_timeout=10) as ws:
            await next_frame(ws, timeout=15)  # the feed is live: engine stats each second
            staff.is_staff = False
            await asyncio.to_thread(staff.save)
            return await close_code(ws)

    assert asyncio.run(scenario()) == 4403
