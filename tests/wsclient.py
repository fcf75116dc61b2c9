"""A small real websocket client for the tests: a user's session cookie, the right Origin."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from websockets.asyncio.client import connect

TERMINAL = ("done", "error", "refused")


@asynccontextmanager
async def chat_socket(live_stack, cookie: str | None, origin: str | None = None):
    headers = {"Cookie": f"sessionid={cookie}"} if cookie else {}
    async with connect(
        live_stack.ws_url,
        origin=origin or live_stack.http_url,
        additional_headers=headers,
        max_size=4 * 1024 * 1024,
        open_timeout=10,
    ) as ws:
        yield ws


def chat_frame(content: str, max_tokens: int = 16, feature: str = "chat", **extra) -> dict:
    return {"type": "chat", "feature": feature, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


async def send(ws, frame: dict | str) -> None:
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))


async def next_frame(ws, timeout: float = 60) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=timeout))


async def read_until_end(ws, timeout: float = 120) -> list[dict]:
    """Every frame up to and including the first done/error/refused."""
    frames = []
    while True:
        frame = await next_frame(ws, timeout)
        frames.append(frame)
        if frame["type"] in TERMINAL:
            return frames


async def chat(live_stack, cookie: str, frame: dict) -> list[dict]:
    async with chat_socket(live_stack, cookie) as ws:
        await send(ws, frame)
        return await read_until_end(ws)
