"""Open websockets follow their user's rights: a logout, a deactivation or lost staff rights close them.

A socket is authenticated once, at its handshake; without this, a chat socket outlived its user's
logout or deactivation and a dashboard socket its user's staff rights. Each socket joins its user's
channel group; a logout (Django's user_logged_out) or any change to the user row (post_save, other
than a login's last_login) sends that group one `session.check`, and each socket then reads its user
and session again and closes when they no longer allow it (4401 for the chat, 4403 for the dashboard).
"""

from __future__ import annotations

import logging

import redis
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db.models.signals import post_save

log = logging.getLogger(__name__)

CHECK = {"type": "session.check"}


def user_group(user_id: int) -> str:
    return f"user.{user_id}"


def tell_sockets_to_check(user_id: int, ended_session: str | None = None) -> None:
    """Ask every open socket of the user to check its rights again. Never raises: the change itself stands.

    ended_session: the session a logout ends. Django sends user_logged_out *before* it flushes the
    session, so a socket that read the session store at once could still find it: the socket of that
    session closes on the key alone.
    """
    try:
        async_to_sync(get_channel_layer().group_send)(user_group(user_id), {**CHECK, "ended_session": ended_session})
    except Exception as exc:  # noqa: BLE001 - the channel layer away: sockets keep their rights until they close
        # An unreachable Redis is one line (`make run` seeds its users before its Redis starts); anything else a traceback.
        unreachable = isinstance(exc, OSError | redis.ConnectionError)
        log.warning("could not tell the sockets of user %s to check their session: %s", user_id, exc,
                    exc_info=not unreachable)


def on_logged_out(sender, request=None, user=None, **kwargs) -> None:
    if user is not None:
        session = getattr(request, "session", None)
        tell_sockets_to_check(user.pk, getattr(session, "session_key", None))


def on_user_saved(sender, instance, created: bool = False, update_fields=None, **kwargs) -> None:
    if created or (update_fields is not None and set(update_fields) <= {"last_login"}):
        return  # a new user has no socket; a login changes no right
    tell_sockets_to_check(instance.pk)


def connect() -> None:
    user_logged_out.connect(on_logged_out, dispatch_uid="ceiling-sockets-logout")
    post_save.connect(on_user_saved, sender=get_user_model(), dispatch_uid="ceiling-sockets-user-saved")


async def still_allowed(scope, event: dict, *, staff: bool) -> bool:
    """Whether the socket may stay open after a `session.check` event: not the session a logout ends,
    its user still active (and staff, for the dashboard), its session still stored."""
    ended = event.get("ended_session")
    if ended and ended == getattr(scope.get("session"), "session_key", None):
        return False
    return await _user_and_session_valid(scope, staff=staff)


@database_sync_to_async
def _user_and_session_valid(scope, *, staff: bool) -> bool:
    user, session = scope.get("user"), scope.get("session")
    fresh = get_user_model().objects.filter(pk=user.pk, is_active=True).only("is_staff").first()
    if fresh is None or (staff and not fresh.is_staff):
        return False
    key = getattr(session, "session_key", None)
    return key is None or session.exists(key)
