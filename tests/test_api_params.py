"""OpenAI's generation parameters as the API validates them, stop strings, and the rate-limit duration.

Pure functions only; what the running stack does with the same values is tests/test_api_gateway.py.
"""

from __future__ import annotations

import pytest

from inference.web import modes
from inference.web.params import DEFAULT, ParamError, parse_params
from inference.web.ratelimits import duration
from inference.worker.handles import openai_logprobs, sampling_of
from inference.worker.stops import StopMatcher


@pytest.mark.parametrize(
    ("body", "code", "param", "words"),
    [
        ({"temperature": 2.5}, "decimal_above_max_value", "temperature", "Expected a value <= 2, but got 2.5 instead."),
        ({"temperature": -0.1}, "decimal_below_min_value", "temperature", "Expected a value >= 0"),
        ({"temperature": "hot"}, "invalid_type", "temperature", "expected a decimal, but got a string instead"),
        ({"top_p": 1.5}, "decimal_above_max_value", "top_p", "<= 1"),
        ({"presence_penalty": 3}, "decimal_above_max_value", "presence_penalty", "<= 2"),
        ({"frequency_penalty": -2.5}, "decimal_below_min_value", "frequency_penalty", ">= -2"),
        ({"seed": 1.5}, "invalid_type", "seed", "expected an integer"),
        ({"seed": True}, "invalid_type", "seed", "got a boolean"),
        ({"seed": 2**64}, "integer_above_max_value", "seed", "integer above maximum value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "array_above_max_length", "stop", "maximum length 4, but got an array with length 5"),
        ({"stop": 7}, "invalid_type", "stop", "a string or an array of strings"),
        ({"stop": ["ok", ""]}, "empty_string", "stop", "'stop[1]'"),
        ({"stop": ["ok", 3]}, "invalid_type", "stop[1]", "expected a string"),
        ({"n": 2}, "unsupported_value", "n", "'n' must be 1, not 2. Send 2 requests instead"),
        ({"n": 0}, "integer_below_min_value", "n", ">= 1"),
        ({"n": "2"}, "invalid_type", "n", "an integer"),
        ({"logprobs": "yes"}, "invalid_type", "logprobs", "a boolean"),
        ({"top_logprobs": 21, "logprobs": True}, "integer_above_max_value", "top_logprobs", "<= 20"),
        ({"top_logprobs": 3}, "invalid_value", "top_logprobs", "'logprobs' must be set to true"),
        ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format.type", "'json_object'"),
        ({"response_format": "json"}, "invalid_type", "response_format", "an object"),
        ({"response_format": {"type": "json_schema"}}, "missing_required_parameter", "response_format.json_schema", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "invalid_json_schema", "response_format", "not a valid JSON Schema"),
        ({"tools": {"type": "function"}}, "invalid_type", "tools", "an array"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_value", "tools[0]", "function"),
        ({"tool_choice": "auto"}, "invalid_value", "tool_choice", "only allowed when 'tools' are specified"),
        ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]},
         "invalid_value", "tool_choice", "'sometimes'"),
        ({"user": 42}, "invalid_type", "user", "a string"),
        ({"user": "x" * 300}, "invalid_value", "user", "at most 256 characters"),
    ],
)
def test_each_bad_value_is_refused_as_openai_refuses_it(body, code, param, words):
    with pytest.raises(ParamError) as refused:
        parse_params(body)
    assert (refused.value.code, refused.value.param) == (code, param)
    assert words in refused.value.message


def test_good_values_are_kept_and_only_those_given_are_stored():
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    params = parse_params({
        "temperature": 1.2, "top_p": 0.9, "seed": 7, "stop": "END", "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "n": 1, "logprobs": True, "top_logprobs": 3, "user": "end-user-9",
        "response_format": {"type": "json_object"}, "tools": [tool], "tool_choice": "auto",
    })
    assert params.stored() == {
        "temperature": 1.2, "top_p": 0.9, "seed": 7, "stop": ["END"], "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "logprobs": True, "top_logprobs": 3,
        "response_format": {"type": "json_object"}, "tools": [tool], "tool_choice": "auto",
    }
    assert params.end_user == "end-user-9" and params.json_mode == "json_object" and not params.cacheable
    assert parse_params({"model": "m", "messages": [], "response_format": {"type": "text"}, "n": 1}) == DEFAULT
    assert DEFAULT.cacheable and DEFAULT.stored() == {}


