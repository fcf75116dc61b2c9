"""The websockets: /ws/chat/ (ChatConsumer, the end user's chat) and /ws/dashboard/ (DashboardConsumer, staff).

/ws/chat/ (wire protocol in docs/protocol.md): one generation at a time per socket. It runs in an asyncio task that `disconnect()` and a
`{"type": "cancel"}` frame cancel; cancelling tells the worker's engine to stop at its next step.
What happens to one request (admission, the guard, relaying the worker's tokens) lives in
inference/chat/ (the pipeline), which the OpenAI-compatible HTTP API shares.

/ws/dashboard/: the staff's live feed, one point per settled or refused request (budgets' ledger
signal, relayed by inference/live.py) and the workers' engine stats each second. It lives here,
not in budgets, because it reads the engines' stats.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import DatabaseError
from django.utils import timezone

from budgets.live import DASHBOARD_GROUP
from budgets.usage import today_allowance

from .bus.stats import read_engine_stats
from .chat.events import TERMINAL
from .chat.pipeline import run_chat
from .revocation import still_allowed, user_group
from .web.frames import CancelFrame, ChatFrame, FrameError, parse_frame

log = logging.getLogger(__name__)
# The frames after which the chat page redraws "left today": the answer was settled, or refused.
WITH_ALLOWANCE = frozenset({"done", "refused"})


class ChatConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.user = self.scope.get("user")
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        self.generation: asyncio.Task | None = None
        await self.channel_layer.group_add(user_group(self.user.pk), self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self._cancel_generation()
        if getattr(self, "user", None) is not None and self.user.is_authenticated:
            await self.channel_layer.group_discard(user_group(self.user.pk), self.channel_name)

    async def session_check(self, event: dict) -> None:
        """The user logged out, or their row changed: close unless they may still chat (revocation.py)."""
        if not await still_allowed(self.scope, event, staff=False):
            await self._cancel_generation()
            await self.close(code=4401)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            frame = parse_frame(text_data)
        except FrameError as exc:
            await self.send_json({"type": "error", "code": exc.code, "message": exc.message})
            return
        if isinstance(frame, CancelFrame):
            await self._cancel_generation()
            return
        if self.generation is not None and not self.generation.done():
            await self.send_json(
                {"type": "error", "code": "busy", "message": "An answer is still streaming; cancel it or wait for it."}
            )
            return
        self.generation = asyncio.create_task(self._chat(frame))

    async def _chat(self, frame: ChatFrame) -> None:
        # aclosing: when this task is cancelled mid-send, the chat request still hears about it and cancels.
        async with aclosing(run_chat(self.user, frame)) as events:
            async for event in events:
                if event["type"] in TERMINAL:
                    # The answer is over for the client once it reads this frame, and it may send its
                    # next one at once; the chat request's clean-up after it (closing the request's queue)
                    # must not make that next frame "busy".
                    self._release_socket()
                if event["type"] in WITH_ALLOWANCE:
                    event = {**event, "allowance": await self._allowance()}
                await self.send_json(event)

    async def _allowance(self) -> dict | None:
        # Read after the request settled (the worker settles before it sends done), so it counts it.
        try:
            return await database_sync_to_async(today_allowance)(self.user, timezone.now())
        except DatabaseError:
            # The answer must still reach the user; the page keeps its last allowance line.
            log.warning("could not read today's allowance of user %s", self.user.pk, exc_info=True)
            return None

    def _release_socket(self) -> None:
        if self.generation is asyncio.current_task():
            self.generation = None

    async def _cancel_generation(self) -> None:
        task = getattr(self, "generation", None)
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def send_json(self, content: dict) -> None:
        await self.send(text_data=json.dumps(content))


ENGINE_EVERY_S = 1.0


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.channel_layer.group_add(user_group(user.pk), self.channel_name)
        self.user_id = user.pk
        await self.accept()
        self.engine_task = asyncio.create_task(self._push_engine_stats())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "engine_task", None)
        if task is not None:
            task.cancel()
        await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)
        if getattr(self, "user_id", None) is not None:
            await self.channel_layer.group_discard(user_group(self.user_id), self.channel_name)

    async def session_check(self, event: dict) -> None:
        """The user logged out or their row changed: close unless they are still active staff (revocation.py)."""
        if not await still_allowed(self.scope, event, staff=True):
            await self.close(code=4403)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        # Read-only feed: anything a client sends is ignored, never an error that could be abused.
        return

    async def dashboard_points(self, event: dict) -> None:
        # A process's batch of settled rows (budgets.live): each still reaches the page as its own point.
        for point in event["points"]:
            await self.dashboard_point(point)

    async def dashboard_point(self, event: dict) -> None:
        await self.send(text_data=json.dumps({**event, "type": "point"}))

    async def _push_engine_stats(self) -> None:
        while True:
            try:
                workers = await sync_to_async(read_engine_stats, thread_sensitive=False)()
            except Exception:  # noqa: BLE001 - Redis away: say nothing this tick, try the next
                workers = None
            if workers is not None:
                await self.send(text_data=json.dumps({"type": "engine", "workers": workers}))
            await asyncio.sleep(ENGINE_EVERY_S)
