"""Chat messages → prompt token ids, exactly as the model's chat template lays them out."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
