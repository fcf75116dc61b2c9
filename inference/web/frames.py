"""Client → server websocket frames: parsed and validated before any expensive work."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from django.conf import settings

from budgets.tags import MAX_TAGS, TAG_RULE, is_tag, normalise_tag

from .params import DEFAULT, GenerationParams
from .text import storable

ROLES = ("system", "user", "assistant", "tool")
# The roles an agent's conversation may end on: a user's question, or the results of the tools the
# model called (the next step of a tool loop).
LAST_ROLES = ("user", "tool")
MAX_NAME_CHARS = 64  # OpenAI's limit on a message's `name` and a tool call's function name
DEFAULT_FEATURE = "chat"  # a chat frame without "feature", and the API's served model name, select it


class FrameError(ValueError):
    """A frame we cannot act on; code and message go back to the client in an `error` frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# JSON nested deeper than this is refused before it is parsed: Python's decoder recurses once per
# level, and "[" * 3000 raised RecursionError (not ValueError), which reached the client as a 500
# page or a dropped socket. Real requests (tool schemas included) nest a dozen levels at most.
MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep `text`'s arrays and objects nest (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_limited(data: str | bytes, what: str) -> object:
    """json.loads, with any failure (deep nesting, bad UTF-8, a 5,000-digit number) as FrameError bad_json."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    # Counting brackets is C-speed; only a text with that many scans for its depth.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise FrameError("bad_json", f"The {what} nests JSON deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise FrameError("bad_json", f"The {what} is not valid JSON.") from None


@dataclass(frozen=True)
class ChatFrame:
    feature: str
    messages: list[dict]
    max_tokens: int
    loop_id: str | None = None
    # OpenAI's sampling and shaping parameters; only the HTTP API sets them (the chat page is greedy).
    params: GenerationParams = DEFAULT
    # Up to MAX_TAGS names a tag's spend cap counts against and the token log filters by.
    tags: tuple[str, ...] = ()
    # Set by the HTTP API (the accounts.ApiKey the request came with, whose own caps apply), never
    # read from a client's frame.
    api_key: object | None = None
    # Set by the HTTP API from X-Ceiling-Team (a team the user is in), never read from a frame.
    team: str = ""


@dataclass(frozen=True)
class CancelFrame:
    pass


def parse_frame(text: str | None) -> ChatFrame | CancelFrame:
    if text is None:
        raise FrameError("bad_frame", "Send text frames containing JSON; binary frames are not accepted.")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > settings.CEILING_MAX_FRAME_BYTES:
        raise FrameError(
            "frame_too_large",
            f"The message is {size:,} bytes; the limit is {settings.CEILING_MAX_FRAME_BYTES:,} bytes.",
        )
    data = loads_limited(text, "frame")
    if not isinstance(data, dict):
        raise FrameError("bad_frame", "The frame must be a JSON object with a \"type\".")
    kind = data.get("type")
    if kind == "cancel":
        return CancelFrame()
    if kind == "chat":
        return parse_chat(data)
    raise FrameError("unknown_type", f"Unknown frame type {kind!r}; expected \"chat\" or \"cancel\".")


def parse_chat(data: dict) -> ChatFrame:
    """The fields of a chat request (also the body of POST /v1/chat/completions), validated."""
    feature = data.get("feature", DEFAULT_FEATURE)
    if not isinstance(feature, str) or not feature or not storable(feature):
        raise FrameError("bad_feature", "\"feature\" must be the name of a feature, such as \"chat\".")
    loop_id = data.get("loop_id")
    if loop_id is not None and (not isinstance(loop_id, str) or not 0 < len(loop_id) <= 64 or not storable(loop_id)):
        raise FrameError("bad_loop_id", "\"loop_id\" must be a string of 1 to 64 characters.")
    return ChatFrame(
        feature=feature,
        messages=_parse_messages(data.get("messages")),
        max_tokens=_parse_max_tokens(data.get("max_tokens", settings.CEILING_DEFAULT_MAX_TOKENS)),
        loop_id=loop_id,
        tags=parse_tags(data.get("tags")),
    )


def parse_tags(value) -> tuple[str, ...]:
    """A list of at most MAX_TAGS tag names, each as TAG_RE says once trimmed and lower-cased
    (normalise_tag); repeats, in any spelling, count once; order kept."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(tag, str) for tag in value):
        raise FrameError("bad_tags", "\"tags\" must be a list of tag names, such as [\"support\", \"beta\"].")
    tags = tuple(dict.fromkeys(normalise_tag(tag) for tag in value))
    if len(tags) > MAX_TAGS:
        raise FrameError("bad_tags", f"{len(tags)} tags is too many; a request may carry at most {MAX_TAGS}.")
    for tag in tags:
        if not is_tag(tag):
            shown = tag[:40] if storable(tag) else "(not text)"
            raise FrameError(
                "bad_tags",
                f"The tag {shown!r} is not a tag name: use {TAG_RULE}.",
            )
    return tags


