"""Only logged-in users from our own origin get a chat socket."""

from __future__ import annotations

import asyncio

import pytest
from websockets.exceptions import InvalidStatus

from tests.conftest import session_cookie
from tests.wsclient import chat_socket

pytestmark = pytest.mark.django_db(transaction=True)


def _handshake_status(live_stack, cookie, origin=None) -> int:
    async def attempt():
        async with chat_socket(live_stack, cookie, origin=origin):
            return 101

    try:
        return asyncio.run(attempt())
    except InvalidStatus as exc:
        return exc.response.status_code


def test_an_anonymous_connection_is_refused(live_stack):
    assert _handshake_status(live_stack, cookie=None) == 403


def test_a_forged_session_cookie_is_refused(live_stack):
    assert _handshake_status(live_stack, cookie="not-a-real-session") == 403


def test_a_foreign_origin_is_refused_even_with_a_valid_session(live_stack, alice):
    cookie = session_cookie(alice)
    assert _handshake_status(live_stack, cookie, origin="http://evil.example") == 403


def test_a_logged_in_user_from_our_origin_is_accepted(live_stack, alice):
    assert _handshake_status(live_stack, session_cookie(alice)) == 101
