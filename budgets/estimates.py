"""A remote provider's prompt, counted before it is sent: an upper bound that learns from the bills.

Ceiling does not have a remote model's tokenizer, and what a remote bills for a prompt includes
what its chat template adds (role markers, a tool list rendered as text with its instructions).
So a remote request is reserved at

    estimate = ceil(base × ratio × 1.05)
    base     = tokens of the JSON of everything sent, counted by the caller's tokenizer
               + 4 a message + 8 a request

"Everything sent" is what reaches the remote and is billed as prompt: messages of every role with
their tool calls and tool results, `tools`, `tool_choice`, `functions`, `response_format`. The
caller counts with the shipped model's tokenizer (SmolLM2's: a 49K vocabulary, one token per digit),
which counts more tokens than the large vocabularies most served models use (Llama 3's 128K,
Qwen's 151K, GPT-4o's 200K); three bytes a token, the usual rule of thumb, is not an upper bound at
all for numbers, hex or CJK text (measured in docs/budgets.md). `ratio` starts at 1 and is the
highest ratio of reported to base tokens this provider and model have ever shown: when a remote
bills more than its estimate (an overshoot, recorded on the row and alerted), the next reservation
covers it. It only rises, so an estimate never shrinks below one that was once needed.

The 5% margin covers what the JSON's form changes between here and the remote: the prompt's
fields are stored as PostgreSQL jsonb for the worker, which reorders object keys, and the same
tools in another key order count a few tokens more or less (0.6% on a 200-tool list).

The ratios live in one Redis hash beside the guard's counters (no expiry); losing it costs nothing
but a return to the default.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

import redis

from . import redis_clients

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 3  # a remote's answer reported without usage: at most max_tokens anyway
TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds around each message
TOKENS_PER_REQUEST = 8  # the assistant's opening, and a tool list's preamble beyond its JSON
MARGIN = 1.05  # the same JSON in another key order counts a little differently (the module's docstring)
RATIO_KEY = "ceiling:prompt-ratio"
# The remote's request fields that are read as prompt (and billed as prompt tokens).
PROMPT_FIELDS = ("tools", "tool_choice", "functions", "function_call", "response_format")

# max(ratio, new) in one step: of two settles learning at once, the higher one stays.
RAISE_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local new = tonumber(ARGV[2])
if new > current then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
return tostring(current)
"""


def sent_text(messages: list[dict], params: dict | None = None) -> str:
    """What a remote reads as its prompt, as JSON: the messages and the prompt-like fields."""
    given = params or {}
    sent = {"messages": messages, **{name: given[name] for name in PROMPT_FIELDS if given.get(name) is not None}}
    return json.dumps(sent, ensure_ascii=False)


def base_estimate(messages: list[dict], params: dict | None, count_tokens: Callable[[str], int]) -> int:
    """The unscaled estimate of a remote prompt's tokens (see the module's docstring)."""
    return count_tokens(sent_text(messages, params)) + TOKENS_PER_MESSAGE * len(messages) + TOKENS_PER_REQUEST


def text_estimate(text: str) -> int:
    """An upper estimate of a text's tokens from its size alone (a remote that reports no usage)."""
    return -(-len(text.encode("utf-8", errors="surrogatepass")) // BYTES_PER_TOKEN)


def ratio_field(provider_id: int, model: str) -> str:
    return f"{provider_id}:{model}"


def _client() -> redis.Redis:
    return redis_clients.shared_client(redis_clients.counters_url(), 0.5)


def learned_ratio(provider_id: int, model: str) -> float:
    """The highest reported ÷ base seen for this provider and model, at least 1."""
    raw = _client().hget(RATIO_KEY, ratio_field(provider_id, model))
    try:
        return max(1.0, float(raw)) if raw is not None else 1.0
    except ValueError:
        return 1.0


def prompt_estimate(provider_id: int, model: str, messages: list[dict], params: dict | None,
                    count_tokens: Callable[[str], int]) -> int:
    """What a remote request's prompt is reserved at: the base scaled by what this remote has billed before.

    Raises redis.RedisError when the ratios cannot be read: the guard is on the same Redis and
    would refuse anyway (fail closed).
    """
    return math.ceil(base_estimate(messages, params, count_tokens) * learned_ratio(provider_id, model) * MARGIN)


def learn_ratio(provider_id: int, model: str, reported_prompt_tokens: int, base: int) -> float | None:
    """Raise the provider's ratio to reported ÷ base when that is higher; the ratio now, or None when
    Redis could not be reached (the next overshoot teaches it again)."""
    if base <= 0 or reported_prompt_tokens <= 0:
        return None
    # Rounded up to 1/1000, so the rounding itself never leaves an estimate a token short.
    observed = math.ceil(reported_prompt_tokens / base * 1000) / 1000
    try:
        return float(_client().eval(RAISE_LUA, 1, RATIO_KEY, ratio_field(provider_id, model), f"{observed:.3f}"))
    except redis.RedisError as exc:
        log.warning("could not record the prompt ratio of provider %s: %s", provider_id, exc)
        return None