def _parse_messages(messages) -> list[dict]:
    """OpenAI's message shapes, kept as sent (a remote engine gets them unchanged), text parts joined.

    system/user/assistant with text content; an assistant's `tool_calls` (its content may then be
    null); `tool` messages with the `tool_call_id` they answer; an optional `name`.
    """
    if not isinstance(messages, list) or not messages:
        raise FrameError("bad_messages", "\"messages\" must be a non-empty list of {role, content} objects.")
    if len(messages) > settings.CEILING_MAX_MESSAGES:
        raise FrameError(
            "bad_messages", f"{len(messages)} messages is too many; the limit is {settings.CEILING_MAX_MESSAGES}."
        )
    cleaned = [_parse_message(index, message) for index, message in enumerate(messages)]
    if cleaned[-1]["role"] not in LAST_ROLES:
        raise FrameError("bad_role", "The last message must come from the user (or be a tool's result).")
    return cleaned


def _parse_message(index: int, message) -> dict:
    where = f"Message {index + 1}"
    if not isinstance(message, dict):
        raise FrameError("bad_messages", f"{where} is not an object with role and content.")
    role = message.get("role")
    if role not in ROLES:
        raise FrameError("bad_role", f"{where} has role {role!r}; use one of {', '.join(ROLES)}.")
    cleaned: dict = {"role": role}
    tool_calls = _parse_tool_calls(where, message.get("tool_calls")) if role == "assistant" else None
    content = _text_content(where, message.get("content"))
    if not tool_calls and (content is None or not content.strip()):
        raise FrameError("empty_content", f"{where} has no text content.")
    cleaned["content"] = content
    if tool_calls:
        cleaned["tool_calls"] = tool_calls
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id or not storable(call_id):
            raise FrameError("bad_messages", f"{where} is a tool result without the \"tool_call_id\" it answers.")
        cleaned["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not storable(name):
            raise FrameError("bad_messages", f"{where} has a \"name\" that is not a string of 1 to {MAX_NAME_CHARS} characters.")
        cleaned["name"] = name
    return cleaned


def _text_content(where: str, content) -> str | None:
    """A message's text: a string, or OpenAI's list of text parts joined; None when absent (null)."""
    if content is None:
        return None
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise FrameError("bad_messages", f"{where} has content parts other than text; only text is accepted.")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise FrameError("empty_content", f"{where} has no text content.")
    if not storable(content):
        raise FrameError("bad_text", f"{where} contains a NUL character or an unpaired surrogate, which is not text.")
    return content


def _parse_tool_calls(where: str, calls) -> list[dict] | None:
    """An assistant's earlier tool calls, in OpenAI's shape: id, type "function", name and arguments."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise FrameError("bad_messages", f"{where} has \"tool_calls\" that is not a list.")
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(call.get("id"), str) and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments", ""), str)
                and storable(call["id"] + function["name"] + function.get("arguments", ""))):
            raise FrameError(
                "bad_messages",
                f"{where} has a tool call that is not {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}.",
            )
        parsed.append({"id": call["id"], "type": "function",
                       "function": {"name": function["name"], "arguments": function.get("arguments", "")}})
    return parsed or None


def has_tool_turns(messages: list[dict]) -> bool:
    """Whether a conversation holds a tool loop's steps (tool calls or results), which the local engine cannot serve."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def message_text(message: dict) -> str:
    """A message's text ("" for an assistant's tool-call-only turn)."""
    return message.get("content") or ""


def _parse_max_tokens(value) -> int:
    limit = settings.CEILING_MAX_TOKENS_LIMIT
    # bool is an int in Python; true/false is never a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise FrameError("bad_max_tokens", f"\"max_tokens\" must be a whole number from 1 to {limit}.")
    if not 1 <= value <= limit:
        raise FrameError("bad_max_tokens", f"\"max_tokens\" is {value}; it must be from 1 to {limit}.")
    return value
