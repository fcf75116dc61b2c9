"""Stage 2, route: the feature that serves the request, and what its mode adds to the later stages.

A plain chat streams its tokens. The other modes add to that, each in one place:

- docs: passages the user may read go into the prompt before it is counted (checks.py), their
  sources ride on `accepted`, and the cache key carries who may read them (cache.py);
- extract, and any request with response_format: the JSON instruction goes into the prompt
  (checks.py), and the tokens are collected into one parsed `result` on `done` (relay.py);
- batch: no interactive chat at all (refused here); its jobs run in inference/worker/batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from channels.db import database_sync_to_async

from budgets.models import Feature, Provider, unique_row
from inference.web import modes
from inference.web.frames import ChatFrame, has_tool_turns

from .events import error


@dataclass(frozen=True)
class Mode:
    """What a feature's mode (and the request's response_format) adds to a plain chat."""

    retrieves: bool = False  # docs: passages into the prompt, sources on `accepted`
    collects_json: bool = False  # extract / response_format: one JSON object on `done`, no tokens
    schema: dict | None = None  # response_format json_schema: the object must hold to it


@dataclass(frozen=True)
class Route:
    feature: Feature
    mode: Mode


async def route(frame: ChatFrame) -> Route | dict:
    """The request's route, or the error event that ends it (an unknown feature, a batch-only one,
    tools for a feature on the local engine)."""
    feature = await get_feature(frame.feature)
    if feature is None:
        return error("unknown_feature", f"There is no feature named {frame.feature!r}.")
    if feature.mode == Feature.Mode.BATCH:
        return error("batch_only", modes.batch_only_message(feature.name))
    if (frame.params.tools or has_tool_turns(frame.messages)) and not is_remote(feature):
        return error("tools_unsupported", modes.tools_unsupported_message(feature.name))
    return Route(feature, mode_of(feature, frame))


def mode_of(feature: Feature, frame: ChatFrame) -> Mode:
    if feature.mode == Feature.Mode.DOCS:
        return Mode(retrieves=True)
    if feature.mode == Feature.Mode.EXTRACT:
        return Mode(collects_json=True)
    if frame.params.json_mode:
        return Mode(collects_json=True, schema=frame.params.json_schema)
    return Mode()


def is_remote(feature: Feature) -> bool:
    return feature.provider is not None and feature.provider.kind == Provider.Kind.OPENAI_COMPATIBLE


# Off the one thread-sensitive thread, as the admission: 64 chats arriving together queued there for
# this lookup alone, ~470 ms for the median chat before its admission could start.
@partial(database_sync_to_async, thread_sensitive=False)
def get_feature(name: str) -> Feature | None:
    return unique_row(Feature.objects.select_related("provider", "fallback__provider").filter(name=name))
