"""/ws/dashboard/: staff-only live feed — one point per settled or refused request, engine stats each second."""

from __future__ import annotations

import asyncio
import json

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from .live import DASHBOARD_GROUP

ENGINE_EVERY_S = 1.0


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.accept()
        self.engine_task = asyncio.create_task(self._push_engine_stats())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "engine_task", None)
        if task is not None:
            task.cancel()
        await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        # Read-only feed: anything a client sends is ignored, never an error that could be abused.
        return

    async def dashboard_point(self, event: dict) -> None:
        await self.send(text_data=json.dumps({**event, "type": "point"}))

    async def _push_engine_stats(self) -> None:
        from inference.bus import read_engine_stats

        while True:
            try:
                workers = await sync_to_async(read_engine_stats, thread_sensitive=False)()
            except Exception:  # noqa: BLE001 - Redis away: say nothing this tick, try the next
                workers = None
            if workers is not None:
                await self.send(text_data=json.dumps({"type": "engine", "workers": workers}))
            await asyncio.sleep(ENGINE_EVERY_S)