def test_the_engine_accepts_every_value_the_api_accepts():
    sampling = sampling_of(parse_params({"temperature": 2, "top_p": 1, "seed": -5, "presence_penalty": -2,
                                         "frequency_penalty": 2, "logprobs": True, "top_logprobs": 20}).stored())
    assert sampling.temperature == 2 and sampling.top_logprobs == 20 and sampling.problem() is None
    assert sampling_of({}).greedy and sampling_of({}).plain
    # top_p 0 (OpenAI: the likeliest token only) is greedy, or a sliver of the distribution when sampling.
    assert sampling_of(parse_params({"top_p": 0}).stored()).greedy
    assert 0 < sampling_of(parse_params({"top_p": 0, "temperature": 1}).stored()).top_p < 0.001


def test_a_json_schema_is_part_of_the_prompt_and_checked_on_the_answer():
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    messages = modes.schema_messages([{"role": "user", "content": "Alice is 30."}], schema)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(modes.EXTRACT_SYSTEM_PROMPT)
    assert messages[0]["content"].endswith('JSON Schema: {"type":"object","properties":{"age":{"type":"integer"}},"required":["age"]}')
    with_system = modes.schema_messages([{"role": "system", "content": "Be terse."}, *messages[1:]], schema)
    assert with_system[0]["content"].endswith('"required":["age"]}\n\nBe terse.') and len(with_system) == 2
    assert modes.check_schema({"age": 30}, schema) == {"age": 30}
    with pytest.raises(modes.InvalidJSON, match=r"does not match the requested schema \(at age: \"30\" is not of type \"integer\"\)"):
        modes.check_schema({"age": "30"}, schema)
    with pytest.raises(modes.InvalidJSON, match="at the top level: \"age\" is a required property"):
        modes.check_schema({}, schema)


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(piece) for piece in pieces)


def test_a_stop_string_cuts_the_answer_even_across_pieces():
    matcher = StopMatcher(["END", "\n\n"])
    shown = feed_all(matcher, ["Hello", " wor", "ld E", "N", "D and more", " after"])
    assert shown == "Hello world " == matcher.released and matcher.stopped
    assert matcher.flush() == ""


def test_the_earliest_stop_wins_and_text_without_one_is_all_shown():
    matcher = StopMatcher(["b", "abc"])
    assert feed_all(matcher, ["xxab", "c"]) == "xxa" and matcher.stopped

    matcher = StopMatcher(["STOP"])
    shown = feed_all(matcher, ["ST", "O", "P?", " no: STO"])
    assert shown == "" and matcher.stopped  # "STOP" arrived whole across three pieces
    matcher = StopMatcher(["STOP"])
    shown = feed_all(matcher, ["a ST", "OR", "Y of STO"])
    assert shown + matcher.flush() == "a STORY of STO" and not matcher.stopped


class FakeTokenizer:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_the_engines_logprobs_become_openai_entries():
    entries = openai_logprobs(FakeTokenizer(), [1, 2], [(-0.1, [(1, -0.1), (3, -2.5)]), (-0.7, [])])
    assert entries == [
        {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "c", "logprob": -2.5, "bytes": [99]}]},
        {"token": "b", "logprob": -0.7, "bytes": [98], "top_logprobs": []},
    ]
    assert openai_logprobs(FakeTokenizer(), [1], None) is None


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45, "45s"), (360, "6m0s"), (3725, "1h2m5s"), (90061, "25h1m1s")])
def test_a_reset_reads_as_openai_writes_it(seconds, text):
    assert duration(seconds) == text
