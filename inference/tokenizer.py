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


def model_name() -> str:
    from django.conf import settings

    return settings.CEILING_MODEL_NAME
