"""The model's tokenizer in the web process: prompt tokens are counted exactly before admission."""

from __future__ import annotations

from functools import lru_cache

from .engine import encode_chat
from .modelfiles import model_dir


@lru_cache(maxsize=1)
def get_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    return encode_chat(get_tokenizer(), messages)


def model_name(feature=None) -> str:
    """The model a request goes to, as logged and priced: a remote provider's model, else ours.

    The feature's provider must already be loaded (select_related) when called from async code.
    """
    from django.conf import settings

    provider = getattr(feature, "provider", None) if feature is not None else None
    if provider is not None and provider.kind == "openai-compatible" and provider.remote_model:
        return provider.remote_model
    return settings.CEILING_MODEL_NAME


@lru_cache(maxsize=1)
def longest_token_bytes() -> int:
    """No token is longer than this in UTF-8, so bytes / this is a floor on the token count."""
    tokenizer = get_tokenizer()
    longest = max(len(tokenizer.convert_tokens_to_string([token]).encode()) for token in tokenizer.get_vocab())
    return max(1, longest)


def input_too_long_by_size(messages: list[dict], limit: int) -> str | None:
    """The cheap check: refuse a huge paste from its size alone, without tokenizing it."""
    size = sum(len(m["content"].encode()) for m in messages)
    if size > limit * longest_token_bytes() + 64 * len(messages):
        return (
            f"Your conversation is {size:,} bytes, far more than the {limit:,} tokens allowed. "
            "Shorten it and try again."
        )
    return None


def input_too_long_by_count(prompt_tokens: int, limit: int) -> str | None:
    if prompt_tokens > limit:
        return f"Your conversation is {prompt_tokens:,} tokens long; the limit is {limit:,}. Shorten it and try again."
    return None
