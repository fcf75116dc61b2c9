"""Serving modes of a feature (Feature.mode): what differs from a streamed chat.

- chat: tokens stream as they are produced (the default; nothing here).
- extract: the model is asked for one JSON object; the session collects the answer and sends it
  once, parsed, as the `result` of the `done` event (or an `invalid_json` error).
- batch: many inputs run as a background job (inference/worker/batch.py); interactive chat is refused.

Plain functions only: the chat pipeline (inference/chat/) and the API decide what to do with them.
"""

from __future__ import annotations

import json
import re

EXTRACT_SYSTEM_PROMPT = (
    "You answer with one JSON object and nothing else: no prose before or after it, no code fences, "
    'no comments. Use double quotes for every key and string, e.g. {"key": "value"}.'
)
SNIPPET_CHARS = 80

_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)```", re.DOTALL)


class InvalidJSON(ValueError):
    """The model's answer holds no JSON object; the message says so in a sentence."""


def extract_messages(messages: list[dict]) -> list[dict]:
    """The conversation with the JSON-only instruction as its system prompt (joined to one given)."""
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{EXTRACT_SYSTEM_PROMPT}\n\n{messages[0]['content']}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": EXTRACT_SYSTEM_PROMPT}, *messages]


def schema_messages(messages: list[dict], schema: dict | None) -> list[dict]:
    """The JSON-only instruction for a response_format request, with the schema the object must follow."""
    messages = extract_messages(messages)
    if not schema:
        return messages
    # Right after the JSON-only instruction, before the client's own system prompt (if any).
    instruction, _, rest = messages[0]["content"].partition("\n\n")
    schema_text = f"The object follows this JSON Schema: {json.dumps(schema, separators=(',', ':'))}"
    content = "\n\n".join(part for part in (instruction, schema_text, rest) if part)
    return [{"role": "system", "content": content}, *messages[1:]]


def check_schema(value: dict, schema: dict | None) -> dict:
    """The object when it holds to the schema; else InvalidJSON saying where it does not."""
    if not schema:
        return value
    import jsonschema_rs

    error = next(iter(jsonschema_rs.validator_for(schema).iter_errors(value)), None)
    if error is None:
        return value
    where = "/".join(str(part) for part in error.instance_path) or "the top level"
    raise InvalidJSON(f"The model's JSON does not match the requested schema (at {where}: {error.message}).")


def extract_json(text: str) -> dict:
    """The JSON object in a model's answer: the whole answer, a fenced block, or the first {...} in it.

    Small models wrap JSON in prose or ```json fences; anything that decodes to an object is taken,
    first match wins. Raises InvalidJSON when there is none (an array or a number is not a result).
    """
    stripped = text.strip()
    candidates = [stripped, *(block.strip() for block in _FENCE.findall(stripped))]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    found = _first_object(stripped)
    if found is not None:
        return found
    raise InvalidJSON(_invalid_message(stripped))


def _first_object(text: str) -> dict | None:
    """The first '{' from which a whole JSON object decodes (braces inside strings are handled by the decoder)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


def _invalid_message(text: str) -> str:
    if not text:
        return "The model gave an empty answer, not a JSON object."
    snippet = text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "…"
    return f"The model's answer is not a JSON object (it began {snippet!r}). Try again, or ask more plainly for JSON."


def batch_only_message(feature_name: str) -> str:
    return f"The feature {feature_name!r} runs as a batch job; staff start it from the dashboard."


def tools_unsupported_message(feature_name: str) -> str:
    return (f"The feature {feature_name!r} runs on the local engine, which does not call tools; "
            "tools work with features served by a remote OpenAI-compatible provider.")
