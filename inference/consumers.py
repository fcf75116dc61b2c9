"""/ws/chat/: the end user's chat socket (wire protocol in README.md).

One generation at a time per socket. It runs in an asyncio task that `disconnect()` and a
`{"type": "cancel"}` frame cancel; cancelling tells the worker's engine to stop at its next step.
What happens to one request (admission, the guard, relaying the worker's tokens) lives in
inference/session.py, which the OpenAI-compatible HTTP API shares.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from channels.generic.websocket import AsyncWebsocketConsumer

from .frames import CancelFrame, ChatFrame, FrameError, parse_frame
from .session import TERMINAL, run_chat


class ChatConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.user = self.scope.get("user")
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        self.generation: asyncio.Task | None = None
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self._cancel_generation()

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
        # aclosing: when this task is cancelled mid-send, the session still hears about it and cancels.
        async with aclosing(run_chat(self.user, frame)) as events:
            async for event in events:
                if event["type"] in TERMINAL:
                    # The answer is over for the client once it reads this frame, and it may send its
                    # next one at once; the session's clean-up after it (closing the request's queue)
                    # must not make that next frame "busy".
                    self._release_socket()
                await self.send_json(event)

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
