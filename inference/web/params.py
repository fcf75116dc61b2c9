"""OpenAI's generation parameters: validated with OpenAI's ranges and error codes, carried to the worker.

    params = parse_params(body)          # raises ParamError (→ HTTP 400) on the first bad value
    params.stored()                      # the JSON kept in Transcript.params for the worker
    params.json_mode                     # None, "json_object" or "json_schema"

Only the values a client gave are kept: an empty `stored()` is the greedy answer the chat page and
the answer caches know. Temperature absent means 0 (greedy), unlike OpenAI's default of 1, so an
old client's answers stay as they were and cacheable.

The messages read like OpenAI's own ("Invalid 'temperature': decimal above maximum value. Expected a
value <= 2, but got 3 instead."), with the same codes, so a client that handles OpenAI's 400s
handles ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .text import storable

MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20
MAX_END_USER_CHARS = 256  # Transcript.end_user
# OpenAI's own limit is 128; the servers Ceiling forwards to (vLLM, llama.cpp) set none, and every tool
# is counted in the request's reservation, so a long list costs its sender, never the ceiling.
MAX_TOOLS = 512
SEED_RANGE = (-(2**63), 2**63 - 1)

# name → (lowest, highest) of the numbers OpenAI accepts.
RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")


class ParamError(ValueError):
    """A parameter OpenAI would refuse: code and param as OpenAI names them, and a sentence."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class GenerationParams:
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None  # None for "text"
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    end_user: str = ""

    @property
    def json_mode(self) -> str | None:
        return self.response_format["type"] if self.response_format else None

    @property
    def json_schema(self) -> dict | None:
        if self.json_mode != "json_schema":
            return None
        return self.response_format["json_schema"].get("schema") or {}

    def stored(self) -> dict:
        """What the worker needs, as JSON: only what the client gave (the end user is kept apart)."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "stop": list(self.stop) or None, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "logprobs": self.logprobs or None,
            "top_logprobs": self.top_logprobs, "response_format": self.response_format,
            "tools": self.tools, "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls,
        }
        return {name: value for name, value in values.items() if value is not None}

    @property
    def cacheable(self) -> bool:
        """Answer caches hold greedy plain answers only: a sampled or shaped answer is not one of them."""
        return not self.stored()


DEFAULT = GenerationParams()


def parse_params(data: dict) -> GenerationParams:
    """The generation parameters of a completion body; raises ParamError on the first bad one."""
    _check_n(data.get("n"))
    top_logprobs = _integer(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    logprobs = _boolean(data, "logprobs")
    if top_logprobs and not logprobs:
        raise ParamError("invalid_value", "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is given.", "top_logprobs")
    tools = _tools(data.get("tools"))
    return GenerationParams(
        temperature=_number(data, "temperature"),
        top_p=_top_p(data),
        seed=_integer(data, "seed", *SEED_RANGE),
        stop=_stop(data.get("stop")),
        presence_penalty=_number(data, "presence_penalty"),
        frequency_penalty=_number(data, "frequency_penalty"),
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs,
        response_format=_response_format(data.get("response_format")),
        tools=tools,
        tool_choice=_tool_choice(data.get("tool_choice"), tools),
        parallel_tool_calls=_boolean(data, "parallel_tool_calls"),
        end_user=_end_user(data.get("user")),
    )


# --- one parameter each --------------------------------------------------------------------------


def _type_error(name: str, expected: str, value: Any) -> ParamError:
    return ParamError("invalid_type", f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.", name)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, int):
        return "an integer"
    return "null" if value is None else type(value).__name__


def _number(data: dict, name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a decimal", value)
    low, high = RANGES[name]
    if value > high:
        raise ParamError("decimal_above_max_value", f"Invalid '{name}': decimal above maximum value. Expected a value <= {high:g}, but got {value} instead.", name)
    if value < low:
        raise ParamError("decimal_below_min_value", f"Invalid '{name}': decimal below minimum value. Expected a value >= {low:g}, but got {value} instead.", name)
    return float(value)


def _top_p(data: dict) -> float | None:
    value = _number(data, "top_p")
    if value == 0:
        # OpenAI accepts 0 and means "the most likely token only"; the engine needs a share above 0.
        return None if data.get("temperature") in (None, 0) else 1e-6
    return value


def _integer(data: dict, name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if value > high:
        raise ParamError("integer_above_max_value", f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, but got {value} instead.", name)
    if value < low:
        raise ParamError("integer_below_min_value", f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got {value} instead.", name)
    return value


def _boolean(data: dict, name: str) -> bool | None:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _check_n(value: Any) -> None:
    if value is None or value == 1 and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error("n", "an integer", value)
    if value < 1:
        raise ParamError("integer_below_min_value", f"Invalid 'n': integer below minimum value. Expected a value >= 1, but got {value} instead.", "n")
    raise ParamError(
        "unsupported_value",
        f"Ceiling answers with one choice per request, so 'n' must be 1, not {value}. Send {value} requests instead "
        "(each one counts against your allowance).",
        "n",
    )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOPS:
        raise ParamError("array_above_max_length", f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOPS}, but got an array with length {len(stops)} instead.", "stop")
    for index, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise _type_error(f"stop[{index}]", "a string", stop)
        if not stop:
            raise ParamError("empty_string", f"Invalid 'stop[{index}]': empty string. Expected a string with minimum length 1, but got an empty string instead.", "stop")
    return tuple(stops)


def _response_format(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("response_format", "an object", value)
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ParamError("invalid_value", f"Invalid value for 'response_format.type': expected one of {', '.join(map(repr, RESPONSE_FORMATS))}, but got {kind!r} instead.", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ParamError("missing_required_parameter", "Missing required parameter: 'response_format.json_schema.name'.", "response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict) or not _schema_is_valid(schema):
        raise ParamError("invalid_json_schema", f"Invalid schema for response_format '{spec['name']}': it is not a valid JSON Schema.", "response_format")
    return {"type": "json_schema", "json_schema": spec}


def _schema_is_valid(schema: dict) -> bool:
    import jsonschema_rs  # the Rust validator: checking a schema, and an answer against it, costs microseconds

    try:
        return jsonschema_rs.meta.is_valid(schema)
    except Exception:  # noqa: BLE001 - a schema it cannot even read is not a valid one
        return False


def _tools(value: Any) -> list | None:
    """Tools are the remote server's business; here only their outline is checked (OpenAI's shape)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _type_error("tools", "an array", value)
    if len(value) > MAX_TOOLS:
        raise ParamError("array_above_max_length", f"Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, but got an array with length {len(value)} instead.", "tools")
    for index, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict) \
                or not isinstance(tool["function"].get("name"), str):
            raise ParamError("invalid_value", f"Invalid 'tools[{index}]': expected {{\"type\": \"function\", \"function\": {{\"name\": …}}}}.", f"tools[{index}]")
    return value or None


def _tool_choice(value: Any, tools: list | None) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ParamError("invalid_value", f"Invalid value for 'tool_choice': expected one of {', '.join(map(repr, TOOL_CHOICES))} or a named function, but got {value!r} instead.", "tool_choice")
    elif not isinstance(value, dict) or value.get("type") != "function":
        raise _type_error("tool_choice", "a string or a named function", value)
    if value != "none" and not tools:
        raise ParamError("invalid_value", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.", "tool_choice")
    return value


def _end_user(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _type_error("user", "a string", value)
    if len(value) > MAX_END_USER_CHARS or not storable(value):
        raise ParamError("invalid_value", f"Invalid 'user': expected a string of at most {MAX_END_USER_CHARS} characters.", "user")
    return value
