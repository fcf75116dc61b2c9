"""Token ids → text, incrementally: what each step added, never a broken character."""

from __future__ import annotations


class IncrementalDecoder:
    """Token ids → text pieces in O(1) per token, holding back an incomplete UTF-8 character.

    Decoding the whole answer at every token costs O(n) each, O(n²) per answer. As vLLM does, only a
    short window is decoded: the text of ids[prefix:] minus that of ids[prefix:read] is what the new
    ids added (a byte-level BPE decodes a window exactly as it does inside the whole answer; a test
    checks the pieces add up to the full decode).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window starts here: context for the ids being decoded
        self.read_offset = 0  # ids before this have been sent as text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        known = self._decode(self.prefix_offset, self.read_offset)
        extended = self._decode(self.prefix_offset, len(self.ids))
        if len(extended) <= len(known) or extended.endswith("\ufffd"):
            return ""  # nothing printable yet, or a character still incomplete: wait for more ids
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return extended[len(known) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True) if end > start else ""
