"""The model's tokenizer in the web process: prompt tokens are counted exactly before admission."""

from __future__ import annotations

import logging
import threading
from functools import lru_cache

from inference.engine import encode_chat
from inference.engines import model_dir
from inference.variants import variant_model_name

log = logging.getLogger(__name__)

_tokenizer = None
_tokenizer_lock = threading.Lock()


def get_tokenizer():
    """Loaded once per process; concurrent first callers wait for the one load."""
    global _tokenizer
    if _tokenizer is None:
        with _tokenizer_lock:
            if _tokenizer is None:
                from transformers import AutoTokenizer

                _tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    return _tokenizer


def load_tokenizer_now() -> None:
    """Load the tokenizer before the web process takes its first connection, so its first chat does not pay.

    Importing transformers and reading the tokenizer costs a web process about 1.5 s of CPU. Loaded in
    a background thread (as before), the page answered while it loaded, and the first chat sent right
    after waited for it: 1,032 ms to its first token against ~80 ms for the next ones (`bench
    --first-run`, 2-core AMD EPYC, Zen 4, 2026-12-07). Done here, the page answers once a chat can be
    served. The size check's longest token (~50 ms over the vocabulary) is found here too. A failure
    is logged and left to the first request, which loads it again and reports the error.
    """
    try:
        get_tokenizer()
        longest_token_bytes()
    except Exception:  # noqa: BLE001 - the first request loads it again and reports the error
        log.exception("loading the tokenizer at start failed")


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    return encode_chat(get_tokenizer(), messages)


def count_text_tokens(text: str) -> int:
    """Tokens of a text in the shipped model's tokenizer: the base of a remote prompt's estimate
    (budgets/estimates.py), whose small vocabulary counts high."""
    return len(get_tokenizer().encode(text, add_special_tokens=False))


def model_name(feature=None) -> str:
    """The model a request goes to, as logged and priced: a remote provider's model, else ours.

    The feature's provider must already be loaded (select_related) when called from async code.
    """
    from django.conf import settings

    provider = getattr(feature, "provider", None) if feature is not None else None
    if provider is not None and provider.kind == "openai-compatible":
        return provider.remote_model or settings.CEILING_MODEL_NAME
    return variant_model_name(feature.quantization if feature is not None else "none")



@lru_cache(maxsize=1)
def longest_token_bytes() -> int:
    """No token is longer than this in UTF-8, so bytes / this is a floor on the token count."""
    tokenizer = get_tokenizer()
    longest = max(len(tokenizer.convert_tokens_to_string([token]).encode()) for token in tokenizer.get_vocab())
    return max(1, longest)


def input_too_long_by_size(messages: list[dict], limit: int) -> str | None:
    """The cheap check: refuse a huge paste from its size alone, without tokenizing it."""
    size = sum(len((m.get("content") or "").encode()) for m in messages)
    if size > limit * longest_token_bytes() + 64 * len(messages):
        return (
            f"Your conversation is {size:,} bytes, far more than the {limit:,} tokens allowed. "
            "Shorten it and try again."
        )
    return None


def input_too_long_by_count(prompt_tokens: int, limit: int, estimated: bool = False) -> str | None:
    if prompt_tokens > limit:
        size = f"up to {prompt_tokens:,} tokens long (an estimate from its size, tools included)" if estimated \
            else f"{prompt_tokens:,} tokens long"
        return f"Your conversation is {size}; the limit is {limit:,}. Shorten it and try again."
    return None
