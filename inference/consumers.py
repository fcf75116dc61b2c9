"""/ws/chat/: the end user's chat socket (wire protocol in README.md).

One generation at a time per socket. It runs in an asyncio task that `disconnect()` and a
`{"type": "cancel"}` frame cancel; cancelling tells the worker's engine to stop at its next step.
Tokens come back from the worker through the channel-layer group "req.<request_id>".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from budgets.actions import do_log_refusal
from budgets.guard import Decision, LoopLimits
from budgets.models import Feature, TokenLog

from . import bus
from .actions import do_admit_request, do_finish_request, settle_reservation
from .frames import CancelFrame, ChatFrame, FrameError, parse_frame
from .tokenizer import chat_prompt_ids, input_too_long_by_count, input_too_long_by_size, model_name

log = logging.getLogger(__name__)


class ChatConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.user = self.scope.get("user")
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        self.generation: asyncio.Task | None = None
        self.stream: asyncio.Queue = asyncio.Queue()
        self.request_id: str | None = None
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

    # --- one chat request ------------------------------------------------------------------------

    async def _chat(self, frame: ChatFrame) -> None:
        request_id = uuid.uuid4().hex
        try:
            await self._admit_and_stream(request_id, frame)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("chat request %s failed", request_id)
            await self.send_json(
                {"type": "error", "code": "internal", "message": "Something went wrong on our side; please try again."}
            )

    async def _admit_and_stream(self, request_id: str, frame: ChatFrame) -> None:
        feature = await get_feature(frame.feature)
        if feature is None:
            await self.send_json(
                {"type": "error", "code": "unknown_feature", "message": f"There is no feature named {frame.feature!r}."}
            )
            return
        if not feature.enabled:
            message = f"The feature {feature.name!r} is switched off by the operators."
            await log_refusal(request_id, self.user, feature, "feature_disabled", message, 0, frame.max_tokens)
            await self.send_json({"type": "refused", "code": "feature_disabled", "message": message, "retry_after_s": None})
            return
        limit = min(feature.max_input_tokens, settings.CEILING_MAX_INPUT_TOKENS)
        prompt_ids: list[int] = []
        refusal = input_too_long_by_size(frame.messages, limit)
        if refusal is None:
            prompt_ids = await sync_to_async(chat_prompt_ids, thread_sensitive=False)(frame.messages)
            refusal = input_too_long_by_count(len(prompt_ids), limit)
        if refusal is not None:
            await log_refusal(request_id, self.user, feature, "max_input_tokens", refusal, len(prompt_ids), frame.max_tokens)
            await self.send_json({"type": "refused", "code": "max_input_tokens", "message": refusal, "retry_after_s": None})
            return
        max_tokens = min(frame.max_tokens, feature.max_output_tokens)
        group = bus.request_group(request_id)
        # Join the group before the worker can publish the first token.
        await self.channel_layer.group_add(group, self.channel_name)
        self.request_id, self.stream = request_id, asyncio.Queue()
        try:
            loop = LoopLimits(frame.loop_id, settings.CEILING_LOOP_MAX_CALLS, settings.CEILING_LOOP_MAX_COST_MICRO_USD) if frame.loop_id else None
            decision = await admit_request(request_id, self.user, feature, frame.messages, prompt_ids, max_tokens, loop)
            if not decision.admitted:
                await self.send_json(
                    {"type": "refused", "code": decision.code, "message": decision.message, "retry_after_s": decision.retry_after_s}
                )
                return
            await self.send_json(
                {"type": "accepted", "request_id": request_id, "prompt_tokens": len(prompt_ids), "max_tokens": decision.max_tokens}
            )
            if decision.warning:
                await self.send_json({"type": "notice", "code": "nearing_cap", "message": decision.warning})
            await dispatch_generation(request_id)
            await self._relay(request_id)
        except asyncio.CancelledError:
            await bus.arequest_cancel(request_id)
            raise
        finally:
            self.request_id = None
            await self.channel_layer.group_discard(group, self.channel_name)

    async def _relay(self, request_id: str) -> None:
        """Forward the worker's frames until done/failed, within the first-token and total timeouts."""
        started = time.monotonic()
        first_token_seen = False
        while True:
            if first_token_seen:
                budget = settings.CEILING_TOTAL_TIMEOUT_S - (time.monotonic() - started)
            else:
                budget = settings.CEILING_FIRST_TOKEN_TIMEOUT_S
            try:
                event = await asyncio.wait_for(self.stream.get(), timeout=max(budget, 0.01))
            except TimeoutError:
                await bus.arequest_cancel(request_id)
                what = "The model did not start answering" if not first_token_seen else "The answer did not finish"
                limit = settings.CEILING_FIRST_TOKEN_TIMEOUT_S if not first_token_seen else settings.CEILING_TOTAL_TIMEOUT_S
                await self.send_json(
                    {"type": "error", "code": "timeout", "message": f"{what} within {limit:.0f} s; please try again."}
                )
                return
            kind = event.pop("type")
            if kind == "chat.token":
                first_token_seen = True
                await self.send_json({"type": "token", **event})
            elif kind == "chat.done":
                await self.send_json({"type": "done", **event, "cache": "miss"})
                return
            elif kind == "chat.failed":
                await self.send_json({"type": "error", **event})
                return

    async def _cancel_generation(self) -> None:
        task = self.generation
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # --- channel-layer handlers: one per message type from the worker ---------------------------

    async def chat_token(self, event: dict) -> None:
        await self._enqueue(event)

    async def chat_done(self, event: dict) -> None:
        await self._enqueue(event)

    async def chat_failed(self, event: dict) -> None:
        await self._enqueue(event)

    async def _enqueue(self, event: dict) -> None:
        if event.get("request_id") == self.request_id:
            self.stream.put_nowait(dict(event))

    async def send_json(self, content: dict) -> None:
        await self.send(text_data=json.dumps(content))


# --- database helpers --------------------------------------------------------------------------


@database_sync_to_async
def get_feature(name: str) -> Feature | None:
    return Feature.objects.filter(name=name).first()


@database_sync_to_async
def admit_request(request_id, user, feature, messages, prompt_ids, max_tokens, loop) -> Decision:
    return do_admit_request(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model_name(),
        messages=messages,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        loop=loop,
    )


@database_sync_to_async
def log_refusal(request_id, user, feature, code, message, prompt_tokens, max_tokens) -> None:
    do_log_refusal(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model_name(),
        code=code,
        message=message,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )


@sync_to_async(thread_sensitive=False)
def dispatch_generation(request_id: str) -> None:
    from .tasks import generate

    try:
        generate.apply_async(args=[request_id], queue="inference", retry=False)
    except Exception as exc:
        # Never leave an admitted request holding its reservation because the broker was away.
        fail_undispatched(request_id, str(exc))
        raise


def fail_undispatched(request_id: str, error: str) -> None:
    from django.db import close_old_connections

    close_old_connections()
    do_finish_request(
        request_id, status=TokenLog.Status.FAILED, prompt_tokens=0, completion_ids=[], text="",
        finish_reason="", ttft_ms=None, error=f"could not reach the workers: {error}",
    )
    settle_reservation(request_id)
